// Per-token FP8 quantisation: rows of x (bf16, fp16 or fp32), or silu(gate) * up of SwiGLU rows,
// in 1x128 groups along K. The arithmetic of fp8gemm.quant's torch code (its specification):
//   amax  = max |x| over the group (NaN if any element is NaN), floored at 1e-4
//   scale = amax / fmt_max; with kPow2 the smallest power of two >= that ratio
//   q     = x / scale (IEEE division) rounded to the nearest FP8 value, saturated at +-fmt_max
//
// Layout: x [B, M, K_in] with unit column stride; q [B, M, K] row-major (row stride K); scales at
// s + b * s_batch + m * s_row + g * s_group (column-major TMA-aligned: s_row = 1, or row-major).
// With kSiluMul the row holds gate then up: the values are silu(x[m, k]) * x[m, inter + k].
// masked_m (or null): int32 [B]; rows m >= masked_m[b] of batch b (the masked layout's rows of
// no token) are not read and their FP8 values not written; their scales are an all-zero
// group's (finite), so a GEMM that reads the whole [M, K] tile sees no NaN scale.
//
// Work: a half-warp per (row, group); each lane holds 8 consecutive elements (16 bytes of bf16),
// the 16 lanes exchange their maxima by shuffles, and each stores its 8 FP8 values (8 bytes).
// A CTA of kThreads takes kItems groups per thread in turns. Its half-warps take consecutive
// items: with kRowsFirst (column-major scales) the same group of consecutive rows, so that their
// scales land side by side; else consecutive groups of one row (row-major scales). Either way
// each half-warp reads 16-byte vectors of one row's group and writes one 128-byte run of q.
// The host needs K (and inter) % 8 == 0, row strides % 8 == 0 and 16-byte aligned bases.
#pragma once

#include "sm90_utils.cuh"

namespace fp8gemm {

constexpr uint32_t kQuantGroup = 128;
constexpr uint32_t kQuantLanes = 16;  // lanes per group: 8 elements each
constexpr uint32_t kInBf16 = 0, kInF16 = 1, kInF32 = 2;

template <uint32_t kIn>
__device__ __forceinline__ void quant_load8(const void* ptr, float (&v)[8]) {
  uint32_t r[4];
  if constexpr (kIn == kInF32) {
    uint32_t t[4];
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(ptr));
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(t[0]), "=r"(t[1]), "=r"(t[2]), "=r"(t[3])
                 : "l"(static_cast<const float*>(ptr) + 4));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = __uint_as_float(r[i]);
      v[4 + i] = __uint_as_float(t[i]);
    }
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(ptr));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint16_t lo = static_cast<uint16_t>(r[i] & 0xffffu);
      const uint16_t hi = static_cast<uint16_t>(r[i] >> 16);
      if constexpr (kIn == kInBf16) {
        v[2 * i] = __uint_as_float(static_cast<uint32_t>(lo) << 16);
        v[2 * i + 1] = __uint_as_float(static_cast<uint32_t>(hi) << 16);
      } else {
        asm("cvt.f32.f16 %0, %1;" : "=f"(v[2 * i]) : "h"(lo));
        asm("cvt.f32.f16 %0, %1;" : "=f"(v[2 * i + 1]) : "h"(hi));
      }
    }
  }
}

// |a| folded into a running maximum; a NaN stays (torch's amax propagates it).
__device__ __forceinline__ float quant_nan_max(float m, float a) {
  a = fabsf(a);
  return (a > m || a != a) ? a : m;
}

// Two floats to packed FP8x2 (saturating, nearest even): lo goes to the lower byte.
template <bool kE5M2>
__device__ __forceinline__ uint32_t quant_pack_fp8x2(float lo, float hi) {
  uint16_t packed;
  if constexpr (kE5M2) {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  }
  return packed;
}

template <bool kPow2>
__device__ __forceinline__ float quant_scale(float amax, float fmt_max) {
  // (NaN > 1e-4 is false: written so that a NaN amax stays NaN, as torch's clamp_min keeps it)
  const float floored = amax < 1e-4f ? 1e-4f : amax;
  const float ratio = __fdiv_rn(floored, fmt_max);
  if constexpr (kPow2) {
    if (!(ratio <= 3.402823466e38f)) return ratio;  // NaN and infinity stay, as torch's exp2
    // ratio = m * 2^e with m in [0.5, 1): a power of two is its own scale, else 2^e
    int e;
    const float m = frexpf(ratio, &e);
    return m == 0.5f ? ratio : ldexpf(1.0f, e);
  }
  return ratio;
}

// (row, group) of work item `item` (see above).
template <bool kRowsFirst>
__device__ __forceinline__ void quant_item(uint32_t item, uint32_t m_rows, uint32_t groups,
                                           uint32_t& row, uint32_t& group) {
  if constexpr (kRowsFirst) {
    row = item % m_rows, group = item / m_rows;
  } else {
    row = item / groups, group = item % groups;
  }
}

template <uint32_t kIn, bool kE5M2, bool kSiluMul, bool kPow2, bool kRowsFirst, uint32_t kThreads,
          uint32_t kItems>
__global__ void __launch_bounds__(kThreads) quant_rows_kernel(
    const void* __restrict__ x, uint8_t* __restrict__ q, float* __restrict__ s, uint32_t m_rows,
    uint32_t k, uint32_t inter, uint64_t x_row, uint64_t x_batch, uint64_t q_batch,
    uint64_t s_row, uint64_t s_group, uint64_t s_batch, const int32_t* __restrict__ masked_m) {
  constexpr uint32_t kInBytes = kIn == kInF32 ? 4 : 2;
  constexpr float kFmtMax = kE5M2 ? 57344.0f : 448.0f;
  constexpr uint32_t kGroupsPerCta = kThreads / kQuantLanes;
  // (the host keeps M * groups below 2^31: 32-bit indices and division)
  const uint32_t groups = ceil_div(k, kQuantGroup);
  const uint32_t items = m_rows * groups;
  const uint32_t lane = threadIdx.x % kQuantLanes;
  const uint64_t batch = blockIdx.y;
  const char* xb = static_cast<const char*>(x) + batch * x_batch * kInBytes;
  uint8_t* qb = q + batch * q_batch;
  float* sb = s + batch * s_batch;

  const uint32_t first = blockIdx.x * kGroupsPerCta * kItems + threadIdx.x / kQuantLanes;
  // x comes from the kernel before; the GEMM after (launched with PDL) may start its prologue,
  // and its L2 prefetch of the weights, while this kernel runs.
  grid_dependency_wait();
  grid_launch_dependents();
  uint32_t live_rows = m_rows;  // (masked_m clamped to [0, M])
  if (masked_m != nullptr) {
    const int32_t mm = __ldg(masked_m + batch);
    live_rows = mm <= 0 ? 0u : min(static_cast<uint32_t>(mm), m_rows);
  }
  float v[kItems][8];
  bool live[kItems];
  // every load first, then the arithmetic: kItems loads of 16 bytes in flight per thread
#pragma unroll
  for (uint32_t it = 0; it < kItems; ++it) {
    const uint32_t item = first + it * kGroupsPerCta;
    uint32_t row, group;
    quant_item<kRowsFirst>(item, m_rows, groups, row, group);
    const uint32_t col = group * kQuantGroup + lane * 8;
    live[it] = item < items && col < k && row < live_rows;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[it][i] = 0.0f;
    if (live[it]) {
      const char* p = xb + (static_cast<uint64_t>(row) * x_row + col) * kInBytes;
      quant_load8<kIn>(p, v[it]);
      if constexpr (kSiluMul) {
        float up[8];
        quant_load8<kIn>(p + static_cast<uint64_t>(inter) * kInBytes, up);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[it][i] = __fdiv_rn(v[it][i], 1.0f + expf(-v[it][i])) * up[i];
      }
    }
  }
#pragma unroll
  for (uint32_t it = 0; it < kItems; ++it) {
    const uint32_t item = first + it * kGroupsPerCta;
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = quant_nan_max(amax, v[it][i]);
#pragma unroll
    for (uint32_t off = kQuantLanes / 2; off > 0; off /= 2) {
      amax = quant_nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    }
    if (item >= items) continue;  // (after the shuffles, which every lane joins)
    const float scale = quant_scale<kPow2>(amax, kFmtMax);
    uint32_t row, group;
    quant_item<kRowsFirst>(item, m_rows, groups, row, group);
    if (live[it]) {
      // NOTE: no clamp before the cast: satfinite saturates what lies beyond the format's
      // largest value (infinities included) and keeps NaN, as torch's clamp and cast do.
      uint32_t packed[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float f[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) f[j] = __fdiv_rn(v[it][4 * i + j], scale);
        packed[i] = quant_pack_fp8x2<kE5M2>(f[0], f[1]) |
                    (quant_pack_fp8x2<kE5M2>(f[2], f[3]) << 16);
      }
      uint8_t* dst = qb + static_cast<uint64_t>(row) * k + group * kQuantGroup + lane * 8;
      asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(dst), "r"(packed[0]), "r"(packed[1]));
    }
    if (lane == 0) sb[static_cast<uint64_t>(row) * s_row + group * s_group] = scale;
  }
}

}  // namespace fp8gemm
