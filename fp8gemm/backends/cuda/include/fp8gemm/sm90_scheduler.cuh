// Persistent tile scheduler: CTA b takes tiles b, b + gridDim.x, b + 2 * gridDim.x, ...
// Tiles are rasterised in bands so that the tiles running at one time share A rows and B columns
// in L2. Written over (m_block, n_block) of one GEMM; grouped variants map their groups onto the
// same bands later.
#pragma once

#include "sm90_utils.cuh"

namespace fp8gemm {

// kBandAlongM = false: bands of kBandSize n-blocks; inside a band n varies fastest, so the two CTAs
//   of a cluster (consecutive tiles) share m_block: what multicast of A needs.
// kBandAlongM = true: bands of kBandSize m-blocks, m fastest: the pair shares n_block (multicast of B).
// NOTE: with a 2-CTA cluster the host guarantees an even band size and an even block count on the
// banded side, so tiles 2j and 2j + 1 always share the multicast operand.
template <uint32_t kNumNBlocks, uint32_t kBandSize, bool kBandAlongM>
struct TileScheduler {
  uint32_t num_m_blocks;
  uint32_t num_tiles;
  uint32_t next_tile;

  __device__ __forceinline__ explicit TileScheduler(uint32_t num_m_blocks_)
      : num_m_blocks(num_m_blocks_), num_tiles(num_m_blocks_ * kNumNBlocks), next_tile(blockIdx.x) {}

  __device__ __forceinline__ void tile_coords(uint32_t tile, uint32_t& m_block, uint32_t& n_block) const {
    if constexpr (!kBandAlongM) {
      const uint32_t tiles_per_band = kBandSize * num_m_blocks;
      const uint32_t band = tile / tiles_per_band;
      const uint32_t first_n = band * kBandSize;
      const uint32_t width = kNumNBlocks - first_n < kBandSize ? kNumNBlocks - first_n : kBandSize;
      const uint32_t in_band = tile - band * tiles_per_band;
      m_block = in_band / width;
      n_block = first_n + in_band % width;
    } else {
      const uint32_t tiles_per_band = kBandSize * kNumNBlocks;
      const uint32_t band = tile / tiles_per_band;
      const uint32_t first_m = band * kBandSize;
      const uint32_t height = num_m_blocks - first_m < kBandSize ? num_m_blocks - first_m : kBandSize;
      const uint32_t in_band = tile - band * tiles_per_band;
      n_block = in_band / height;
      m_block = first_m + in_band % height;
    }
  }

  // The next tile of this CTA; false when none is left.
  __device__ __forceinline__ bool next(uint32_t& m_block, uint32_t& n_block) {
    if (next_tile >= num_tiles) return false;
    tile_coords(next_tile, m_block, n_block);
    next_tile += gridDim.x;
    return true;
  }
};

}  // namespace fp8gemm
