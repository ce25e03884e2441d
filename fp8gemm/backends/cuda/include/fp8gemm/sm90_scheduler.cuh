// Persistent tile scheduler for dense and grouped GEMMs: CTA b takes the work items b,
// b + gridDim.x, b + 2 * gridDim.x, ... of one fixed sequence, which the producer and the math
// warps walk independently (it depends only on kernel arguments and the grouped layout in global
// memory, which nothing writes while the kernel runs).
//
// Tiles are rasterised in bands so that the tiles running at one time share A rows and B columns
// in L2. Grouped kinds walk their groups in order, each group's tiles banded the same way, so one
// expert's B stays in L2 while its M blocks run. TileScheduler serves the 1D2D kernel's kinds,
// Scheduler1d1d the weight-gradient kernel (dense, and k-grouped with each group's K read on the
// device).
// Only the device functions of sm90_utils.cuh are used, so that tests/test_cuda_scheduler.py can
// run these walks on the CPU against host stand-ins of them.
#pragma once

#include "sm90_utils.cuh"

namespace fp8gemm {

// The GEMM kinds (GemmKind on the host).
constexpr uint32_t kKindDense = 0;       // A [M, K], one B
constexpr uint32_t kKindContiguous = 1;  // A [sum M, K], layout = m_indices [sum M] (-1: padding)
constexpr uint32_t kKindOffsets = 2;     // A [sum M, K], layout = offsets [G + 1]
constexpr uint32_t kKindMasked = 3;      // A [G, Mmax, K] as [G * Mmax, K], layout = masked_m [G]

// One output tile: rows [m0, m0 + BLOCK_M) of the 2-D views of A and D, one group's B.
struct Tile {
  int32_t m0;        // first row in the 2-D view of A and D
  int32_t sa_m;      // row coordinate of the A-scale map (row within the group for masked)
  uint32_t n_block;
  uint32_t group;
  uint32_t rows;     // rows of the group from m0 (offsets, masked; BLOCK_M or fewer)
  bool full;         // every row the TMA store would write belongs to the tile's group
  bool b_once;       // the group has one m-block: no other tile reads this tile's B
  uint32_t halves;   // bit h: rows [h * BLOCK_M / 2, (h + 1) * BLOCK_M / 2) hold rows of the tile
  uint32_t split;    // dense split-K: which of the kNumSplits k-ranges (set only when > 1)
  uint32_t part_tile;  // dense split-K: the tile's index in the walk (its slots and counter)
  bool multicast;    // pairs: both CTAs' tiles read the same group's B (set only with kPairs)
};

// Pairs: one block's groups, walked one tile at a time (cur: the group of the tile to come, -1
// once the block has no more).
struct BlockWalk {
  int32_t cur, last;
  uint32_t m0;
  bool uniform;      // the tile to come is the block's only group, no padding
  uint32_t halves;   // Tile::halves of the tile to come
};

// Rows of a contiguous-layout block as a warp sees them: every lane reads BLOCK_M / 32 rows.
struct BlockGroups {
  int32_t first;    // smallest valid group (num_groups when none)
  int32_t last;     // largest valid group (-1 when none)
  bool uniform;     // every row in [m0, min(m0 + BLOCK_M, M)) belongs to `first`
  uint32_t halves;  // bit h: half h of the block (lanes 16h..16h+15) has rows of `first`
};

// n int32 at p (a grouped layout, ks) sent to L1 by the warp, a 128-byte line a lane in turn.
__device__ __forceinline__ void prefetch_words_l1(const int32_t* p, uint32_t n) {
  for (uint32_t i = lane_idx() * 32; i < n; i += 32 * 32) prefetch_l1(p + i);
}

// The halves of a contiguous-layout block (BlockGroups::halves) that hold rows of group g, from
// the groups of each lane's rows of it (lanes 0-15 hold the first half).
template <uint32_t kRowsPerLane>
__device__ __forceinline__ uint32_t block_halves(const int32_t (&groups)[kRowsPerLane], int32_t g) {
  bool mine = false;
#pragma unroll
  for (uint32_t i = 0; i < kRowsPerLane; ++i) mine |= groups[i] == g;
  const uint32_t ballot = __ballot_sync(0xffffffffu, mine);
  return ((ballot & 0xffffu) != 0 ? 1u : 0u) | ((ballot >> 16) != 0 ? 2u : 0u);
}

// The group of row `row` of a contiguous layout; -1 for padding, rows past M and out-of-range
// indices (a bad index is never used to address B).
__device__ __forceinline__ int32_t row_group(const int32_t* layout, uint32_t row, uint32_t shape_m,
                                             uint32_t num_groups) {
  if (row >= shape_m) return -1;
  const int32_t g = __ldg(layout + row);
  return (g >= 0 && static_cast<uint32_t>(g) < num_groups) ? g : -1;
}

// kBandAlongM = false: bands of kBandSize n-blocks; inside a band n varies fastest, so the two CTAs
//   of a cluster (consecutive tiles) share m_block: what multicast of A needs.
// kBandAlongM = true: bands of kBandSize m-blocks, m fastest: the pair shares n_block (multicast of B).
// NOTE: with a 2-CTA cluster the host guarantees an even band size and an even block count on the
// banded side, so tiles 2j and 2j + 1 always share the multicast operand (dense only).
// Every method is called by a whole warp (the contiguous layout is read warp-wide).
// kNumSplits (dense only): each tile's K range is split in kNumSplits, each part a work item of
// its own; the parts of one tile are consecutive items (CTAs b, b + 1, ... of one wave).
// kPairs (contiguous, 2-CTA clusters sharing B): a work item is a pair of m-blocks (2p, 2p + 1)
// on one n-block, banded along M (kBandSize / 2 pairs a band), CTA rank r computing block
// 2p + r. The pair's two CTAs must run the same tiles in step (each releases every stage to both),
// so both walk both blocks' groups and take max(groups of block 2p, of 2p + 1) tiles per item: a
// CTA whose block has fewer (padding, fewer groups, past the last block) runs empty tiles
// (halves == 0: its stages are waited for and released, nothing loaded, computed or stored).
// A tile pair is multicast (one load of B into both CTAs) where both tiles are of one group.
template <uint32_t kKind, uint32_t BLOCK_M, uint32_t kNumNBlocks, uint32_t kBandSize, bool kBandAlongM,
          uint32_t kNumSplits = 1, bool kPairs = false>
struct TileScheduler {
  static_assert(kKind == kKindDense || kNumSplits == 1, "split-K is a dense schedule");
  static_assert(!kPairs || (kKind == kKindContiguous && kBandAlongM && kBandSize % 2 == 0),
                "pairs of m-blocks: contiguous, banded along M, whole pairs a band");
  uint32_t shape_m;     // rows of A as stored: M, sum M, or Mmax (masked)
  uint32_t num_groups;
  const int32_t* layout;
  uint32_t num_tiles;   // dense, contiguous: every (m_block, n_block) (dense split-K: its parts)
  uint32_t next_tile;
  // Offsets, masked: the group whose tiles [group_tile0, group_tile0 + group_tiles) come next.
  uint32_t group, group_tile0, group_tiles, group_row0, group_rows;
  // Contiguous: the groups of the first and last row of the next tile's block, loaded one tile
  // ahead so that the common case (both the same group) costs no wait on global memory.
  int32_t ahead_first, ahead_last;
  // Contiguous (not pairs): the (m, n) coordinates of tiles next_tile and next_tile + step, each
  // computed once, as the latter, and kept (a band walk divides).
  uint32_t ahead_m, ahead_n, after_m, after_n;
  // Contiguous: the block (m0, n-block) of the tile just returned, when it holds rows of several
  // groups (a layout not aligned to BLOCK_M): the groups after extra_group in it run next, on the
  // same n-block in the same CTA, so the repeated work spreads over the CTAs as the tiles do.
  uint32_t extra_m0, extra_n;
  int32_t extra_group, extra_last;
  // Pairs: this CTA's and its peer's block of the current item, its n-block, the CTA's rank, and
  // the peer block's ahead_first / ahead_last.
  BlockWalk own, peer;
  uint32_t item_n, rank;
  int32_t peer_ahead_first, peer_ahead_last;

  __device__ __forceinline__ TileScheduler(uint32_t shape_m_, const int32_t* layout_,
                                           uint32_t num_groups_)
      : shape_m(shape_m_), num_groups(num_groups_), layout(layout_),
        num_tiles(ceil_div(shape_m_, BLOCK_M) * kNumNBlocks * kNumSplits), next_tile(blockIdx.x),
        group(0), group_tile0(0), group_tiles(0), group_row0(0), group_rows(0),
        ahead_first(-1), ahead_last(-1), ahead_m(0), ahead_n(0), after_m(0), after_n(0),
        extra_m0(0), extra_n(0), extra_group(0), extra_last(-1) {
    if constexpr (kKind == kKindOffsets || kKind == kKindMasked) {
      // NOTE: the whole layout (G or G + 1 int32) goes to L1 at once: a warp advancing past a
      // group must read the next one's bounds before it knows its tile, and from L1 that wait
      // is a few dozen cycles instead of an L2 round trip per group.
      prefetch_words_l1(layout_, kKind == kKindOffsets ? num_groups + 1 : num_groups);
      if (num_groups > 0) load_group(0);
    }
    if constexpr (kPairs) {
      num_tiles = ceil_div(ceil_div(shape_m_, BLOCK_M), 2u) * kNumNBlocks;
      next_tile = blockIdx.x / 2;
      rank = cluster_cta_rank();
      own.cur = peer.cur = -1;
    }
    if constexpr (kKind == kKindContiguous) {
      if (!kPairs && next_tile < num_tiles) tile_coords(next_tile, num_items_m(), after_m, after_n);
      look_ahead();
    }
  }

  // Contiguous: items along M (m-blocks; pairs: pairs of them) and the step between a CTA's.
  __device__ __forceinline__ uint32_t num_items_m() const {
    return kPairs ? ceil_div(ceil_div(shape_m, BLOCK_M), 2u) : ceil_div(shape_m, BLOCK_M);
  }
  __device__ __forceinline__ static uint32_t item_step() {
    return kPairs ? gridDim.x / 2 : gridDim.x;
  }

  // Pairs: the walk of the block at m0 from its first tile, given the groups of its first and
  // last rows.
  __device__ __forceinline__ BlockWalk start_walk(uint32_t m0, int32_t first, int32_t last) const {
    BlockWalk w;
    w.m0 = m0;
    // (a block whose first and last rows belong to one group holds only that group: see next)
    if (first >= 0 && first == last) {
      w.cur = w.last = first, w.uniform = true, w.halves = 3;
      return w;
    }
    const BlockGroups bg = block_groups(m0);
    w.cur = bg.last < 0 ? -1 : bg.first, w.last = bg.last;
    w.uniform = bg.uniform, w.halves = bg.halves;
    return w;
  }

  // Pairs: past the walk's current tile.
  __device__ __forceinline__ void advance(BlockWalk& w) const {
    if (w.cur >= 0 && w.cur < w.last) {
      w.cur = next_group_in_block(w.m0, w.cur, w.halves);
      w.uniform = false;
    } else {
      w.cur = -1;
    }
  }

  // Contiguous, with next_tile just advanced: its coordinates (ahead_m, ahead_n: the previous
  // call's after_m, after_n) and the first and last row groups of its block (pairs: of item
  // next_tile's two blocks, this CTA's and its peer's); the coordinates of the tile after it.
  // NOTE: every warp waits here for these loads at the start of each tile (ptxas puts the group
  // checks right after them), so the block of the item after next_tile is sent to L1 now: the
  // next call's loads, and the scan of a block of several groups, then wait on L1, not L2.
  __device__ __forceinline__ void look_ahead() {
    if (next_tile >= num_tiles) return;
    constexpr uint32_t kStep = kPairs ? 2 : 1;  // m-blocks an item holds
    uint32_t m_block, n_block;
    if constexpr (kPairs) {  // (pairs recompute: their walk leaves no registers to keep these)
      tile_coords(next_tile, num_items_m(), m_block, n_block);
    } else {
      ahead_m = after_m, ahead_n = after_n;
      m_block = ahead_m;
    }
    if (next_tile + item_step() < num_tiles) {
      uint32_t m_after, n_after;
      tile_coords(next_tile + item_step(), num_items_m(), m_after, n_after);
      if constexpr (!kPairs) after_m = m_after, after_n = n_after;
      const uint32_t row = m_after * kStep * BLOCK_M + lane_idx() * 32;
      if (lane_idx() < kStep * BLOCK_M / 32 && row < shape_m) prefetch_l1(layout + row);
    }
    if constexpr (kPairs) {
      edge_groups((2 * m_block + (rank ^ 1)) * BLOCK_M, peer_ahead_first, peer_ahead_last);
      m_block = 2 * m_block + rank;
    }
    edge_groups(m_block * BLOCK_M, ahead_first, ahead_last);
  }

  // Contiguous: the groups of the first and last rows of the block at m0 (-1: none, past M).
  __device__ __forceinline__ void edge_groups(uint32_t m0, int32_t& first, int32_t& last) const {
    const uint32_t last_row = m0 + BLOCK_M < shape_m ? m0 + BLOCK_M - 1 : shape_m - 1;
    first = row_group(layout, m0, shape_m, num_groups);
    last = row_group(layout, last_row, shape_m, num_groups);
  }

  // (m_block, n_block) of tile `tile` of a band-rasterised grid of num_m_blocks x kNumNBlocks
  // (pairs: (pair, n_block) of num_m_blocks pairs, kBandSize / 2 pairs a band).
  __device__ __forceinline__ static void tile_coords(uint32_t tile, uint32_t num_m_blocks,
                                                     uint32_t& m_block, uint32_t& n_block) {
    if constexpr (kPairs)
      band_coords<kBandSize / 2>(tile, num_m_blocks, kNumNBlocks, m_block, n_block);
    else if constexpr (kBandAlongM)
      band_coords<kBandSize>(tile, num_m_blocks, kNumNBlocks, m_block, n_block);
    else
      band_coords<kBandSize>(tile, kNumNBlocks, num_m_blocks, n_block, m_block);
  }

  // Bands of kBand blocks along the banded side (of num_banded blocks), that side fastest inside
  // a band, the other side's num_other blocks each band's rows.
  template <uint32_t kBand>
  __device__ __forceinline__ static void band_coords(uint32_t tile, uint32_t num_banded,
                                                     uint32_t num_other, uint32_t& banded,
                                                     uint32_t& other) {
    const uint32_t tiles_per_band = kBand * num_other;
    const uint32_t band = tile / tiles_per_band;
    const uint32_t first = band * kBand;
    const uint32_t extent = num_banded - first < kBand ? num_banded - first : kBand;
    const uint32_t in_band = tile - band * tiles_per_band;
    // (every band but the last is kBand wide: a shift and a mask there, not a division)
    if (extent == kBand) {
      other = in_band / kBand;
      banded = first + in_band % kBand;
    } else {
      other = in_band / extent;
      banded = first + in_band % extent;
    }
  }

  // Offsets, masked: rows of group g, clamped so that bad values never address outside A or D.
  __device__ __forceinline__ void load_group(uint32_t g) {
    group = g;
    if constexpr (kKind == kKindMasked) {
      const int32_t rows = __ldg(layout + g);
      group_row0 = g * shape_m;
      group_rows = rows < 0 ? 0u : (static_cast<uint32_t>(rows) > shape_m ? shape_m : rows);
    } else {
      const int32_t lo_ = __ldg(layout + g), hi_ = __ldg(layout + g + 1);
      const uint32_t lo = lo_ < 0 ? 0u : (static_cast<uint32_t>(lo_) > shape_m ? shape_m : lo_);
      const uint32_t hi = hi_ < static_cast<int32_t>(lo) ? lo
                          : (static_cast<uint32_t>(hi_) > shape_m ? shape_m : hi_);
      group_row0 = lo;
      group_rows = hi - lo;
    }
    group_tiles = ceil_div(group_rows, BLOCK_M) * kNumNBlocks;
  }

  // Contiguous: which groups the rows of the block at m0 belong to (read by the whole warp).
  __device__ __forceinline__ BlockGroups block_groups(uint32_t m0) const {
    constexpr uint32_t kRowsPerLane = BLOCK_M / 32;
    const uint32_t lane = lane_idx();
    int32_t lo = static_cast<int32_t>(num_groups), hi = -1;
    bool any_padding = false;
    int32_t groups[kRowsPerLane];
#pragma unroll
    for (uint32_t i = 0; i < kRowsPerLane; ++i) {
      const uint32_t row = m0 + lane * kRowsPerLane + i;
      const int32_t g = row_group(layout, row, shape_m, num_groups);
      groups[i] = g;
      if (g >= 0) {
        lo = g < lo ? g : lo;
        hi = g > hi ? g : hi;
      } else if (row < shape_m) {
        any_padding = true;
      }
    }
    BlockGroups r;
    r.first = warp_min_s32(lo);
    r.last = warp_max_s32(hi);
    r.uniform = r.first == r.last && !__any_sync(0xffffffffu, any_padding);
    r.halves = block_halves(groups, r.first);
    return r;
  }

  // Contiguous: the smallest group above `after` that has rows in the block at m0 (num_groups
  // when none), and its halves (as BlockGroups::halves).
  __device__ __forceinline__ int32_t next_group_in_block(uint32_t m0, int32_t after,
                                                         uint32_t& halves) const {
    constexpr uint32_t kRowsPerLane = BLOCK_M / 32;
    const uint32_t lane = lane_idx();
    int32_t lo = static_cast<int32_t>(num_groups);
    int32_t groups[kRowsPerLane];
#pragma unroll
    for (uint32_t i = 0; i < kRowsPerLane; ++i) {
      const int32_t g = row_group(layout, m0 + lane * kRowsPerLane + i, shape_m, num_groups);
      groups[i] = g;
      lo = g > after && g < lo ? g : lo;
    }
    lo = warp_min_s32(lo);
    halves = block_halves(groups, lo);
    return lo;
  }

  // The next tile of this CTA; false when none is left.
  __device__ __forceinline__ bool next(Tile& t) {
    if constexpr (kKind == kKindDense) {
      if (next_tile >= num_tiles) return false;
      uint32_t m_block, n_block;
      tile_coords(next_tile / kNumSplits, ceil_div(shape_m, BLOCK_M), m_block, n_block);
      if constexpr (kNumSplits > 1) t.part_tile = next_tile / kNumSplits, t.split = next_tile % kNumSplits;
      next_tile += gridDim.x;
      t.m0 = t.sa_m = static_cast<int32_t>(m_block * BLOCK_M);
      t.n_block = n_block, t.group = 0, t.rows = BLOCK_M, t.full = true;
      t.b_once = shape_m <= BLOCK_M, t.halves = 3;
      return true;
    } else if constexpr (kPairs) {
      while (own.cur < 0 && peer.cur < 0) {
        if (next_tile >= num_tiles) return false;
        uint32_t pair, n_block;
        tile_coords(next_tile, num_items_m(), pair, n_block);
        next_tile += item_step();
        const int32_t first = ahead_first, last = ahead_last;
        const int32_t peer_first = peer_ahead_first, peer_last = peer_ahead_last;
        look_ahead();
        item_n = n_block;
        own = start_walk((2 * pair + rank) * BLOCK_M, first, last);
        peer = start_walk((2 * pair + (rank ^ 1)) * BLOCK_M, peer_first, peer_last);
      }
      t.m0 = t.sa_m = static_cast<int32_t>(own.m0);
      t.n_block = item_n, t.rows = BLOCK_M, t.b_once = false;
      if (own.cur >= 0) {
        t.group = static_cast<uint32_t>(own.cur), t.full = own.uniform, t.halves = own.halves;
      } else {
        // an empty tile: the peer's group keeps the B-scale reads in range
        t.group = static_cast<uint32_t>(peer.cur), t.full = false, t.halves = 0;
      }
      t.multicast = own.cur >= 0 && own.cur == peer.cur;
      advance(own);
      advance(peer);
      return true;
    } else if constexpr (kKind == kKindContiguous) {
      static_assert(BLOCK_M % 32 == 0 && BLOCK_M <= 256, "whole rows per lane in a block scan");
      // The further groups of the block just returned, each under its row mask.
      if (extra_group < extra_last) {
        extra_group = next_group_in_block(extra_m0, extra_group, t.halves);
        t.m0 = t.sa_m = static_cast<int32_t>(extra_m0);
        t.n_block = extra_n, t.group = static_cast<uint32_t>(extra_group), t.rows = BLOCK_M;
        t.full = false, t.b_once = false;
        return true;
      }
      // A block of padding only is skipped: no loads, no MMA, no stores.
      while (next_tile < num_tiles) {
        const uint32_t m_block = ahead_m, n_block = ahead_n;
        next_tile += item_step();
        const int32_t first = ahead_first, last = ahead_last;
        look_ahead();
        t.m0 = t.sa_m = static_cast<int32_t>(m_block * BLOCK_M);
        t.n_block = n_block, t.rows = BLOCK_M, t.b_once = false, t.halves = 3;
        // NOTE: the rows of a group are consecutive (padding rows follow them), so a block whose
        // first and last rows belong to one group holds only that group.
        if (first >= 0 && first == last) {
          t.group = static_cast<uint32_t>(first), t.full = true;
          return true;
        }
        const BlockGroups bg = block_groups(m_block * BLOCK_M);
        if (bg.last < 0) continue;
        t.group = static_cast<uint32_t>(bg.first), t.full = bg.uniform, t.halves = bg.halves;
        extra_m0 = m_block * BLOCK_M, extra_n = n_block;
        extra_group = bg.first, extra_last = bg.last;
        return true;
      }
      return false;
    } else {
      // Offsets, masked: advance to the group that holds tile next_tile.
      while (next_tile >= group_tile0 + group_tiles) {
        if (group + 1 >= num_groups) return false;
        group_tile0 += group_tiles;
        load_group(group + 1);
      }
      uint32_t m_block, n_block;
      tile_coords(next_tile - group_tile0, ceil_div(group_rows, BLOCK_M), m_block, n_block);
      next_tile += gridDim.x;
      const uint32_t row_in_group = m_block * BLOCK_M;
      t.m0 = static_cast<int32_t>(group_row0 + row_in_group);
      t.sa_m = static_cast<int32_t>(kKind == kKindMasked ? row_in_group : group_row0 + row_in_group);
      t.n_block = n_block, t.group = group;
      t.rows = group_rows - row_in_group < BLOCK_M ? group_rows - row_in_group : BLOCK_M;
      t.full = t.rows == BLOCK_M;
      t.b_once = group_rows <= BLOCK_M;
      t.halves = t.rows > BLOCK_M / 2 ? 3u : 1u;
      return true;
    }
  }
};

// One output tile and its k-blocks: rows [m0, m0 + BLOCK_M) of group `group`, k-blocks
// [kb0, kb0 + num_kb) of A, B and their scales.
struct Tile1d1d {
  int32_t m0;
  uint32_t n_block, group, kb0, num_kb;
};

// The tiles of a CTA. Dense: the dense TileScheduler's walk, every tile with all of K.
// K-grouped: tile t of the sequence is tile t % (tiles per group) of group t / (tiles per group),
// each group banded as a dense GEMM; the walk keeps the running K and k-block offsets of the
// groups it has passed (CTAs visit tiles in increasing order), reading ks as it goes.
template <bool kKGrouped, uint32_t BLOCK_M, uint32_t kNumNBlocks, uint32_t kBandSize>
struct Scheduler1d1d {
  using Dense = TileScheduler<kKindDense, BLOCK_M, kNumNBlocks, kBandSize, false>;
  Dense dense;
  const int32_t* ks;
  uint32_t num_groups, num_m_blocks, shape_k, next_tile;
  uint32_t group, k_off, kb_off;  // the first group not passed yet, and where it starts

  __device__ __forceinline__ Scheduler1d1d(uint32_t shape_m, uint32_t shape_k_, const int32_t* ks_,
                                           uint32_t num_groups_)
      : dense(shape_m, nullptr, 1), ks(ks_), num_groups(num_groups_),
        num_m_blocks(ceil_div(shape_m, BLOCK_M)), shape_k(shape_k_), next_tile(blockIdx.x),
        group(0), k_off(0), kb_off(0) {
    // NOTE: every tile reads its group's ks entry and uses it at once (its k-block count), so
    // each warp would wait for an L2 round trip at the start of each tile: ks goes to L1 now.
    if constexpr (kKGrouped) {
      prefetch_words_l1(ks_, num_groups);
    }
  }

  // K of group g starting at column k_off: ks[g] clamped to [0, shape_k - k_off].
  __device__ __forceinline__ uint32_t group_k(uint32_t g) const {
    const int32_t k = __ldg(ks + g);
    const uint32_t left = shape_k - k_off;
    return k <= 0 ? 0u : (static_cast<uint32_t>(k) < left ? static_cast<uint32_t>(k) : left);
  }

  __device__ __forceinline__ bool next(Tile1d1d& t) {
    if constexpr (!kKGrouped) {
      Tile tile;
      if (!dense.next(tile)) return false;
      t.m0 = tile.m0, t.n_block = tile.n_block, t.group = 0, t.kb0 = 0;
      t.num_kb = ceil_div(shape_k, 128u);
      return true;
    } else {
      const uint32_t tiles_per_group = num_m_blocks * kNumNBlocks;
      if (next_tile >= tiles_per_group * num_groups) return false;
      const uint32_t g = next_tile / tiles_per_group;
      for (; group < g; ++group) {
        const uint32_t k = group_k(group);
        k_off += k, kb_off += ceil_div(k, 128u);
      }
      uint32_t m_block, n_block;
      Dense::tile_coords(next_tile - g * tiles_per_group, num_m_blocks, m_block, n_block);
      next_tile += gridDim.x;
      t.m0 = static_cast<int32_t>(m_block * BLOCK_M), t.n_block = n_block, t.group = g;
      t.kb0 = kb_off, t.num_kb = ceil_div(group_k(g), 128u);
      return true;
    }
  }
};

}  // namespace fp8gemm
