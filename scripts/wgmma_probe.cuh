// Probe kernel of scripts/wgmma_probe.py: what one SM's tensor cores and FP32 pipes do together
// in the GEMM kernels' mainloop, without loads. One CTA per SM; shared memory holds fixed fp8
// tiles (A: 64 x 128 per math warpgroup, B: N x 128, both 128-byte swizzled K-major as TMA
// writes them) and scales. Each math warpgroup runs `iters` k-blocks: four wgmma.m64nNk32
// (kChains > 1: the N columns as kChains independent accumulators, their wgmma interleaved),
// one commit group, the wait, then the promotion of the kernels:
//   kPromote 0: none, every k-block accumulating onto the last (a k-block that starts a fresh
//   sum nobody reads is dead code to ptxas, which leaves a placeholder HGMMA in its place);
//   1: sums += acc * (sa * sb), sb one scalar per k-block (1D2D: 1 FFMA an element);
//   2: sb per column (1D1D: 1 FMUL + 1 FFMA an element);
//   3: as 2, the FMULs (sa * sb of every element) issued between the k-block's wgmma issue and
//   its wait, so that only the FFMAs follow the wait (R more registers).
// kPipelined: two accumulators, k-block j + 1 issued before the wait for j (chunks of 8 k-blocks
// unrolled, each ending with none in flight, as the kernels run them; iters a multiple of 8).
// kLockstep: the math warpgroups meet at a named barrier before every k-block (as if each
// waited for a stage that lands just then).
// kStagger: math warpgroup w starts w * kStagger clock cycles after the first (free-running
// warpgroups that start together may stay in phase, promoting at the same time).
// kTurns (two math warpgroups): they take turns on the tensor cores, each issuing its k-block
// only once the other's wgmma have completed, so that one promotes while the other's run.
// kFfmaWGs: warpgroups that only run FFMA streams (2 x N/2 an iteration, independent chains)
// until the math warpgroups are done: the FP32 pipes busy beside the wgmma.
// Each warpgroup's warp 0 writes its clock64 span and its iteration count.
#pragma once

#include <fp8gemm/sm90_utils.cuh>
#include <fp8gemm/sm90_wgmma_fp8.cuh>

namespace probe {

using namespace fp8gemm;

constexpr uint32_t kMaxWGs = 4;

template <uint32_t N, uint32_t kMmaWGs>
struct ProbeLayout {
  static constexpr uint32_t SMEM_A = kMmaWGs * 64 * 128;
  static constexpr uint32_t SMEM_B = N * 128;
  // A scales: 4 k-blocks of 64 rows per warpgroup; B scales: 4 k-blocks of N columns.
  static constexpr uint32_t kSaFloats = 4 * 64 * kMmaWGs;
  static constexpr uint32_t kSbFloats = 4 * N;
  static constexpr uint32_t kBytes = 1024 + SMEM_A + SMEM_B + 4 * (kSaFloats + kSbFloats) + 16;
};

// Promotion of one waited-for accumulator (rows r and r + 8, the wgmma D fragment layout).
template <uint32_t kPromote, uint32_t R>
__device__ __forceinline__ void promote(float (&sum)[R], float (&acc)[R], float sa0, float sa1,
                                        const float* sb_cols, float sb) {
#pragma unroll
  for (uint32_t i = 0; i < R; ++i) fence_operand(acc[i]);
  if constexpr (kPromote == 1) {
    const float s0 = sa0 * sb, s1 = sa1 * sb;
#pragma unroll
    for (uint32_t i = 0; i < R; ++i) sum[i] = fmaf(acc[i], (i % 4) < 2 ? s0 : s1, sum[i]);
  } else if constexpr (kPromote == 2) {
#pragma unroll
    for (uint32_t g = 0; g < R / 4; ++g) {
      // this thread's two columns of 8-column group g
      const float2 b = *reinterpret_cast<const float2*>(sb_cols + 8 * g);
      sum[4 * g + 0] = fmaf(acc[4 * g + 0], sa0 * b.x, sum[4 * g + 0]);
      sum[4 * g + 1] = fmaf(acc[4 * g + 1], sa0 * b.y, sum[4 * g + 1]);
      sum[4 * g + 2] = fmaf(acc[4 * g + 2], sa1 * b.x, sum[4 * g + 2]);
      sum[4 * g + 3] = fmaf(acc[4 * g + 3], sa1 * b.y, sum[4 * g + 3]);
    }
  }
}

template <uint32_t N, uint32_t kMmaWGs, uint32_t kFfmaWGs, uint32_t kPromote, uint32_t kChains,
          bool kPipelined, bool kLockstep, uint32_t kStagger, bool kTurns>
__global__ void __launch_bounds__((kMmaWGs + kFfmaWGs) * 128, 1)
wgmma_probe(uint32_t iters, float* __restrict__ sink, long long* __restrict__ spans) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Layout = ProbeLayout<N, kMmaWGs>;
  constexpr uint32_t kNC = N / kChains;  // columns of one chain
  using Mma = WgmmaFp8<kNC>;
  constexpr uint32_t R = Mma::kNumAccum;
  static_assert(kMmaWGs >= 1 && kMmaWGs + kFfmaWGs <= kMaxWGs, "1..4 warpgroups, one computing");
  static_assert(N % kChains == 0 && kNC % 8 == 0, "chains of whole 8-column groups");
  static_assert(!kPipelined || kChains == 1, "two accumulators of one chain each");
  static_assert(!kTurns || (kMmaWGs == 2 && !kPipelined && !kLockstep), "turns of two warpgroups");
  static_assert(kPromote != 3 || (!kPipelined && !kTurns), "products formed under one accumulator");

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* smem_a = smem;
  uint8_t* smem_b = smem_a + Layout::SMEM_A;
  float* smem_sa = reinterpret_cast<float*>(smem_b + Layout::SMEM_B);
  float* smem_sb = smem_sa + Layout::kSaFloats;
  volatile uint32_t* done = reinterpret_cast<volatile uint32_t*>(smem_sb + Layout::kSbFloats);

  // fp8 e4m3 bytes of magnitude <= 1.875, both signs (no NaN: mask 0xBB), scales near 1.
  for (uint32_t i = threadIdx.x; i < (Layout::SMEM_A + Layout::SMEM_B) / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(smem)[i] = (i * 2654435761u ^ (i >> 3)) & 0xBBBBBBBBu;
  for (uint32_t i = threadIdx.x; i < Layout::kSaFloats + Layout::kSbFloats; i += blockDim.x)
    smem_sa[i] = 1.0f + static_cast<float>(i % 7) * 0.125f;
  if (threadIdx.x == 0) *done = 0;
  fence_proxy_async_smem();
  __syncthreads();

  const uint32_t wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  const uint32_t lane = lane_idx();
  const uint32_t warp_in_wg = (threadIdx.x / 32) % 4;
  float sum[kChains][R];
#pragma unroll
  for (uint32_t c = 0; c < kChains; ++c)
#pragma unroll
    for (uint32_t i = 0; i < R; ++i) sum[c][i] = 0.0f;
  uint32_t count = 0;
  const long long t0 = clock64();

  if (wg < kMmaWGs) {
    const uint32_t r0 = warp_in_wg * 16 + lane / 4;
    const float* sa_rows = smem_sa + wg * 64 + r0;
    const float* sb_cols = smem_sb + (lane % 4) * 2;
    const uint64_t desc_a = make_smem_desc_sw128(smem_a + wg * 64 * 128);
    const uint64_t desc_b = make_smem_desc_sw128(smem_b);
    float acc[kChains][R], accb[kChains][R];
    if (kStagger > 0) {
      while (clock64() - t0 < static_cast<long long>(wg * kStagger)) {
      }
    }
    // One k-block's wgmma into a (its scales come from k-block slot kb % 4).
    auto issue = [&](float (&a)[kChains][R]) {
#pragma unroll
      for (uint32_t c = 0; c < kChains; ++c)
#pragma unroll
        for (uint32_t i = 0; i < R; ++i) fence_operand(a[c][i]);
      wgmma_fence();
#pragma unroll
      for (uint32_t k = 0; k < 4; ++k)
#pragma unroll
        for (uint32_t c = 0; c < kChains; ++c)
          Mma::mma(desc_a + 2 * k, desc_b + c * (kNC * 128 / 16) + 2 * k, a[c],
                   kPromote == 0 || k > 0);
      wgmma_commit();
#pragma unroll
      for (uint32_t c = 0; c < kChains; ++c)
#pragma unroll
        for (uint32_t i = 0; i < R; ++i) fence_operand(a[c][i]);
    };
    // k-block kb's A scales of this thread's rows r and r + 8 (its scales sit in slot kb % 4)
    auto row_scales = [&](uint32_t kb) {
      return make_float2(sa_rows[kb % 4 * 64 * kMmaWGs], sa_rows[kb % 4 * 64 * kMmaWGs + 8]);
    };
    auto promote_kb = [&](float (&a)[kChains][R], uint32_t kb) {
      const uint32_t slot = kb % 4;
      const float2 sa = row_scales(kb);
      const float sa0 = sa.x, sa1 = sa.y;
      const float sb = smem_sb[slot];
#pragma unroll
      for (uint32_t c = 0; c < kChains; ++c)
        promote<kPromote, R>(sum[c], a[c], sa0, sa1, sb_cols + slot * N + c * kNC, sb);
    };
    if constexpr (kPipelined) {
#pragma unroll 1
      for (uint32_t kb0 = 0; kb0 + 8 <= iters; kb0 += 8) {
        if (kLockstep) named_barrier_sync(1, kMmaWGs * 128);
        issue(acc);
#pragma unroll
        for (uint32_t j = 0; j < 8; ++j) {
          if (j + 1 < 8) {
            if (j % 2 == 0) issue(accb); else issue(acc);
            wgmma_wait<1>();
          } else {
            wgmma_wait<0>();
          }
          if (j % 2 == 0) promote_kb(acc, kb0 + j); else promote_kb(accb, kb0 + j);
        }
      }
      count = iters / 8 * 8;
    } else {
      // Turns: barrier 3 + w opens warpgroup w's turn; the other warpgroup arrives on it once
      // its own wgmma have completed. Warpgroup 0 takes the first turn.
#pragma unroll 1
      for (uint32_t kb = 0; kb < iters; ++kb) {
        if (kLockstep) named_barrier_sync(1, kMmaWGs * 128);
        if (kTurns && (wg == 1 || kb > 0)) named_barrier_sync(3 + wg, 256);
        issue(acc);
        if constexpr (kPromote == 3) {
          // the products sa * sb of this k-block formed while its wgmma run
          const float2 sa = row_scales(kb);
          float prod[kChains][R];
#pragma unroll
          for (uint32_t c = 0; c < kChains; ++c)
#pragma unroll
            for (uint32_t g = 0; g < R / 4; ++g) {
              const float2 b =
                  *reinterpret_cast<const float2*>(sb_cols + kb % 4 * N + c * kNC + 8 * g);
              prod[c][4 * g + 0] = sa.x * b.x;
              prod[c][4 * g + 1] = sa.x * b.y;
              prod[c][4 * g + 2] = sa.y * b.x;
              prod[c][4 * g + 3] = sa.y * b.y;
            }
#pragma unroll
          for (uint32_t c = 0; c < kChains; ++c)
#pragma unroll
            for (uint32_t i = 0; i < R; ++i) fence_operand(prod[c][i]);
          wgmma_wait<0>();
#pragma unroll
          for (uint32_t c = 0; c < kChains; ++c)
#pragma unroll
            for (uint32_t i = 0; i < R; ++i) {
              fence_operand(acc[c][i]);
              sum[c][i] = fmaf(acc[c][i], prod[c][i], sum[c][i]);
            }
        } else {
          wgmma_wait<0>();
          if (kTurns) asm volatile("bar.arrive %0, 256;" ::"r"(4 - wg) : "memory");
          promote_kb(acc, kb);
        }
      }
      // (warpgroup 1's last arrival opens a turn nobody takes: taken here, the barrier is left
      // complete)
      if (kTurns && wg == 0) named_barrier_sync(3, 256);
      count = iters;
    }
    // (the last accumulator stays live, so no wgmma is dead code)
#pragma unroll
    for (uint32_t c = 0; c < kChains; ++c)
#pragma unroll
      for (uint32_t i = 0; i < R; ++i) sum[c][i] += acc[c][i];
    named_barrier_sync(2, kMmaWGs * 128);
    if (threadIdx.x == 0) *done = 1;
  } else {
    // FFMA streams: 2 x R FFMA an iteration on R independent sums, until the math warpgroups end.
    float x = 1.0f + threadIdx.x * 1e-7f, y = 0.999f;
    while (*done == 0) {
#pragma unroll
      for (uint32_t i = 0; i < R; ++i) sum[0][i] = fmaf(sum[0][i], y, x);
#pragma unroll
      for (uint32_t i = 0; i < R; ++i) sum[0][i] = fmaf(sum[0][i], y, x);
      ++count;
    }
  }
  const long long t1 = clock64();
  float total = 0.0f;
#pragma unroll
  for (uint32_t c = 0; c < kChains; ++c)
#pragma unroll
    for (uint32_t i = 0; i < R; ++i) total += sum[c][i];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = total;
  if (threadIdx.x % 128 == 0) {
    spans[(blockIdx.x * kMaxWGs + wg) * 2 + 0] = t1 - t0;
    spans[(blockIdx.x * kMaxWGs + wg) * 2 + 1] = count;
  }
#else
  if (blockIdx.x == 0 && threadIdx.x == 0) asm volatile("trap;");
#endif
}

}  // namespace probe
