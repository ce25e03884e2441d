// FP8 GEMM for sm_90a with both operands in 1x128 groups along K, FP32 out (the weight gradient):
//   out[M, N] (fp32) = c[M, N] + (A * sa) . (B * sb)^T      (c optional, may be out itself)
//   A [M, K] e4m3 (kAE5M2: e5m2, an output gradient dY^T), K-major; sa float32 per 1x128 group,
//     column-major [ceil(K/128), M padded to 4]
//   B [N, K] e4m3, K-major; sb float32 per 1x128 group, column-major [ceil(K/128), N padded to 4]
// N is a compile-time constant; M and K are kernel arguments (a token count K changes every step
// of training without a new kernel). K may be any value >= 1: TMA zero-fills the columns past K
// of the last k-block.
// kKGrouped (the MoE weight gradient): G GEMMs out[g] = c[g] + A_g . B_g^T, out and c [G, M, N];
//   group g's K_g = ks[g] (read on the device, clamped to the columns that remain) spans k-blocks
//   [s_g, s_g + ceil(K_g/128)) of A [M, 128 * S] and B [N, 128 * S], s_g = sum over h < g of
//   ceil(K_h/128): every group starts on a k-block, the columns past K_g of its last k-block are
//   zero, and its scales are columns s_g.. of sa and sb (the host pads A and B so when the
//   groups' K are not all multiples of 128). A group with K_g = 0 writes c[g] (or zeros).
// Persistent and warp-specialised: one TMA producer warpgroup feeds one (BLOCK_M = 64) or two
// (BLOCK_M = 128, 256) math warpgroups through a ring of kNumStages shared-memory stages; every
// stage carries its k-block of A and B and their scales (BLOCK_M and BLOCK_N floats). BLOCK_M =
// 256 runs as two waves of 128 rows per k-block through the one accumulator, as the 1D2D kernel's
// does: only the FP32 sums double, and a k-block's loads feed twice the FLOPs of 128 rows.
#pragma once

#include "sm90_utils.cuh"
#include "sm90_wgmma_fp8.cuh"
#include "sm90_scheduler.cuh"

namespace fp8gemm {

template <uint32_t BLOCK_M, uint32_t BLOCK_N, uint32_t kNumStages>
struct Sm90Fp8Gemm1d1dLayout {
  static constexpr uint32_t BLOCK_K = 128;
  static constexpr uint32_t kNumMathThreads = BLOCK_M == 64 ? 128 : 256;
  static constexpr uint32_t WAVE_M = kNumMathThreads / 128 * 64;  // rows of one wgmma wave
  static constexpr uint32_t kNumWaves = BLOCK_M / WAVE_M;
  // NOTE: TMA writes shared memory at 128-byte aligned addresses: a stage's scales take a
  // multiple of 32 floats.
  static constexpr uint32_t kSaStage = ceil_div(BLOCK_M, 32u) * 32;  // floats per stage
  static constexpr uint32_t kSbStage = ceil_div(BLOCK_N, 32u) * 32;
  // Shared memory, in carve-up order (A and B tiles are multiples of 1024 bytes, so the TMA
  // destinations of the 128-byte swizzle stay 1024-byte aligned).
  static constexpr uint32_t SMEM_A = BLOCK_M * BLOCK_K;
  static constexpr uint32_t SMEM_B = BLOCK_N * BLOCK_K;
  static constexpr uint32_t SMEM_SA = kSaStage * 4;
  static constexpr uint32_t SMEM_SB = kSbStage * 4;
  static constexpr uint32_t SMEM_BARRIERS = 2 * kNumStages * 8;
  // 1024 bytes of slack to align the dynamic shared-memory base.
  static constexpr uint32_t kSmemBytes =
      1024 + kNumStages * (SMEM_A + SMEM_B + SMEM_SA + SMEM_SB) + SMEM_BARRIERS;
};

// Two floats of adjacent columns, one 8-byte shared-memory load.
struct alignas(8) Float2 {
  float x, y;
};

// Promotion of the tile's 8-column groups from the waited-for wgmma accumulator `acc` (rows r and
// r + 8): fin += acc * sa[row] * sb[col].
// NOTE: the tensor cores keep ~14 bits of the FP8 product sum, so every 128 of K the partial sum
// moves to the FP32 sums, scaled by sa[row] * sb[col].
template <uint32_t kNumAccum, uint32_t kNumColGroups>
__device__ __forceinline__ void promote_groups(float (&fin)[kNumAccum], float (&acc)[kNumAccum],
                                               float sa0, float sa1,
                                               const Float2 (&sb)[kNumColGroups]) {
  static_assert(4 * kNumColGroups == kNumAccum, "four sums of a thread per 8-column group");
#pragma unroll
  for (uint32_t i = 0; i < kNumAccum; ++i) fence_operand(acc[i]);
#pragma unroll
  for (uint32_t g = 0; g < kNumColGroups; ++g) {
    const Float2 b = sb[g];
    fin[4 * g + 0] = fmaf(acc[4 * g + 0], sa0 * b.x, fin[4 * g + 0]);
    fin[4 * g + 1] = fmaf(acc[4 * g + 1], sa0 * b.y, fin[4 * g + 1]);
    fin[4 * g + 2] = fmaf(acc[4 * g + 2], sa1 * b.x, fin[4 * g + 2]);
    fin[4 * g + 3] = fmaf(acc[4 * g + 3], sa1 * b.y, fin[4 * g + 3]);
  }
}

template <bool kKGrouped, uint32_t SHAPE_N, uint32_t BLOCK_M, uint32_t BLOCK_N,
          uint32_t kNumStages, uint32_t kBandSize, bool kTwoAccum, bool kAE5M2>
__global__ void __launch_bounds__(Sm90Fp8Gemm1d1dLayout<BLOCK_M, BLOCK_N, kNumStages>::kNumMathThreads + 128, 1)
sm90_fp8_gemm_1d1d_kernel(uint32_t shape_m, uint32_t shape_k, const int32_t* __restrict__ ks,
                          uint32_t num_groups, const float* c, float* out,
                          const __grid_constant__ TmaDescriptor tmap_a,
                          const __grid_constant__ TmaDescriptor tmap_b,
                          const __grid_constant__ TmaDescriptor tmap_sa,
                          const __grid_constant__ TmaDescriptor tmap_sb) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Layout = Sm90Fp8Gemm1d1dLayout<BLOCK_M, BLOCK_N, kNumStages>;
  constexpr uint32_t BLOCK_K = Layout::BLOCK_K;
  constexpr uint32_t WGMMA_M = 64;
  constexpr uint32_t kNumMathThreads = Layout::kNumMathThreads;
  constexpr uint32_t kNumMathWarps = kNumMathThreads / 32;
  constexpr uint32_t WAVE_M = Layout::WAVE_M, kNumWaves = Layout::kNumWaves;
  constexpr uint32_t kNumNBlocks = ceil_div(SHAPE_N, BLOCK_N);
  constexpr uint32_t kNumAccum = WgmmaFp8<BLOCK_N>::kNumAccum;
  constexpr uint32_t kNumKSteps = BLOCK_K / 32;
  constexpr uint32_t kNumColGroups = BLOCK_N / 8;  // 8-column groups of the wgmma fragment
  // NOTE: setmaxnreg moves registers from the producer (address arithmetic only) to the math
  // warpgroups, which hold the wgmma accumulator, the FP32 sums (BLOCK_N/2 floats each) and the
  // stage's B scales of their columns (BLOCK_N/4). 128 * 40 + 256 * 232 fits the 64K-register
  // file; one math warpgroup (BLOCK_M = 64) can take 256.
  constexpr uint32_t kProducerRegs = 40, kMathRegs = kNumMathThreads == 128 ? 256 : 232;

  // --- static checks ----------------------------------------------------------------------------
  static_assert(BLOCK_M == 64 || BLOCK_M == 128 || BLOCK_M == 256,
                "one or two math warpgroups of 64 rows each, in one or two waves");
  static_assert(!kTwoAccum || kNumWaves == 1, "two accumulators take one wave of rows");
  // (BLOCK_N % 8 == 0 also makes a stage's B-scale box, BLOCK_N floats, a multiple of 16 bytes.)
  static_assert(BLOCK_N % 8 == 0 && BLOCK_N >= 8 && BLOCK_N <= 256, "wgmma N is 8..256, step 8");
  static_assert(kNumStages >= 2, "at least double buffering");
  static_assert(!kTwoAccum || kNumStages >= 3,
                "two k-blocks in flight and one being filled need three stages");
  static_assert(Layout::kSmemBytes <= 232448, "227 KB of shared memory per block at most");

  // Guard against a host whose idea of the shared-memory size disagrees with this layout.
  uint32_t dyn_smem;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (dyn_smem < Layout::kSmemBytes) asm volatile("trap;");

  // --- shared-memory carve-up -------------------------------------------------------------------
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* smem_a = smem;
  uint8_t* smem_b = smem_a + kNumStages * Layout::SMEM_A;
  float* smem_sa = reinterpret_cast<float*>(smem_b + kNumStages * Layout::SMEM_B);
  float* smem_sb = smem_sa + kNumStages * Layout::kSaStage;
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem_sb + kNumStages * Layout::kSbStage);
  uint64_t* empty_bar = full_bar + kNumStages;

  // NOTE: broadcast from lane 0 so that the compiler knows it is warp-uniform (the wgmma
  // descriptors derived from it then live in uniform registers).
  const uint32_t warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  const uint32_t lane = lane_idx();

  // --- barrier setup ----------------------------------------------------------------------------
  if (threadIdx.x == kNumMathThreads) {
    tma_prefetch_descriptor(&tmap_a);
    tma_prefetch_descriptor(&tmap_b);
    tma_prefetch_descriptor(&tmap_sa);
    tma_prefetch_descriptor(&tmap_sb);
  }
  // One arrival per math warp frees a stage.
  if (threadIdx.x == 0) init_stage_ring(full_bar, empty_bar, kNumStages, kNumMathWarps);
  __syncthreads();
  // Everything above is the prologue a dependent launch overlaps with the kernel before.
  grid_dependency_wait();
  grid_launch_dependents();

  Scheduler1d1d<kKGrouped, BLOCK_M, kNumNBlocks, kBandSize> scheduler(shape_m, shape_k, ks,
                                                                       num_groups);
  Tile1d1d tile;

  if (warpgroup == kNumMathThreads / 128) {
    // --- producer: one thread issues every TMA load ---------------------------------------------
    warpgroup_reg_dealloc<kProducerRegs>();
    if (threadIdx.x == kNumMathThreads) {
      // NOTE: below BLOCK_M rows the host's A map has a box of M rows (TMA's zero fill of rows
      // past M is slow); the stale rows in shared memory only feed output rows never stored.
      const uint32_t a_rows = shape_m < BLOCK_M ? shape_m : BLOCK_M;
      const uint32_t stage_tx_bytes =
          a_rows * BLOCK_K + Layout::SMEM_B + (BLOCK_M + BLOCK_N) * 4;
      // c's tile is read only by the epilogue; its rows are brought into L2 when the producer
      // reaches the tile's second-to-last k-block, up to a ring of stages ahead of the math
      // warps (whole 16-byte units: N % 4 == 0 and c on 16 bytes), so that the epilogue's
      // reductions hit L2 rather than wait for HBM with the tensor cores idle.
      // NOTE: on the H200, against no prefetch: 2112x7168x4096 -6 %, 7168x2048x1000 -3 %,
      // 24576x1536x4096 +3 %, 7168x2048x4096 +1 %; prefetched at the tile's second k-block
      // instead (longer in L2 beside the streaming A and B), the last two lost 3-4 %.
      const bool prefetch_c = SHAPE_N % 4 == 0 && c != nullptr &&
                              reinterpret_cast<uint64_t>(c) % 16 == 0;
      uint32_t stage = 0, phase = 0;
      while (scheduler.next(tile)) {
        const int32_t m0 = tile.m0, n0 = static_cast<int32_t>(tile.n_block * BLOCK_N);
        for (uint32_t i = 0; i < tile.num_kb; ++i) {
          if (prefetch_c && i + 2 == (tile.num_kb > 2 ? tile.num_kb : 2)) {
            const uint32_t rows = min(BLOCK_M, shape_m - static_cast<uint32_t>(m0));
            const uint32_t bytes = min(BLOCK_N, SHAPE_N - static_cast<uint32_t>(n0)) * 4;
            const float* src = c + (static_cast<uint64_t>(tile.group) * shape_m + m0) * SHAPE_N + n0;
            for (uint32_t r = 0; r < rows; ++r) bulk_prefetch_l2(src + r * SHAPE_N, bytes);
          }
          mbar_wait(&empty_bar[stage], phase ^ 1);
          uint64_t* bar = &full_bar[stage];
          mbar_arrive_expect_tx(bar, stage_tx_bytes);
          const int32_t kb = static_cast<int32_t>(tile.kb0 + i);
          tma_load_2d(smem_a + stage * Layout::SMEM_A, &tmap_a, bar, kb * static_cast<int32_t>(BLOCK_K), m0);
          tma_load_2d(smem_b + stage * Layout::SMEM_B, &tmap_b, bar, kb * static_cast<int32_t>(BLOCK_K), n0);
          tma_load_2d(smem_sa + stage * Layout::kSaStage, &tmap_sa, bar, m0, kb);
          tma_load_2d(smem_sb + stage * Layout::kSbStage, &tmap_sb, bar, n0, kb);
          if (++stage == kNumStages) stage = 0, phase ^= 1;
        }
      }
    }
  } else {
    // --- consumers: wgmma per k-block, promotion with sa[row] * sb[col], epilogue ---------------
    warpgroup_reg_alloc<kMathRegs>();
    const uint32_t warp_in_wg = (threadIdx.x / 32) % 4;
    // This thread's accumulator rows are r0 and r0 + 8 of each wave, its columns col_in_group
    // and col_in_group + 1 of every 8-column group (wgmma D fragment layout).
    const uint32_t r0 = warpgroup * WGMMA_M + warp_in_wg * 16 + lane / 4;
    const uint32_t col_in_group = (lane % 4) * 2;
    const float* sa_rows = smem_sa + r0;
    const float* sb_cols = smem_sb + col_in_group;
    // wgmma descriptors of stage 0: this warpgroup's A rows, and B. Another stage sits whole
    // multiples of 16 bytes further, added to the descriptor's 14-bit address field, which
    // cannot carry out: shared memory ends below 256 KB.
    const uint64_t desc_a0 = make_smem_desc_sw128(smem_a + warpgroup * WGMMA_M * BLOCK_K);
    const uint64_t desc_b0 = make_smem_desc_sw128(smem_b);
    uint32_t stage = 0, phase = 0;
    float acc[kNumAccum], final_acc[kNumWaves][kNumAccum];
    const bool in_place = c == out;

    while (scheduler.next(tile)) {
      const uint32_t row0 = static_cast<uint32_t>(tile.m0) + r0;
      const uint32_t col0 = tile.n_block * BLOCK_N + col_in_group;
      // This tile's group's [M, N] of out and c.
      const uint64_t group_off = static_cast<uint64_t>(tile.group) * shape_m * SHAPE_N;
      // c == out (the weight gradient accumulated in place): nothing to add or write.
      if (in_place && tile.num_kb == 0) continue;
#pragma unroll
      for (uint32_t w = 0; w < kNumWaves; ++w)
#pragma unroll
        for (uint32_t i = 0; i < kNumAccum; ++i) final_acc[w][i] = 0.0f;

      // The wgmma of one k-block for wave w into `acc_`, on stage `stage_`.
      auto issue = [&](float (&acc_)[kNumAccum], uint32_t stage_, uint32_t w) {
        const uint64_t desc_a =
            desc_a0 + stage_ * (Layout::SMEM_A / 16) + w * (WAVE_M * BLOCK_K / 16);
        const uint64_t desc_b = desc_b0 + stage_ * (Layout::SMEM_B / 16);
        wgmma_k_steps<WgmmaFp8<BLOCK_N, kAE5M2>, 0, kNumKSteps>(acc_, desc_a, desc_b);
      };
      // A stage's B scales of this thread's column pair of 8-column group g.
      auto stage_sb = [&](uint32_t stage_, uint32_t g) {
        return *reinterpret_cast<const Float2*>(sb_cols + stage_ * Layout::kSbStage + g * 8);
      };
      // The stage is free once this warp's wgmma and scale reads are done.
      auto release = [&](uint32_t stage_) {
        if (lane == 0) mbar_arrive(&empty_bar[stage_]);
      };
      auto take = [&]() {
        const uint32_t s = stage;
        mbar_wait(&full_bar[s], phase);
        if (++stage == kNumStages) stage = 0, phase ^= 1;
        return s;
      };

      uint32_t i = 0;
      if constexpr (kTwoAccum) {
        // NOTE: k-blocks alternate between acc and acc1: the wgmma of k-block j + 1 is issued
        // before the wait for j, so the tensor cores have work while j is promoted. ptxas
        // serialises every wgmma (C7514) when a loop carries a group in flight across its back
        // edge, so the k-blocks run in fully unrolled chunks of kKChunk that end with no group in
        // flight; a tile's last num_kb % kKChunk k-blocks run one at a time.
        constexpr uint32_t kKChunk = 8;
        float acc1[kNumAccum];
        for (; i + kKChunk <= tile.num_kb; i += kKChunk) {
          uint32_t held[2];
          held[0] = take();
          issue(acc, held[0], 0);
#pragma unroll
          for (uint32_t j = 0; j < kKChunk; ++j) {
            float (&cur)[kNumAccum] = j % 2 == 0 ? acc : acc1;
            float (&nxt)[kNumAccum] = j % 2 == 0 ? acc1 : acc;
            if (j + 1 < kKChunk) {
              held[(j + 1) % 2] = take();
              issue(nxt, held[(j + 1) % 2], 0);
              wgmma_wait<1>();
            } else {
              wgmma_wait<0>();
            }
            // The scales are read from the stage, which is released only after the promotion.
            const uint32_t s = held[j % 2];
            Float2 sb[kNumColGroups];
#pragma unroll
            for (uint32_t g = 0; g < kNumColGroups; ++g) sb[g] = stage_sb(s, g);
            promote_groups(final_acc[0], cur, sa_rows[s * Layout::kSaStage],
                           sa_rows[s * Layout::kSaStage + 8], sb);
            release(s);
          }
        }
      }
      for (; i < tile.num_kb; ++i) {
        const uint32_t s = take();
        // NOTE: with one accumulator the scales are read before the wgmma is issued (the B
        // scales once, for every wave): ptxas then computes the sa * sb products while the wgmma
        // runs, from registers already loaded. Read after the issue, the loads and products land
        // between the first of the k-block's four wgmma and the other three, which wait for the
        // shared-memory latency (ncu at 128x152: 12 % of the stall samples on one product); on
        // the H200 that order ran 6-7 % slower at 128x160 and 18-22 % at 128x152 (1-2 % faster
        // at 128x128). The stage is released before the last wave's promotion.
        Float2 sb[kNumColGroups];
#pragma unroll
        for (uint32_t w = 0; w < kNumWaves; ++w) {
          const float sa0 = sa_rows[s * Layout::kSaStage + w * WAVE_M];
          const float sa1 = sa_rows[s * Layout::kSaStage + w * WAVE_M + 8];
          if (w == 0) {
#pragma unroll
            for (uint32_t g = 0; g < kNumColGroups; ++g) sb[g] = stage_sb(s, g);
          }
          issue(acc, s, w);
          wgmma_wait<0>();
          if (w + 1 == kNumWaves) release(s);
          promote_groups(final_acc[w], acc, sa0, sa1, sb);
        }
      }

      // --- epilogue: the FP32 sums straight to global memory -------------------------------------
      // NOTE: a warp's store writes 8 rows x 32 contiguous bytes, whole 32-byte sectors; staging
      // an FP32 tile in shared memory would cost BLOCK_M * BLOCK_N * 4 bytes of pipeline stages.
      // In place (c == out) the sums are added by L2 reductions (red, fire and forget); a
      // separate c is loaded into the accumulator registers, dead by now, and added. Either way
      // c's tile was prefetched into L2 during the k-loop. On the H200 the in-place weight
      // gradient at 2112x7168x4096 ran, against cuBLAS block-wise in the same run: 0.80x loading
      // c at every tile start, 0.86x with reductions alone, 0.97x with reductions and the
      // prefetch, 0.84x with the prefetch and loads; with no c at all 1.02x. One thread owns
      // each element, so the result does not depend on the order of the reductions; red.add.f32
      // flushes subnormals to zero.
      // NOTE: c is read in a pass of its own before the stores: the compiler cannot move a load
      // of c above a store to out (it cannot rule out that they alias), so one fused pass would
      // wait for each load in turn. (With two waves, per wave: the accumulator registers that
      // take c hold one wave's tile.)
#pragma unroll
      for (uint32_t w = 0; w < kNumWaves; ++w) {
        if (c != nullptr && !in_place) {
          const bool c_v2 = SHAPE_N % 2 == 0 && reinterpret_cast<uint64_t>(c) % 8 == 0;
#pragma unroll
          for (uint32_t g = 0; g < kNumColGroups; ++g) {
            const uint32_t col = col0 + g * 8;
#pragma unroll
            for (uint32_t h = 0; h < 2; ++h) {
              const uint32_t row = row0 + w * WAVE_M + h * 8;
              const bool ok = row < shape_m && col < SHAPE_N;
              const float* src = c + group_off + static_cast<uint64_t>(row) * SHAPE_N + col;
              float& v0 = acc[4 * g + 2 * h + 0];
              float& v1 = acc[4 * g + 2 * h + 1];
              v0 = v1 = 0.0f;
              if (ok && c_v2) {
                asm volatile("ld.global.v2.f32 {%0, %1}, [%2];" : "=f"(v0), "=f"(v1) : "l"(src));
              } else if (ok) {
                v0 = src[0];
                if (col + 1 < SHAPE_N) v1 = src[1];
              }
            }
          }
#pragma unroll
          for (uint32_t i = 0; i < kNumAccum; ++i) final_acc[w][i] += acc[i];
        }
#pragma unroll
        for (uint32_t g = 0; g < kNumColGroups; ++g) {
          const uint32_t col = col0 + g * 8;
#pragma unroll
          for (uint32_t h = 0; h < 2; ++h) {
            const uint32_t row = row0 + w * WAVE_M + h * 8;
            if (row >= shape_m || col >= SHAPE_N) continue;
            float* dst = out + group_off + static_cast<uint64_t>(row) * SHAPE_N + col;
            const float v0 = final_acc[w][4 * g + 2 * h + 0], v1 = final_acc[w][4 * g + 2 * h + 1];
            if constexpr (SHAPE_N % 2 == 0) {
              // (col is even, so col + 1 < SHAPE_N and the address is 8-byte aligned)
              if (in_place)
                asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(v0), "f"(v1) : "memory");
              else
                asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(v0), "f"(v1) : "memory");
            } else if (in_place) {
              asm volatile("red.global.add.f32 [%0], %1;" ::"l"(dst), "f"(v0) : "memory");
              if (col + 1 < SHAPE_N) asm volatile("red.global.add.f32 [%0], %1;" ::"l"(dst + 1), "f"(v1) : "memory");
            } else {
              dst[0] = v0;
              if (col + 1 < SHAPE_N) dst[1] = v1;
            }
          }
        }
      }
    }
  }
#else
  // Built for the wrong architecture: this kernel needs sm_90a (wgmma, setmaxnreg).
  if (blockIdx.x == 0 && threadIdx.x == 0) asm volatile("trap;");
#endif
}

}  // namespace fp8gemm
