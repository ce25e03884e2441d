// FP8 GEMM for sm_90a at small M (decode): D[M, N] (bf16) = (A * sa) . (B * sb)^T, computed as
// D^T = B . A^T (swap-AB) and split along K over a thread-block cluster.
//   A [M, K] e4m3, K-major; sa float32 per 1x128 group, column-major [ceil(K/128), M padded to 4]
//   B [N, K] e4m3, K-major; sb float32 per 128x128 block, row-major [ceil(N/128), ceil(K/128)]
//   D [M, N] bf16, rows `ld_out` elements apart (a multiple of 8), written untransposed.
// kMasked: the masked grouped GEMM of decode MoE, G GEMMs of the same N x K:
//   A [G, Mmax, K] as [G * Mmax, K]; sa [G, ceil(K/128), Mmax padded to 4]; B [G, N, K] as
//   [G * N, K]; sb [G, ceil(N/128), ceil(K/128)]; D [G, Mmax, N]; shape_m = Mmax; group g's
//   rows at or past masked_m[g] (read on the device) are neither computed nor written.
// One CTA per (tile, split): a tile is 64 rows of B (wgmma's M side) by BLOCK_M rows of A (its
// N side, 8..160 tokens); the kNumSplits CTAs of a cluster each take a contiguous range of the
// k-blocks and leave an FP32 partial tile in their own shared memory, which the cluster then
// sums in rank order through distributed shared memory (each CTA reduces and stores 1/kNumSplits
// of the tile). No workspace, no atomics: the same bits on every run, safe under graph capture.
// Masked, the grid holds `num_slots` token tiles per group and 64 rows of B (from the host's
// expected rows), and a cluster walks its group's token tiles slot, slot + num_slots, ... below
// masked_m[g]: every value of masked_m is computed, however many rows the host expected.
// Warp-specialised: one TMA producer warpgroup and two math warpgroups, which take alternate
// k-blocks of the even ring of kNumStages stages (one promotes while the other's wgmma runs)
// and add their sums, warpgroup 0's first, before the cluster's reduction.
#pragma once

#include "sm90_utils.cuh"
#include "sm90_wgmma_fp8.cuh"

namespace fp8gemm {

template <uint32_t SHAPE_N, uint32_t SHAPE_K, uint32_t BLOCK_M, uint32_t kNumSplits,
          uint32_t kNumStages, bool kMasked>
struct Sm90Fp8GemmSmallMLayout {
  static constexpr uint32_t BLOCK_K = 128;
  static constexpr uint32_t BLOCK_N = 64;  // rows of B per tile: wgmma's M
  static constexpr uint32_t kNumKBlocks = ceil_div(SHAPE_K, BLOCK_K);
  static constexpr uint32_t kMaxKBlocksPerSplit = ceil_div(kNumKBlocks, kNumSplits);
  // NOTE: B's TMA box never holds more rows than B has: a box past the tensor would be
  // zero-filled, which TMA does slowly; the wgmma rows past N read stale bytes that only feed
  // output columns the epilogue does not store.
  static constexpr uint32_t kBRows = SHAPE_N < BLOCK_N ? SHAPE_N : BLOCK_N;
  // A scales of a stage: BLOCK_M floats, a TMA destination on 128 bytes.
  static constexpr uint32_t kSaStage = ceil_div(BLOCK_M, 32u) * 32;
  // FP32 partial tile in output orientation: BLOCK_M rows (tokens) of 64 floats, 4 floats of
  // padding so that the scalar stores from the wgmma fragment hit 32 different banks.
  static constexpr uint32_t kRedStride = BLOCK_N + 4;
  // Shared memory, in carve-up order (B and A stages are multiples of 1024 bytes, so the TMA
  // destinations of the 128-byte swizzle stay 1024-byte aligned).
  static constexpr uint32_t SMEM_B = BLOCK_N * BLOCK_K;
  static constexpr uint32_t SMEM_A = BLOCK_M * BLOCK_K;
  static constexpr uint32_t SMEM_SA = kSaStage * 4;
  static constexpr uint32_t SMEM_SB = ceil_div(kMaxKBlocksPerSplit * 4, 16u) * 16;
  static constexpr uint32_t SMEM_RED = BLOCK_M * kRedStride * 4;
  // Masked with a split: the cluster's two reduction barriers (see the kernel) after the ring's.
  static constexpr uint32_t kNumRedBarriers = kMasked && kNumSplits > 1 ? 2 : 0;
  static constexpr uint32_t SMEM_BARRIERS = (2 * kNumStages + kNumRedBarriers) * 8;
  // 1024 bytes of slack to align the dynamic shared-memory base.
  static constexpr uint32_t kSmemBytes =
      1024 + kNumStages * (SMEM_B + SMEM_A + SMEM_SA) + SMEM_SB + SMEM_RED + SMEM_BARRIERS;
};

template <uint32_t SHAPE_N, uint32_t SHAPE_K, uint32_t BLOCK_M, uint32_t kNumSplits,
          uint32_t kNumStages, bool kMasked = false>
__global__ void __launch_bounds__(384, 1)
sm90_fp8_gemm_1d2d_small_m_kernel(const float* __restrict__ sb, uint32_t shape_m,
                                  uint8_t* __restrict__ out, uint32_t ld_out,
                                  const __grid_constant__ TmaDescriptor tmap_a,
                                  const __grid_constant__ TmaDescriptor tmap_b,
                                  const __grid_constant__ TmaDescriptor tmap_sa,
                                  const int32_t* __restrict__ masked_m, uint32_t num_slots) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Layout =
      Sm90Fp8GemmSmallMLayout<SHAPE_N, SHAPE_K, BLOCK_M, kNumSplits, kNumStages, kMasked>;
  constexpr uint32_t BLOCK_K = Layout::BLOCK_K, BLOCK_N = Layout::BLOCK_N;
  constexpr uint32_t WGMMA_K = 32;
  constexpr uint32_t kNumMathThreads = 256;
  constexpr uint32_t kNumKBlocks = Layout::kNumKBlocks;
  constexpr uint32_t kNumNBlocks = ceil_div(SHAPE_N, BLOCK_N);
  constexpr uint32_t kNumKSteps = BLOCK_K / WGMMA_K;
  constexpr uint32_t kNumAccum = WgmmaFp8<BLOCK_M>::kNumAccum;
  constexpr uint32_t kRedStride = Layout::kRedStride;
  // NOTE: setmaxnreg moves registers from the producer (address arithmetic only) to the math
  // warpgroups, which hold the wgmma accumulator and the FP32 sums (BLOCK_M / 2 floats each) and
  // BLOCK_M / 4 token scales: 128 * 40 + 256 * 232 fits the 64K-register file.
  constexpr uint32_t kProducerRegs = 40, kMathRegs = 232;
  // Masked, a cluster reduces once per tile while its producers already load the next tiles, so
  // the reduction cannot use barrier.cluster (which every running thread, producers included,
  // must meet): the math warpgroups meet on mbarriers of their own instead (see below).
  constexpr bool kRedBarriers = Layout::kNumRedBarriers > 0;

  // --- static checks ----------------------------------------------------------------------------
  static_assert(BLOCK_M % 8 == 0 && BLOCK_M >= 8 && BLOCK_M <= 160,
                "tokens are wgmma's N: 8..160 in steps of 8 (two BLOCK_M / 2 float arrays per thread)");
  static_assert(SHAPE_K % 16 == 0, "TMA needs K-major rows of a multiple of 16 bytes");
  static_assert(SHAPE_N % 8 == 0, "16-byte stores of bf16 output rows need N % 8 == 0");
  static_assert(kNumSplits >= 1 && kNumSplits <= 8, "a portable cluster holds at most 8 CTAs");
  static_assert(kNumSplits <= kNumKBlocks, "every split owns at least one k-block");
  // An even ring: each stage feeds one math warpgroup, which has itself consumed the phase
  // before the one it waits for, so its parity wait cannot mistake that phase for its own.
  static_assert(kNumStages >= 2 && kNumStages % 2 == 0, "an even ring of at least 2 stages");
  // A 64-row tile of B starts on a multiple of 64 rows: it lies inside one 128x128 scale block.
  static_assert(128 % BLOCK_N == 0, "a tile of B rows must not straddle two scale blocks");
  static_assert(Layout::kSmemBytes <= 232448, "227 KB of shared memory per block at most");

  // Guard against a host whose idea of the shared-memory size disagrees with this layout.
  uint32_t dyn_smem;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (dyn_smem < Layout::kSmemBytes) asm volatile("trap;");

  // --- work of this CTA -------------------------------------------------------------------------
  // Cluster c computes tile c; consecutive clusters share A's token block (it stays in L2) and
  // walk B's 64-row blocks. CTA `rank` of the cluster owns k-blocks [kb_begin, kb_end).
  // Masked: the token block is (group, slot), and the cluster's m-blocks of the group are slot,
  // slot + num_slots, ...; `group` offsets the rows of A, D and B (0 when dense).
  const uint32_t rank = kNumSplits > 1 ? cluster_cta_rank() : 0;
  const uint32_t tile = blockIdx.x / kNumSplits;
  const uint32_t n_block = tile % kNumNBlocks;
  uint32_t m_block = tile / kNumNBlocks, group = 0;
  if constexpr (kMasked) group = m_block / num_slots, m_block %= num_slots;
  const uint32_t n0 = n_block * BLOCK_N, m0 = m_block * BLOCK_M;
  const uint32_t row0 = group * shape_m, b_row0 = group * SHAPE_N + n0;
  const uint32_t kb_begin = rank * kNumKBlocks / kNumSplits;
  const uint32_t kb_end = (rank + 1) * kNumKBlocks / kNumSplits;

  // --- shared-memory carve-up -------------------------------------------------------------------
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* smem_b = smem;
  uint8_t* smem_a = smem_b + kNumStages * Layout::SMEM_B;
  float* smem_sa = reinterpret_cast<float*>(smem_a + kNumStages * Layout::SMEM_A);
  float* smem_sb = smem_sa + kNumStages * Layout::kSaStage;  // [kb_end - kb_begin]
  float* smem_red = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(smem_sb) + Layout::SMEM_SB);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(smem_red) + Layout::SMEM_RED);
  uint64_t* empty_bar = full_bar + kNumStages;
  // kRedBarriers: red_full completes when every CTA of the cluster has written its partial tile
  // of the current token tile, red_free when every CTA has read this CTA's (it may then write
  // the next one, or exit); one arrival from each CTA, once per token tile.
  uint64_t* red_full = empty_bar + kNumStages;
  uint64_t* red_free = red_full + 1;

  const uint32_t warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  const uint32_t lane = lane_idx();

  // --- barrier setup ----------------------------------------------------------------------------
  // NOTE: the first B boxes go to L2 before the dependency wait (prefetch_first_b_l2, and
  // grid_dependency_wait below).
  if (threadIdx.x == kNumMathThreads) {
    tma_prefetch_descriptor(&tmap_b);
    prefetch_first_b_l2<BLOCK_K>(&tmap_b, kb_begin, kb_end, static_cast<int32_t>(b_row0));
    tma_prefetch_descriptor(&tmap_a);
    tma_prefetch_descriptor(&tmap_sa);
  }
  // One arrival per warp of the warpgroup that reads a stage frees it.
  if (threadIdx.x == 0) {
    if constexpr (kRedBarriers) {
      mbar_init(red_full, kNumSplits);
      mbar_init(red_free, kNumSplits);
    }
    init_stage_ring(full_bar, empty_bar, kNumStages, 4);
  }
  // NOTE: the ring's barriers and TMA loads are all CTA-local. Dense, the cluster first meets at
  // the reduction, whose barrier also guarantees that every peer is running before its shared
  // memory is read. With kRedBarriers every thread arrives here and waits before its first use
  // of a peer's barrier (math) or before it exits (producer): no CTA arrives on a peer's
  // reduction barriers before the peer has initialised them.
  __syncthreads();
  if constexpr (kRedBarriers) cluster_arrive_relaxed();
  // Everything above is the prologue a dependent launch overlaps with the kernel before.
  grid_dependency_wait();
  grid_launch_dependents();

  // Masked: the group's rows, clamped so that bad values never address outside A or D; the
  // cluster's m-blocks are m_block, m_block + num_slots, ... below m_block_end: fewer or more
  // than the host expected when the group has fewer or more rows. Every CTA of a cluster reads
  // the same value and walks the same tiles.
  uint32_t rows_m = shape_m, m_block_end = 0;
  if constexpr (kMasked) {
    const int32_t r = __ldg(masked_m + group);
    rows_m = r < 0 ? 0u : (static_cast<uint32_t>(r) > shape_m ? shape_m : r);
    m_block_end = ceil_div(rows_m, BLOCK_M);
  }

  if (warpgroup == 2) {
    // --- producer: one thread issues every TMA load ---------------------------------------------
    warpgroup_reg_dealloc<kProducerRegs>();
    if (threadIdx.x == kNumMathThreads) {
      // NOTE: A's map has a box of min(BLOCK_M, M) rows (TMA's zero fill of rows past M is slow);
      // the rows past M in shared memory keep stale bytes, which only feed accumulator columns
      // of tokens >= M, never stored. Masked, M is Mmax: a box may hold the next group's rows,
      // which likewise feed only columns never stored.
      const uint32_t a_rows = shape_m < BLOCK_M ? shape_m : BLOCK_M;
      const uint32_t stage_tx_bytes = Layout::kBRows * BLOCK_K + a_rows * BLOCK_K + BLOCK_M * 4;
      // NOTE: with one token tile every byte of B is read once, so its lines go first in L2
      // (l2_policy_evict_first); with more, the token tiles of a B tile read it at about the
      // same time, partly from L2, and B keeps the default policy. Masked: the group's rows.
      const bool b_once = rows_m <= BLOCK_M;
      const uint64_t policy_once = l2_policy_evict_first();
      uint32_t stage = 0, phase = 0;
      // The k-blocks of the tile at token row tile_m0 (the ring's stage and phase carry on).
      auto load_tile = [&](uint32_t tile_m0) {
        for (uint32_t kb = kb_begin; kb < kb_end; ++kb) {
          mbar_wait(&empty_bar[stage], phase ^ 1);
          uint64_t* bar = &full_bar[stage];
          mbar_arrive_expect_tx(bar, stage_tx_bytes);
          const int32_t k0 = static_cast<int32_t>(kb * BLOCK_K);
          uint8_t* dst_b = smem_b + stage * Layout::SMEM_B;
          if (b_once) {
            tma_load_2d_hint(dst_b, &tmap_b, bar, k0, static_cast<int32_t>(b_row0), policy_once);
          } else {
            tma_load_2d(dst_b, &tmap_b, bar, k0, static_cast<int32_t>(b_row0));
          }
          tma_load_2d(smem_a + stage * Layout::SMEM_A, &tmap_a, bar, k0,
                      static_cast<int32_t>(row0 + tile_m0));
          float* dst_sa = smem_sa + stage * Layout::kSaStage;
          if constexpr (kMasked) {
            tma_load_3d(dst_sa, &tmap_sa, bar, static_cast<int32_t>(tile_m0),
                        static_cast<int32_t>(kb), static_cast<int32_t>(group));
          } else {
            tma_load_2d(dst_sa, &tmap_sa, bar, static_cast<int32_t>(tile_m0),
                        static_cast<int32_t>(kb));
          }
          if (++stage == kNumStages) stage = 0, phase ^= 1;
        }
      };
      if constexpr (kMasked) {
        for (uint32_t mb = m_block; mb < m_block_end; mb += num_slots) load_tile(mb * BLOCK_M);
      } else {
        load_tile(m0);
      }
    }
    // Dense, the two cluster barriers of the reduction count every non-exited thread of the
    // cluster, so this warpgroup takes part (it wrote nothing the peers read: relaxed arrivals).
    // Masked, it meets only the barrier of the start, then exits, its loads completing on
    // barriers of the still-running CTA.
    if constexpr (kNumSplits > 1 && !kMasked) {
      cluster_arrive_relaxed();
      cluster_wait_acquire();
      cluster_arrive_relaxed();
      cluster_wait_acquire();
    } else if constexpr (kRedBarriers) {
      cluster_wait_acquire();
    }
  } else {
    // --- math: wgmma, promotion with scales, partial tile to shared memory ----------------------
    warpgroup_reg_alloc<kMathRegs>();
    const uint32_t warp = (threadIdx.x / 32) % 4;
    // Accumulator fragment (wgmma D layout): rows r0 and r0 + 8 of the 64 rows of B; columns
    // (tokens) 8 g + c0 and 8 g + c0 + 1 of every 8-column group g.
    const uint32_t r0 = warp * 16 + lane / 4;
    const uint32_t c0 = (lane % 4) * 2;

    // B's scales of this CTA's k-blocks (one per k-block: the tile lies in one 128-row block).
    // NOTE: loaded while the first TMA loads are in flight, so the global round trip overlaps.
    const uint32_t sb_row0 = group * ceil_div(SHAPE_N, 128u) + n0 / 128;
    const float* sb_row = sb + sb_row0 * kNumKBlocks + kb_begin;
    for (uint32_t i = threadIdx.x; i < kb_end - kb_begin; i += kNumMathThreads)
      smem_sb[i] = __ldg(sb_row + i);
    named_barrier_sync(1, kNumMathThreads);

    const uint64_t desc_b0 = make_smem_desc_sw128(smem_b);
    const uint64_t desc_a0 = make_smem_desc_sw128(smem_a);
    // Warpgroup w takes the k-blocks the CTA's ring holds in stages w, w + 2, ...: with one tile,
    // kb_begin + w, kb_begin + w + 2, ... (each stage's phase flips once per pass). Masked, the
    // k-blocks of the CTA's tiles follow each other in the ring, so after a tile of an odd number
    // of k-blocks each warpgroup starts the next one on its other parity (`first` below).
    uint32_t stage = warpgroup, phase = 0;
    // One tile: the k-blocks from kb_first, promoted into FP32, the partial tile in shared
    // memory, the cluster's reduction and the bf16 stores of its rows below rows_m.
    // `t`: the CTA's count of tiles before this one (masked), the parity of the reduction
    // barriers' phase.
    auto compute_tile = [&](uint32_t tile_m0, uint32_t kb_first, uint32_t t) {
      float acc[kNumAccum], fin[kNumAccum];
#pragma unroll
      for (uint32_t i = 0; i < kNumAccum; ++i) fin[i] = 0.0f;

      for (uint32_t kb = kb_first; kb < kb_end; kb += 2) {
        mbar_wait(&full_bar[stage], phase);
        // NOTE: the scales are read before the wgmma is waited for, off the critical path, and
        // before the stage is released (the producer may then refill it).
        const float sbk = smem_sb[kb - kb_begin];
        float sa_lo[BLOCK_M / 8], sa_hi[BLOCK_M / 8];
        const float* sa_stage = smem_sa + stage * Layout::kSaStage + c0;
#pragma unroll
        for (uint32_t g = 0; g < BLOCK_M / 8; ++g) {
          sa_lo[g] = sa_stage[8 * g];
          sa_hi[g] = sa_stage[8 * g + 1];
        }
        const uint64_t desc_b = desc_b0 + stage * (Layout::SMEM_B / 16);
        const uint64_t desc_a = desc_a0 + stage * (Layout::SMEM_A / 16);
#pragma unroll
        for (uint32_t i = 0; i < kNumAccum; ++i) fence_operand(acc[i]);
        wgmma_fence();
        // NOTE: each k-step of 32 bytes moves the descriptors' start address by 32 >> 4 = 2. The
        // last k-block runs all four k-steps: TMA zero-fills K beyond SHAPE_K, and a run-time
        // bound on the k-steps made ptxas fence the accumulators around every wgmma (C7519).
#pragma unroll
        for (uint32_t k = 0; k < kNumKSteps; ++k)
          WgmmaFp8<BLOCK_M>::mma(desc_b + 2 * k, desc_a + 2 * k, acc, k > 0);
        wgmma_commit();
#pragma unroll
        for (uint32_t i = 0; i < kNumAccum; ++i) fence_operand(acc[i]);
        wgmma_wait<0>();
        if (lane == 0) mbar_arrive(&empty_bar[stage]);
        // NOTE: promotion, as the dense kernel does it: the tensor cores keep ~14 bits of the FP8
        // product sum, so every 128 of K the partial sum moves to FP32 registers, scaled by
        // sa * sb. Swapped, sb is one value per k-block and sa varies along the columns.
#pragma unroll
        for (uint32_t g = 0; g < BLOCK_M / 8; ++g) {
          const float s0 = sa_lo[g] * sbk, s1 = sa_hi[g] * sbk;
          fin[4 * g + 0] = fmaf(acc[4 * g + 0], s0, fin[4 * g + 0]);
          fin[4 * g + 1] = fmaf(acc[4 * g + 1], s1, fin[4 * g + 1]);
          fin[4 * g + 2] = fmaf(acc[4 * g + 2], s0, fin[4 * g + 2]);
          fin[4 * g + 3] = fmaf(acc[4 * g + 3], s1, fin[4 * g + 3]);
        }
        stage += 2;
        if (stage >= kNumStages) stage -= kNumStages, phase ^= 1;
      }

      // This CTA's partial tile in output orientation, smem_red[token][row of B]: warpgroup 0's
      // sums, then warpgroup 1 adds its own (a fixed order). With kRedBarriers, once every peer
      // has read the previous tile's.
      // NOTE: lanes of a warp cover 4 column pairs x 8 rows: (2 c0 * kRedStride + r0) % 32 =
      // 8 (lane % 4) + lane / 4, 32 different banks.
      auto partial = [&](bool add) {
#pragma unroll
        for (uint32_t g = 0; g < BLOCK_M / 8; ++g) {
          float* col0 = smem_red + (8 * g + c0) * kRedStride + r0;
          float* col1 = col0 + kRedStride;
          col0[0] = add ? col0[0] + fin[4 * g + 0] : fin[4 * g + 0];
          col1[0] = add ? col1[0] + fin[4 * g + 1] : fin[4 * g + 1];
          col0[8] = add ? col0[8] + fin[4 * g + 2] : fin[4 * g + 2];
          col1[8] = add ? col1[8] + fin[4 * g + 3] : fin[4 * g + 3];
        }
      };
      if constexpr (kRedBarriers) {
        if (t > 0) mbar_wait_cluster(red_free, (t - 1) & 1);
      }
      if (warpgroup == 0) partial(false);
      named_barrier_sync(1, kNumMathThreads);
      if (warpgroup == 1) partial(true);

      // --- reduction over the cluster and bf16 stores -------------------------------------------
      // NOTE: the arrive releases each math thread's partial-tile stores and the wait acquires
      // every peer's, at cluster scope: the loads through mapa below see them. With kRedBarriers,
      // one thread's release after the CTA barrier covers the stores the barrier ordered.
      if constexpr (kRedBarriers) {
        named_barrier_sync(1, kNumMathThreads);
        if (threadIdx.x == 0) {
          fence_acq_rel_cluster();
#pragma unroll
          for (uint32_t r = 0; r < kNumSplits; ++r) mbar_arrive_cluster_relaxed(red_full, r);
        }
        mbar_wait_cluster(red_full, t & 1);
      } else if constexpr (kNumSplits > 1) {
        cluster_arrive_release();
        cluster_wait_acquire();
      } else {
        named_barrier_sync(1, kNumMathThreads);
      }
      // Units of 8 output columns (16 bytes of bf16) of one token row, over the tile's rows below
      // M and columns below N only; CTA `rank` owns the contiguous range [u_begin, u_end) and
      // sums each unit over ranks 0, 1, ... in order, so every element's sum has the same order
      // whichever CTA computes it.
      // NOTE: every unit loaded is stored. A peer's partial tile may be read only while the peer
      // runs; a load whose value nothing uses does not hold its thread back, so the thread could
      // pass the closing barrier with it in flight and the peer exit under it.
      const uint32_t rows = rows_m - tile_m0 < BLOCK_M ? rows_m - tile_m0 : BLOCK_M;
      const uint32_t units_per_row = (SHAPE_N - n0 < BLOCK_N ? SHAPE_N - n0 : BLOCK_N) / 8;
      const uint32_t units = rows * units_per_row;
      const uint32_t u_begin = rank * units / kNumSplits, u_end = (rank + 1) * units / kNumSplits;
      const uint32_t red = smem_addr(smem_red);
      uint32_t peer[kNumSplits];
#pragma unroll
      for (uint32_t r = 0; r < kNumSplits; ++r)
        peer[r] = kNumSplits > 1 ? mapa_shared(red, r) : red;
      for (uint32_t u = u_begin + threadIdx.x; u < u_end; u += kNumMathThreads) {
        const uint32_t t = u / units_per_row, col = (u % units_per_row) * 8;
        const uint32_t off = (t * kRedStride + col) * 4;
        F32x4 lo[kNumSplits], hi[kNumSplits];
#pragma unroll
        for (uint32_t r = 0; r < kNumSplits; ++r) {
          if constexpr (kNumSplits > 1) {
            lo[r] = ld_shared_cluster_v4(peer[r] + off);
            hi[r] = ld_shared_cluster_v4(peer[r] + off + 16);
          } else {
            lo[r] = ld_shared_v4f(reinterpret_cast<uint8_t*>(smem_red) + off);
            hi[r] = ld_shared_v4f(reinterpret_cast<uint8_t*>(smem_red) + off + 16);
          }
        }
#pragma unroll
        for (uint32_t r = 1; r < kNumSplits; ++r) {
          lo[0].x += lo[r].x, lo[0].y += lo[r].y, lo[0].z += lo[r].z, lo[0].w += lo[r].w;
          hi[0].x += hi[r].x, hi[0].y += hi[r].y, hi[0].z += hi[r].z, hi[0].w += hi[r].w;
        }
        U32x4 v;
        v.x = pack_bf16x2(lo[0].x, lo[0].y), v.y = pack_bf16x2(lo[0].z, lo[0].w);
        v.z = pack_bf16x2(hi[0].x, hi[0].y), v.w = pack_bf16x2(hi[0].z, hi[0].w);
        const uint64_t row = row0 + tile_m0 + t;
        st_global_v4(out + (row * ld_out + n0 + col) * 2, v);
      }
      // NOTE: no CTA may exit (its shared memory freed) or write its next partial tile while a
      // peer still reads this one. The loads above have returned their values (the stores used
      // them), so a relaxed arrive suffices.
      if constexpr (kRedBarriers) {
        named_barrier_sync(1, kNumMathThreads);
        if (threadIdx.x == 0) {
#pragma unroll
          for (uint32_t r = 0; r < kNumSplits; ++r) mbar_arrive_cluster_relaxed(red_free, r);
        }
      } else if constexpr (kNumSplits > 1) {
        cluster_arrive_relaxed();
        cluster_wait_acquire();
      } else if constexpr (kMasked) {
        named_barrier_sync(1, kNumMathThreads);
      }
    };
    if constexpr (kMasked) {
      if constexpr (kRedBarriers) cluster_wait_acquire();
      uint32_t first = warpgroup;  // tile t: warpgroup ^ (t * (kb_end - kb_begin)) % 2
      uint32_t t = 0;
      for (uint32_t mb = m_block; mb < m_block_end; mb += num_slots, ++t) {
        compute_tile(mb * BLOCK_M, kb_begin + first, t);
        first ^= (kb_end - kb_begin) & 1;
      }
      // Every peer has read the last partial tile before this CTA's shared memory goes.
      if constexpr (kRedBarriers) {
        if (t > 0) mbar_wait_cluster(red_free, (t - 1) & 1);
      }
    } else {
      compute_tile(m0, kb_begin + warpgroup, 0);
    }
  }
#else
  // Built for the wrong architecture: this kernel needs sm_90a (wgmma, setmaxnreg, clusters).
  if (blockIdx.x == 0 && threadIdx.x == 0) asm volatile("trap;");
#endif
}

}  // namespace fp8gemm
