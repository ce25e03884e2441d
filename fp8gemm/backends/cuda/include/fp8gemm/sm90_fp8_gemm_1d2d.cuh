// FP8 GEMM for sm_90a, dense and MoE-grouped: D[M, N] (bf16) = (A * sa) . (B[g] * sb[g])^T (+ C)
//   A [M, K] e4m3 (kAE5M2: e5m2, an output gradient dY), K-major; sa float32 per 1x128 group, column-major [ceil(K/128), M padded to 4]
//     (masked: [G][ceil(K/128), Mmax padded to 4])
//   B [G, N, K] e4m3, K-major; sb float32 per 128x128 block, row-major [G, ceil(N/128), ceil(K/128)]
//   kKind (sm90_scheduler.cuh): dense (G = 1); contiguous (group of each row in m_indices);
//     offsets (group g owns rows offsets[g] .. offsets[g+1]); masked (A [G, Mmax, K], group g's
//     first masked_m[g] rows). Rows that belong to no group are neither computed nor written.
//   kHasC (dense only): C float32 [M, N], unit column stride, row stride c_stride elements (0: one
//     row for every row, a bias), added to the FP32 sums before the bf16 rounding.
//   kNumSplits > 1 (dense only, split-K): each tile's k-blocks are cut in kNumSplits ranges, each a
//     work item of its own (a tile's parts are consecutive items: neighbouring CTAs of one wave).
//     Each part's FP32 sums go to split_ws (kNumSplits slots of BLOCK_M x BLOCK_N floats per
//     tile), counted by split_flags (one word per tile, zero before the launch and left zero);
//     the part that finds the others stored sums them in a fixed order and runs the epilogue.
//   kCtasPerSm = 2 (BLOCK_M = 64, no cluster): two CTAs share an SM, each in half its registers
//     and shared memory, so that two math warpgroups of different tiles feed its tensor cores.
// Persistent and warp-specialised: one TMA producer warpgroup feeds one (BLOCK_M = 64) or two
// (BLOCK_M = 128, 256) math warpgroups through a ring of kNumStages shared-memory stages.
#pragma once

#include "sm90_utils.cuh"
#include "sm90_wgmma_fp8.cuh"
#include "sm90_scheduler.cuh"

// A traced build (scripts/timeline_1d2d.py defines FP8GEMM_TRACE in a copy of these headers):
// thread 0 of each warpgroup (math warpgroups, and the producer's issuing thread) of the first
// kTraceCtas CTAs writes a clock64 stamp at each event of its first kTraceEvents, the event's
// tag in the top 8 bits. Off by default: the stamps compile to nothing.
#ifdef FP8GEMM_TRACE
namespace fp8gemm {
constexpr uint32_t kTraceCtas = 8, kTraceRoles = 3, kTraceEvents = 8192;
}
extern "C" {
__device__ unsigned long long
    fp8gemm_trace[fp8gemm::kTraceCtas * fp8gemm::kTraceRoles * fp8gemm::kTraceEvents];
}
#define FP8GEMM_STAMP(tag) fp8gemm::trace_stamp(tag, trace_count)
#define FP8GEMM_TRACE_COUNTER uint32_t trace_count = 0
#else
#define FP8GEMM_STAMP(tag) ((void)0)
#define FP8GEMM_TRACE_COUNTER
#endif

namespace fp8gemm {

// Trace tags (scripts/timeline_1d2d.py reads them).
enum TraceTag : uint32_t {
  kTraceSlotFree = 1,  // producer: a k-block's stage is free (empty barrier passed)
  kTraceSent = 2,      // producer: the k-block's loads are issued
  kTraceLanded = 3,    // math: the k-block's stage has landed (full barrier passed)
  kTraceIssued = 4,    // math: its wgmma are issued
  kTraceDone = 5,      // math: its wgmma are complete
  kTracePromoted = 6,  // math: its sums are promoted
  kTraceEpilogue = 7,  // math: a tile's epilogue starts
  kTraceEpilogueEnd = 8,
  kTraceEpilogueSynced = 9,   // math: past the epilogue's first barrier (the previous store read)
  kTraceEpilogueWritten = 10,  // math: its sums written to shared memory and fenced
  kTraceEpilogueStoring = 11,  // math: past its second barrier, before the stores' issue
  kTraceTileSynced = 12,  // math: a tile's B scales in shared memory (past the tile's barrier)
  kTraceTileReady = 13,   // math: the next tile found and its B scales' loads issued
};

#ifdef FP8GEMM_TRACE
__device__ __forceinline__ void trace_stamp(uint32_t tag, uint32_t& count) {
  if (blockIdx.x >= kTraceCtas || threadIdx.x % 128 != 0 || count >= kTraceEvents) return;
  const uint32_t role = threadIdx.x / 128;
  if (role >= kTraceRoles) return;
  const unsigned long long t = clock64();
  fp8gemm_trace[(blockIdx.x * kTraceRoles + role) * kTraceEvents + count++] =
      (static_cast<unsigned long long>(tag) << 56) | (t & ((1ull << 56) - 1));
}
#endif

template <uint32_t BLOCK_M>
__host__ __device__ constexpr uint32_t sm90_num_math_threads() { return BLOCK_M == 64 ? 128 : 256; }

// Largest power of two dividing n, capped at 128.
__host__ __device__ constexpr uint32_t pow2_factor_128(uint32_t n) {
  return (n & (~n + 1)) < 128 ? (n & (~n + 1)) : 128;
}

// Promotion of one waited-for wgmma accumulator (rows r and r + 8) into the FP32 sums,
// fin += acc * sa * sb: the 8-column groups [0, num_first) take the first 128-wide B-scale
// block's sb0, the rest sb1. num_first = (128 - n0 % 128) / 8, clipped to BLOCK_N / 8.
// kSplit < 128: n0 % 128 == kSplit, a compile-time constant (4 products and no selects);
// kSplit == kAnySplit: num_first decides at run time, each group selecting its scale.
constexpr uint32_t kAnySplit = 128;
template <uint32_t BLOCK_N, uint32_t kSplit, uint32_t kNumAccum>
__device__ __forceinline__ void promote_sums(uint32_t num_first, float* fin,
                                             float (&acc)[kNumAccum], float sa0, float sa1,
                                             float sb0, float sb1) {
  constexpr uint32_t kFirst = (128 - kSplit) / 8 < BLOCK_N / 8 ? (128 - kSplit) / 8 : BLOCK_N / 8;
#pragma unroll
  for (uint32_t i = 0; i < kNumAccum; ++i) fence_operand(acc[i]);
  const float s00 = sa0 * sb0, s01 = sa0 * sb1, s10 = sa1 * sb0, s11 = sa1 * sb1;
#pragma unroll
  for (uint32_t g = 0; g < BLOCK_N / 8; ++g) {
    const bool first = kSplit == kAnySplit ? g < num_first : g < kFirst;
    const float c0 = first ? s00 : s01, c1 = first ? s10 : s11;
    fin[4 * g + 0] = fmaf(acc[4 * g + 0], c0, fin[4 * g + 0]);
    fin[4 * g + 1] = fmaf(acc[4 * g + 1], c0, fin[4 * g + 1]);
    fin[4 * g + 2] = fmaf(acc[4 * g + 2], c1, fin[4 * g + 2]);
    fin[4 * g + 3] = fmaf(acc[4 * g + 3], c1, fin[4 * g + 3]);
  }
}

template <uint32_t V>
struct Split {
  static constexpr uint32_t value = V;
};

// The waves of a tile a k-loop runs: bit w for wave w.
template <uint32_t V>
struct Waves {
  static constexpr uint32_t value = V;
};

// f(Split<n0 % 128>{}) for a tile at column n0: n0 is a multiple of BLOCK_N, so n0 % 128 is a
// multiple of kStep = pow2_factor_128(BLOCK_N) in [kLo, kHi]; a binary search over those values
// calls the instance of f whose split is a constant.
template <uint32_t kStep, uint32_t kLo, uint32_t kHi, typename F>
__device__ __forceinline__ void with_split(uint32_t n0_mod_128, F&& f) {
  if constexpr (kLo == kHi) {
    f(Split<kLo>{});
  } else {
    constexpr uint32_t kMid = kLo + ((kHi - kLo) / kStep + 1) / 2 * kStep;
    if (n0_mod_128 >= kMid)
      with_split<kStep, kMid, kHi>(n0_mod_128, f);
    else
      with_split<kStep, kLo, kMid - kStep>(n0_mod_128, f);
  }
}

template <uint32_t kKind, uint32_t SHAPE_N, uint32_t SHAPE_K, uint32_t BLOCK_M, uint32_t BLOCK_N,
          uint32_t kNumStages>
struct Sm90Fp8Gemm1d2dLayout {
  static constexpr uint32_t BLOCK_K = 128;
  // A scales of a stage: BLOCK_M floats from row m0. TMA needs the box's start in the innermost
  // dimension (rows of the column-major scales) on 16 bytes: offsets tiles start at any row, so
  // they load from m0 rounded down to 4 rows, 4 floats more, and read from m0 % 4 on. A box is at
  // most 256 elements: 256 + 4 rows are two boxes of 128 + 4, 128 rows apart.
  static constexpr uint32_t kSaPad = kKind == kKindOffsets ? 4 : 0;
  static constexpr uint32_t kSaLoads = kSaPad > 0 && BLOCK_M > 128 ? 2 : 1;
  static constexpr uint32_t kSaBox = (kSaLoads == 2 ? 128 : BLOCK_M) + kSaPad;
  // NOTE: TMA writes shared memory at 128-byte aligned addresses: a stage holds a multiple of 32.
  static constexpr uint32_t kSaStage = ceil_div(BLOCK_M + kSaPad, 32u) * 32;  // floats per stage
  static constexpr uint32_t kNumKBlocks = ceil_div(SHAPE_K, BLOCK_K);
  // Shared memory, in carve-up order (every tile size is a multiple of 1024 bytes, so the TMA
  // destinations of the 128-byte swizzle stay 1024-byte aligned).
  static constexpr uint32_t SMEM_D = BLOCK_M * BLOCK_N * 2;
  static constexpr uint32_t SMEM_A = BLOCK_M * BLOCK_K;
  static constexpr uint32_t SMEM_B = BLOCK_N * BLOCK_K;
  static constexpr uint32_t SMEM_SA = kSaStage * 4;
  static constexpr uint32_t kSaTxBytes = kSaLoads * kSaBox * 4;
  static constexpr uint32_t SMEM_SB = ceil_div(2 * kNumKBlocks * 4, 8u) * 8;
  static constexpr uint32_t SMEM_BARRIERS = 2 * kNumStages * 8;
  // 1024 bytes of slack to align the dynamic shared-memory base.
  static constexpr uint32_t kSmemBytes =
      1024 + SMEM_D + kNumStages * (SMEM_A + SMEM_B + SMEM_SA) + SMEM_SB + SMEM_BARRIERS;
};

// Rows the A-scale load of a tile starts before its first row (Sm90Fp8Gemm1d2dLayout::kSaPad).
template <uint32_t kKind>
__device__ __forceinline__ uint32_t sa_shift_of(const Tile& t) {
  return kKind == kKindOffsets ? static_cast<uint32_t>(t.sa_m) & 3u : 0u;
}

// f(w, i, row, col) for each pair of a math thread's FP32 sums that lies inside D [shape_m, SHAPE_N]:
// final_acc[w][i] and [i + 1] at (row, col) and (row, col + 1), the wgmma D fragment layout of a
// tile at (m0, n0) for the thread's rows r0 and r0 + 8 of each wave and its column pair col0.
// (Columns come in pairs and N % 8 == 0: a pair is in or out.)
template <uint32_t kNumWaves, uint32_t WAVE_M, uint32_t BLOCK_N, uint32_t SHAPE_N, typename F>
__device__ __forceinline__ void for_each_sum_pair(uint32_t m0, uint32_t n0, uint32_t r0,
                                                  uint32_t shape_m, F&& f) {
#pragma unroll
  for (uint32_t w = 0; w < kNumWaves; ++w) {
#pragma unroll
    for (uint32_t h = 0; h < 2; ++h) {
      const uint32_t row = m0 + w * WAVE_M + r0 + 8 * h;
#pragma unroll
      for (uint32_t g = 0; g < BLOCK_N / 8; ++g) {
        const uint32_t col = n0 + g * 8;
        if (row < shape_m && col < SHAPE_N) f(w, 4 * g + 2 * h, row, col);
      }
    }
  }
}

template <uint32_t kKind, uint32_t SHAPE_N, uint32_t SHAPE_K, uint32_t BLOCK_M, uint32_t BLOCK_N,
          uint32_t kNumStages, uint32_t kNumTMAMulticast, bool kIsMulticastOnA, uint32_t kBandSize,
          bool kTwoAccum, bool kHasC, bool kAE5M2, uint32_t kNumSplits, uint32_t kCtasPerSm>
__global__ void __launch_bounds__(sm90_num_math_threads<BLOCK_M>() + 128, kCtasPerSm)
sm90_fp8_gemm_1d2d_kernel(const float* __restrict__ sb, uint32_t shape_m,
                          const int32_t* __restrict__ grouped_layout, uint32_t num_groups,
                          uint8_t* __restrict__ out, const float* __restrict__ c, uint64_t c_stride,
                          float* __restrict__ split_ws, uint32_t* __restrict__ split_flags,
                          const __grid_constant__ TmaDescriptor tmap_a,
                          const __grid_constant__ TmaDescriptor tmap_b,
                          const __grid_constant__ TmaDescriptor tmap_sa,
                          const __grid_constant__ TmaDescriptor tmap_d,
                          const __grid_constant__ TmaDescriptor tmap_d_tail,
                          const __grid_constant__ TmaDescriptor tmap_a_tail) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Layout = Sm90Fp8Gemm1d2dLayout<kKind, SHAPE_N, SHAPE_K, BLOCK_M, BLOCK_N, kNumStages>;
  constexpr uint32_t BLOCK_K = Layout::BLOCK_K;
  constexpr uint32_t WGMMA_M = 64, WGMMA_K = 32;
  constexpr uint32_t kNumMathThreads = sm90_num_math_threads<BLOCK_M>();
  constexpr uint32_t kNumMathWarps = kNumMathThreads / 32;
  // NOTE: BLOCK_M = 256 runs as two waves of 128 rows (64 per math warpgroup) per k-block, one
  // after the other through the same wgmma accumulator: only the FP32 sums double (a third
  // accumulator would not fit 232 registers), and the tile reads 25% fewer A+B bytes per FLOP
  // than 128 x BLOCK_N.
  constexpr uint32_t WAVE_M = kNumMathThreads / 128 * WGMMA_M;
  constexpr uint32_t kNumWaves = BLOCK_M / WAVE_M;
  constexpr uint32_t kNumKBlocks = Layout::kNumKBlocks;
  constexpr uint32_t kNumNBlocks = ceil_div(SHAPE_N, BLOCK_N);
  constexpr uint32_t kNumSbRows = ceil_div(SHAPE_N, 128u);
  // NOTE: TMA zero-fills the columns past SHAPE_K of the last k-block, so every k-block runs
  // the same four k-steps: the products of the zeros add nothing. (A shorter sequence for the
  // last k-block is a second wgmma sequence in the loop; chosen at run time, ptxas fenced every
  // k-block's wgmma for it, C7519.)
  constexpr uint32_t kNumAccum = WgmmaFp8<BLOCK_N>::kNumAccum;
  constexpr uint32_t kNumKSteps = BLOCK_K / WGMMA_K;
  // NOTE: kTwoAccum: two wgmma accumulators per thread; the wgmma of k-block kb + 1 is issued
  // before the wait for kb, so each warpgroup keeps one wgmma group queued while it promotes, and
  // a tile's epilogue runs under the next tile's first wgmma group. With one math warpgroup
  // (BLOCK_M = 64) nothing else feeds the tensor cores while it promotes.
  constexpr uint32_t kKChunk = 8;
  // NOTE: setmaxnreg moves registers from the producer (address arithmetic only) to the math
  // warpgroups, which hold two or three BLOCK_N/2 float arrays per thread. 128 * 40 + 256 * 232
  // fits the 64K-register file; one math warpgroup (BLOCK_M = 64) can take 256 (its B-scale
  // prefetch at K = MAX_K needs more than 232 next to a 160-wide tile). Two CTAs an SM launch
  // with 128 registers a thread (the 32K of each CTA): the producer's 88 go to the math
  // warpgroup, 216.
  constexpr uint32_t kProducerRegs = 40;
  // NOTE: a tile's first k-block waits for its stage (in traces of 128x192 and 256x128 tiles at
  // 32 skewed experts, 7168x2048: 1550-1780 cycles a tile against 170-180 for the others): its
  // loads go out kNumStages k-blocks before the tile before it ends, and spend about twice the
  // usual time in flight. The producer sends that k-block of A and B to L2 kNextTileLead
  // k-blocks earlier still (prefetch_next); the wait drops to about 1130 cycles. H100, two runs
  // against no prefetch (contiguous 16 and 32 skewed experts, 8 x 4096; dense at M = 4096): the
  // grouped shapes 1.004-1.014x (918.1 us against 939.2 at 32 x 1024 7168x2048), dense level.
  // Two k-blocks ahead gained no more; sent at a tile's first k-block (a tile too short for the
  // lead), two cost 4096x32768x512 (4 k-blocks) 3 %: short tiles go without.
  constexpr uint32_t kNextTileLead = 4;
  constexpr uint32_t kMathRegs = kCtasPerSm == 2 ? 216 : (kNumMathThreads == 128 ? 256 : 232);
  constexpr bool kBandAlongM = kNumTMAMulticast > 1 && !kIsMulticastOnA;
  // NOTE: a contiguous kernel in 2-CTA clusters shares B between the pair's tiles where both are
  // of one group (sm90_scheduler.cuh, kPairs); the pair runs every tile in step, empty ones too.
  constexpr bool kPairs = kKind == kKindContiguous && kNumTMAMulticast > 1;
  // NOTE: a grouped 256-row tile whose group has rows in one 128-row half only (a contiguous
  // block shared by two groups of a layout padded to 128 rows, a group's last 1-128 rows) runs
  // that half's wave alone: the producer loads its 128 A rows (tmap_a_tail, a 128-row box), the
  // math warpgroups issue and promote one wave a k-block, and the masked store skips the other
  // half. Such a run costs about as much as a 128x BLOCK_N tile instead of a whole 256-row one.
  // (Only where the A map's box is 256 rows: shape_m >= BLOCK_M.)
  constexpr bool kHalfTiles = kKind != kKindDense && BLOCK_M == 256 && !kPairs && !kTwoAccum &&
                              kNumSplits == 1;
  // The waves a tile runs (all of them, or one half's).
  constexpr uint32_t kAllWaves = (1u << kNumWaves) - 1;
  auto waves_of = [shape_m](const Tile& t) -> uint32_t {
    if constexpr (kHalfTiles)
      return shape_m >= BLOCK_M && (t.halves == 1 || t.halves == 2) ? t.halves : kAllWaves;
    else
      return kAllWaves;
  };
  // Output tile in shared memory: kNumDChunks column chunks of 64 (128 bytes a row, 128-byte
  // swizzle, one TMA store each through tmap_d), then the last BLOCK_N % 64 columns unswizzled
  // (tmap_d_tail).
  // NOTE: with the swizzle, the 8 rows one warp store touches fall in 8 different 16-byte bank
  // groups: conflict-free, where plain rows of BLOCK_N * 2 bytes collide up to 8 ways.
  constexpr uint32_t kNumDChunks = BLOCK_N / 64;
  constexpr uint32_t kTailCols = BLOCK_N % 64;

  // --- static checks ----------------------------------------------------------------------------
  static_assert(BLOCK_M == 64 || BLOCK_M == 128 || BLOCK_M == 256,
                "one or two math warpgroups of 64 rows each, in one or two waves");
  static_assert(BLOCK_N % 8 == 0 && BLOCK_N >= 8 && BLOCK_N <= 256, "wgmma N is 8..256, step 8");
  // NOTE: a tile spans at most two 128-wide B scale blocks only when its width never straddles a
  // whole block: BLOCK_N <= 128 + the largest power of two dividing BLOCK_N (e.g. 144, 160, not 152).
  static_assert(BLOCK_N <= 128 + pow2_factor_128(BLOCK_N), "tile would span three B scale blocks");
  static_assert(SHAPE_K % 16 == 0, "TMA needs K-major rows of a multiple of 16 bytes");
  static_assert(SHAPE_N % 8 == 0, "TMA store needs bf16 output rows of a multiple of 16 bytes");
  static_assert(kNumTMAMulticast == 1 || kNumTMAMulticast == 2, "clusters of 1 or 2 CTAs");
  static_assert(kKind == kKindDense || kNumTMAMulticast == 1 ||
                    (kPairs && !kIsMulticastOnA && BLOCK_M >= 128),
                "grouped kernels run without clusters, but for contiguous 128- or 256-row tiles "
                "sharing B");
  static_assert(kKind == kKindDense || !kHasC, "C is a dense kernel's input");
  static_assert(kNumTMAMulticast == 1 || kBandSize % 2 == 0, "cluster pairs must share a band");
  static_assert(kNumStages >= 2, "at least double buffering");
  static_assert(!kTwoAccum || (BLOCK_M <= 128 && BLOCK_N <= 128),
                "two accumulators and the FP32 sums: 3 x BLOCK_N/2 registers per thread, one wave");
  static_assert(Layout::kSmemBytes <= 232448, "227 KB of shared memory per block at most");
  static_assert(kCtasPerSm == 1 || (kCtasPerSm == 2 && BLOCK_M == 64 && kNumTMAMulticast == 1 &&
                                    Layout::kSmemBytes <= 233472 / 2 - 2048),
                "two CTAs an SM: one math warpgroup each, no cluster, half the SM's 228 KB less "
                "the 1 KB reserved and the 1 KB static per block (smem_limit)");
  static_assert(kNumSplits == 1 || (kKind == kKindDense && kNumTMAMulticast == 1 && !kTwoAccum &&
                                    kNumSplits <= kNumKBlocks),
                "split-K: dense, one CTA per cluster, one accumulator, and a k-block per part at "
                "least");

  // Guard against a host whose idea of the shared-memory size disagrees with this layout.
  uint32_t dyn_smem;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (dyn_smem < Layout::kSmemBytes) asm volatile("trap;");

  // --- shared-memory carve-up -------------------------------------------------------------------
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* smem_d = smem;
  uint8_t* smem_a = smem_d + Layout::SMEM_D;
  uint8_t* smem_b = smem_a + kNumStages * Layout::SMEM_A;
  float* smem_sa = reinterpret_cast<float*>(smem_b + kNumStages * Layout::SMEM_B);
  float* smem_sb = smem_sa + kNumStages * Layout::kSaStage;  // [2][kNumKBlocks]
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(smem_sb) + Layout::SMEM_SB);
  uint64_t* empty_bar = full_bar + kNumStages;

  // NOTE: broadcast from lane 0 so that the compiler knows it is warp-uniform: the wgmma A
  // descriptors derived from it then live in uniform registers, off the math warps' vector
  // datapath (a per-thread value cost five vector instructions per wgmma to build and move).
  const uint32_t warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  const uint32_t lane = lane_idx();

  // --- barrier setup ----------------------------------------------------------------------------
  if (threadIdx.x == kNumMathThreads) {
    tma_prefetch_descriptor(&tmap_a);
    tma_prefetch_descriptor(&tmap_b);
    tma_prefetch_descriptor(&tmap_sa);
    tma_prefetch_descriptor(&tmap_d);
    tma_prefetch_descriptor(&tmap_d_tail);
    if constexpr (kKind == kKindDense || kHalfTiles) tma_prefetch_descriptor(&tmap_a_tail);
  }
  // One arrival per math warp of every CTA that writes into a stage frees it.
  if (threadIdx.x == 0)
    init_stage_ring(full_bar, empty_bar, kNumStages, kNumMathWarps * kNumTMAMulticast);
  using Scheduler =
      TileScheduler<kKind, BLOCK_M, kNumNBlocks, kBandSize, kBandAlongM, kNumSplits, kPairs>;
  // The k-blocks of a tile's part: all of them without split-K.
  auto kb_begin = [](const Tile& t) -> uint32_t {
    if constexpr (kNumSplits == 1) return 0;
    else return t.split * kNumKBlocks / kNumSplits;
  };
  auto kb_end = [](const Tile& t) -> uint32_t {
    if constexpr (kNumSplits == 1) return kNumKBlocks;
    else return (t.split + 1) * kNumKBlocks / kNumSplits;
  };
  // NOTE: a dense CTA's first tile follows from blockIdx alone, so its first B boxes can go to
  // L2 before the dependency wait (prefetch_first_b_l2).
  if constexpr (kKind == kKindDense) {
    if (threadIdx.x == kNumMathThreads) {
      Scheduler first(shape_m, grouped_layout, num_groups);  // (dense: arithmetic only)
      Tile t;
      if (first.next(t)) {
        prefetch_first_b_l2<BLOCK_K>(&tmap_b, kb_begin(t), kb_end(t),
                                     static_cast<int32_t>(t.n_block * BLOCK_N));
      }
    }
  }
  if constexpr (kNumTMAMulticast > 1) {
    cluster_sync();
  } else {
    __syncthreads();
  }
  // Everything above is the prologue a dependent launch overlaps with the kernel before.
  grid_dependency_wait();
  grid_launch_dependents();

  Scheduler scheduler(shape_m, grouped_layout, num_groups);
  Tile tile;
  FP8GEMM_TRACE_COUNTER;

  if (warpgroup == kNumMathThreads / 128) {
    // --- producer: one thread issues every TMA load ---------------------------------------------
    warpgroup_reg_dealloc<kProducerRegs>();
    // NOTE: one thread issues every barrier operation and TMA load. The contiguous kind's walk of
    // the scheduler reads the layout warp-wide, so there the whole first producer warp walks it
    // and lane 0 issues, the other lanes waiting at __syncwarp (with lanes of a diverged warp at
    // the TMA instruction the kernel faulted).
    const bool is_leader = kNumTMAMulticast == 1 || cluster_cta_rank() == 0;
    // NOTE: below BLOCK_M rows the host's A map has a box of M rows: TMA's zero fill of rows
    // past M is slow (M = 1 took 1.75x the time of M = 64). The rows past M in shared memory
    // keep stale bytes; they only feed output rows that the TMA store clips.
    const uint32_t a_rows = shape_m < BLOCK_M ? shape_m : BLOCK_M;
    // NOTE: B of a group with one m-block is read by one tile only, so its lines go first in L2
    // (l2_policy_evict_first); other tiles' B keeps the default policy.
    const uint64_t policy_once = l2_policy_evict_first();
    uint32_t stage = 0, phase = 0;
    // The first k-block of the tile after this one into L2 (a cluster's shared operand by its
    // leader only).
    auto prefetch_next = [&](const Tile& next) {
      const int32_t k0 = static_cast<int32_t>(kb_begin(next) * BLOCK_K);
      const int32_t n0 = static_cast<int32_t>(next.group * SHAPE_N + next.n_block * BLOCK_N);
      const bool follower = kNumTMAMulticast > 1 && !is_leader;
      if (!(follower && kIsMulticastOnA)) tma_prefetch_l2_2d(&tmap_a, k0, next.m0);
      if (!(follower && !kIsMulticastOnA)) tma_prefetch_l2_2d(&tmap_b, k0, n0);
    };
    auto produce = [&](const Tile& t, const Tile& next, bool has_next) {
      const int32_t m0 = t.m0;
      // B of group g is rows [g * N, (g + 1) * N) of the [G * N, K] view.
      const int32_t n0 = static_cast<int32_t>(t.group * SHAPE_N + t.n_block * BLOCK_N);
      // NOTE: a dense GEMM's last m-block, when M is not a multiple of BLOCK_M, loads its rows
      // through a box of exactly those rows (tmap_a_tail), for the same reason as above: at
      // M = 192 a 128-row tile's zero fill of 64 rows made the GEMM slower than at M = 256.
      const TmaDescriptor* map_a = &tmap_a;
      uint32_t box_rows = a_rows;  // A rows a k-block's load brings
      if constexpr (kKind == kKindDense) {
        const uint32_t rows = shape_m - static_cast<uint32_t>(m0);
        if (rows < a_rows) map_a = &tmap_a_tail, box_rows = rows;
      }
      // A half tile: its half's 128 A rows (tmap_a_tail), into that half of the stage.
      int32_t a_m0 = m0;
      uint32_t a_dst = 0;
      if constexpr (kHalfTiles) {
        const uint32_t waves = waves_of(t);
        if (waves != kAllWaves) {
          const uint32_t h = waves >> 1;
          map_a = &tmap_a_tail;
          a_m0 += static_cast<int32_t>(h * 128);
          a_dst = h * 128 * BLOCK_K;
          box_rows = 128;
        }
      }
      const uint32_t tx_bytes = box_rows * BLOCK_K + Layout::SMEM_B + Layout::kSaTxBytes;
      const uint32_t kb1 = kb_end(t);
      if constexpr (kPairs) {
        // An empty tile: the stages complete on the arrival alone.
        if (t.halves == 0) {
          for (uint32_t kb = kb_begin(t); kb < kb1; ++kb) {
            mbar_wait(&empty_bar[stage], phase ^ 1);
            mbar_arrive(&full_bar[stage]);
            if (++stage == kNumStages) stage = 0, phase ^= 1;
          }
          return;
        }
      }
      // (pairs: the tile's B comes through the leader's multicast, else each CTA loads its own)
      const bool multicast_b = kNumTMAMulticast > 1 && !kIsMulticastOnA && (!kPairs || t.multicast);
      // One k-block's loads into the current stage.
      auto load_k_block = [&](uint32_t kb) {
        mbar_wait(&empty_bar[stage], phase ^ 1);
        FP8GEMM_STAMP(kTraceSlotFree);
        uint64_t* bar = &full_bar[stage];
        mbar_arrive_expect_tx(bar, tx_bytes);
        const int32_t k0 = static_cast<int32_t>(kb * BLOCK_K);
        uint8_t* dst_a = smem_a + stage * Layout::SMEM_A + a_dst;
        uint8_t* dst_b = smem_b + stage * Layout::SMEM_B;
        // NOTE: with a cluster, the leader loads the shared operand once into both CTAs; the
        // other CTA's barrier still expects those bytes, so both count them in tx_bytes (the
        // pair shares that operand's block, and with it any tail box of it).
        if (kNumTMAMulticast > 1 && kIsMulticastOnA) {
          if (is_leader) tma_load_2d_multicast(dst_a, map_a, bar, k0, a_m0, 0b11);
        } else {
          tma_load_2d(dst_a, map_a, bar, k0, a_m0);
        }
        if (multicast_b) {
          if (is_leader) tma_load_2d_multicast(dst_b, &tmap_b, bar, k0, n0, 0b11);
        } else if (t.b_once) {
          tma_load_2d_hint(dst_b, &tmap_b, bar, k0, n0, policy_once);
        } else {
          tma_load_2d(dst_b, &tmap_b, bar, k0, n0);
        }
        if constexpr (kKind == kKindMasked) {
          tma_load_3d(smem_sa + stage * Layout::kSaStage, &tmap_sa, bar, t.sa_m, static_cast<int32_t>(kb),
                      static_cast<int32_t>(t.group));
        } else {
          const int32_t sa_m0 = t.sa_m - static_cast<int32_t>(sa_shift_of<kKind>(t));
#pragma unroll
          for (uint32_t j = 0; j < Layout::kSaLoads; ++j)
            tma_load_2d(smem_sa + stage * Layout::kSaStage + j * 128, &tmap_sa, bar,
                        sa_m0 + static_cast<int32_t>(j * 128), static_cast<int32_t>(kb));
        }
        FP8GEMM_STAMP(kTraceSent);
        if (++stage == kNumStages) stage = 0, phase ^= 1;
      };
      // The k-block at which the next tile's first goes to L2 (kb1: none).
      const uint32_t kb_pf = has_next && kb1 >= kb_begin(t) + kNumStages + kNextTileLead
                                 ? kb1 - kNumStages - kNextTileLead : kb1;
      if constexpr (kKind == kKindDense) {
        for (uint32_t kb = kb_begin(t); kb < kb1; ++kb) {
          if (kb == kb_pf) prefetch_next(next);
          load_k_block(kb);
        }
      } else {
        // NOTE: not unrolled for the grouped kinds: the producer has 40 registers, and
        // ptxas's unrolled copies of this loop (at 16 k-blocks) made it spill the contiguous
        // scheduler's state to local memory. Dense tiles keep ptxas's unrolling (four k-blocks
        // a pass): with a loop of one k-block, decode tiles (64 rows, 16-64 wide) and the
        // narrow long-K tiles (128x32 at K = 32768) ran 5-11 % slower on the H200.
#pragma unroll 1
        for (uint32_t kb = kb_begin(t); kb < kb1; ++kb) {
          if (kb == kb_pf) prefetch_next(next);
          load_k_block(kb);
        }
      }
    };
    // The walk runs a tile ahead of the loads, for prefetch_next. Not for pairs: their walk's
    // state leaves the producer's 40 registers no room for a second tile.
    auto walk = [&]() {
      if constexpr (kPairs) {
        while (scheduler.next(tile)) {
          if (lane == 0) produce(tile, tile, false);
          __syncwarp();
        }
      } else {
        Tile next_tile;
        bool has_tile = scheduler.next(tile);
        while (has_tile) {
          const bool has_next = scheduler.next(next_tile);
          if (kKind != kKindContiguous || lane == 0) produce(tile, next_tile, has_next);
          if constexpr (kKind == kKindContiguous) __syncwarp();
          tile = next_tile;
          has_tile = has_next;
        }
      }
    };
    if constexpr (kKind == kKindContiguous) {
      if (threadIdx.x / 32 == kNumMathThreads / 32) walk();
    } else if (threadIdx.x == kNumMathThreads) {
      walk();
    }
  } else {
    // --- consumers: wgmma, promotion with scales, epilogue --------------------------------------
    warpgroup_reg_alloc<kMathRegs>();
    const uint32_t warp_in_wg = (threadIdx.x / 32) % 4;
    // This thread's accumulator rows are r0 and r0 + 8 of each wave (wgmma D fragment layout).
    const uint32_t r0 = warpgroup * WGMMA_M + warp_in_wg * 16 + lane / 4;
    const uint32_t col_in_group = (lane % 4) * 2;
    // This thread's A scales in stage 0 (a stage's are BLOCK_M floats further): one per-thread
    // base, so each load is that register plus a warp-uniform offset.
    const float* sa_rows = smem_sa + r0;
    uint32_t sa_off = 0;  // the tile's first row in its stage's A scales (sa_shift)
    // wgmma descriptors of stage 0: this warpgroup's A rows, and B. Another stage (wave) sits
    // whole multiples of 16 bytes further, added to the descriptor's 14-bit address field, which
    // cannot carry out: shared memory ends below 256 KB.
    const uint64_t desc_a0 = make_smem_desc_sw128(smem_a + warpgroup * WGMMA_M * BLOCK_K);
    const uint64_t desc_b0 = make_smem_desc_sw128(smem_b);
    uint32_t stage = 0, phase = 0;

    // B scales of the (at most two) 128-wide blocks a tile touches, for every k-block: each math
    // thread fetches kSbPerThread of them into registers one tile ahead.
    // NOTE: loading them at the start of their own tile put a global-memory round trip (~1 us
    // from a cold L2) between every two tiles; prefetched, the latency hides under a mainloop.
    constexpr uint32_t kSbPerThread = ceil_div(2 * kNumKBlocks, kNumMathThreads);
    float sb_prefetch[kSbPerThread];
    auto prefetch_sb = [&](const Tile& t) {
      const float* sb_g = sb + t.group * (kNumSbRows * kNumKBlocks);
      const uint32_t row0 = t.n_block * BLOCK_N / 128;
#pragma unroll
      for (uint32_t j = 0; j < kSbPerThread; ++j) {
        const uint32_t i = threadIdx.x + j * kNumMathThreads;
        const uint32_t row = row0 + (i >= kNumKBlocks ? 1 : 0);
        const uint32_t kb = i >= kNumKBlocks ? i - kNumKBlocks : i;
        sb_prefetch[j] = (i < 2 * kNumKBlocks && row < kNumSbRows) ? __ldg(sb_g + row * kNumKBlocks + kb) : 0.0f;
      }
    };

    // The FP32 sums of the tile being computed (with kTwoAccum, of the previous tile until its
    // epilogue has run under the next tile's first wgmma).
    float acc[kNumAccum], final_acc[kNumWaves][kNumAccum];
    auto zero_sums = [&]() {
#pragma unroll
      for (uint32_t w = 0; w < kNumWaves; ++w)
#pragma unroll
        for (uint32_t i = 0; i < kNumAccum; ++i) final_acc[w][i] = 0.0f;
    };

    // --- epilogue: final_acc -> bf16 tile in shared memory -> TMA stores ------------------------
    auto epilogue = [&](const Tile& t) {
      if constexpr (kPairs) {
        if (t.halves == 0) return;  // an empty tile stores nothing
      }
      // The previous tile's store must have finished reading smem_d before it is overwritten.
      if constexpr (kHasC) {
        // NOTE: C is read before the barrier below, so its global-memory latency overlaps the
        // wait for the previous store.
        for_each_sum_pair<kNumWaves, WAVE_M, BLOCK_N, SHAPE_N>(
            static_cast<uint32_t>(t.m0), t.n_block * BLOCK_N + col_in_group, r0, shape_m,
            [&](uint32_t w, uint32_t i, uint32_t row, uint32_t col) {
              const float* c_row = c + static_cast<uint64_t>(row) * c_stride;
              final_acc[w][i] += __ldg(c_row + col);
              final_acc[w][i + 1] += __ldg(c_row + col + 1);
            });
      }
      // (the one-accumulator loop's epilogue is traced in phases; kStampEpilogue)
      constexpr bool kStampEpilogue = !kTwoAccum && kNumSplits == 1;
      if (threadIdx.x == 0) tma_store_wait_read();
      named_barrier_sync(1, kNumMathThreads);
      if constexpr (kStampEpilogue) FP8GEMM_STAMP(kTraceEpilogueSynced);
      const uint32_t waves = waves_of(t);  // (a half tile's other wave holds nothing to store)
      // NOTE: two 8-column groups of the warp's 16 rows go out in one stmatrix (.x4: the group's
      // rows r and r + 8, then the next group's), a quarter of the shared-memory stores of one
      // 4-byte store per row and group. Lane l addresses row l % 8 of matrix l / 8: 8 rows
      // further for matrices 1 and 3, one group (16-byte unit) right for 2 and 3.
      // The output tile: 128-byte swizzled chunks of 64 columns (16-byte unit u of row r at
      // (u % 8) ^ (r % 8)), then the last BLOCK_N % 64 columns unswizzled. A lane's row is
      // lane % 8 modulo 8, and a pair starts on an even unit, so its unit in a chunk is
      // (g % 8) ^ ((lane % 8) ^ (lane / 16)): one XOR with a per-lane constant a store.
      const uint32_t st_row = r0 - lane / 4 + (lane / 8) % 2 * 8 + lane % 8;
      const uint32_t st_chunks = smem_addr(smem_d) + st_row * 128;
      const uint32_t st_swz = ((lane % 8) ^ (lane / 16)) * 16;
      const uint32_t st_tail = smem_addr(smem_d) + kNumDChunks * BLOCK_M * 128 +
                               st_row * (kTailCols * 2) + lane / 16 * 16;
      constexpr uint32_t kGroups = BLOCK_N / 8;
#pragma unroll
      for (uint32_t w = 0; w < kNumWaves; ++w) {
        if (!((waves >> w) & 1u)) continue;
        const float* f = final_acc[w];
#pragma unroll
        for (uint32_t g = 0; g + 1 < kGroups; g += 2) {
          // (a pair never straddles a chunk and the tail: a chunk holds 8 groups)
          const uint32_t addr = g / 8 + 1 <= kNumDChunks  // (g < 8 * kNumDChunks; 0 chunks)
              ? st_chunks + ((g / 8) * BLOCK_M + w * WAVE_M) * 128 + ((g % 8) * 16 ^ st_swz)
              : st_tail + (w * WAVE_M * kTailCols + (g - 8 * kNumDChunks) * 8) * 2;
          stmatrix_x4(addr, pack_bf16x2(f[4 * g + 0], f[4 * g + 1]),
                      pack_bf16x2(f[4 * g + 2], f[4 * g + 3]), pack_bf16x2(f[4 * g + 4], f[4 * g + 5]),
                      pack_bf16x2(f[4 * g + 6], f[4 * g + 7]));
        }
        if constexpr (kGroups % 2 == 1) {  // the tail's odd last group: rows r0 and r0 + 8
          constexpr uint32_t g = kGroups - 1, u = g - 8 * kNumDChunks;
          uint8_t* tail = smem_d + kNumDChunks * BLOCK_M * 128;
          const uint32_t row = w * WAVE_M + r0, col = u * 8 + col_in_group;
          st_shared_u32(tail + (row * kTailCols + col) * 2, pack_bf16x2(f[4 * g + 0], f[4 * g + 1]));
          st_shared_u32(tail + ((row + 8) * kTailCols + col) * 2, pack_bf16x2(f[4 * g + 2], f[4 * g + 3]));
        }
      }
      fence_proxy_async_smem();
      if constexpr (kStampEpilogue) FP8GEMM_STAMP(kTraceEpilogueWritten);
      named_barrier_sync(1, kNumMathThreads);
      if constexpr (kStampEpilogue) FP8GEMM_STAMP(kTraceEpilogueStoring);
      const uint32_t n0 = t.n_block * BLOCK_N;
      if (kKind != kKindDense && !t.full) {
        // Rows of other groups (or none) in the tile: stored row by row, 16 bytes a thread, so
        // that only the group's own rows are written. TMA cannot mask rows.
        constexpr uint32_t kUnitsPerRow = BLOCK_N / 8;
        const uint32_t row_lo = waves & 1u ? 0 : WAVE_M, row_hi = (waves & 2u ? 2 : 1) * WAVE_M;
        for (uint32_t i = row_lo * kUnitsPerRow + threadIdx.x; i < row_hi * kUnitsPerRow;
             i += kNumMathThreads) {
          const uint32_t row = i / kUnitsPerRow, u = i % kUnitsPerRow;
          const uint32_t col = n0 + u * 8;
          bool ok = col < SHAPE_N;
          if constexpr (kKind == kKindContiguous)
            ok &= row_group(grouped_layout, t.m0 + row, shape_m, num_groups) == static_cast<int32_t>(t.group);
          else
            ok &= row < t.rows;
          if (!ok) continue;
          const uint8_t* src = u < kNumDChunks * 8
              ? smem_d + (u / 8) * BLOCK_M * 128 + row * 128 + ((u % 8) ^ (row % 8)) * 16
              : smem_d + kNumDChunks * BLOCK_M * 128 + (row * kTailCols + (u - kNumDChunks * 8) * 8) * 2;
          st_global_v4(out + (static_cast<uint64_t>(t.m0 + row) * SHAPE_N + col) * 2, ld_shared_v4(src));
        }
        __syncwarp();
        return;
      }
      // NOTE: TMA clips the store at M and N, so partial dense tiles need no masking.
      if (threadIdx.x == 0) {
        const int32_t m0 = t.m0;
#pragma unroll
        for (uint32_t i = 0; i + 1 <= kNumDChunks; ++i)
          tma_store_2d(&tmap_d, smem_d + i * BLOCK_M * 128, static_cast<int32_t>(n0 + i * 64), m0);
        if constexpr (kTailCols > 0)
          tma_store_2d(&tmap_d_tail, smem_d + kNumDChunks * BLOCK_M * 128,
                       static_cast<int32_t>(n0 + kNumDChunks * 64), m0);
        tma_store_commit();
      }
    };

    // --- split-K: a tile's parts summed by the last to finish ------------------------------------
    // A part's FP32 sums go to its slot, each thread's registers as consecutive float4s (a warp's
    // stores: 512 contiguous bytes); the tile's flag counts the parts stored. The part that finds
    // every other one stored holds the tile's sums afterwards and returns true: with two parts it
    // adds the other's to its own in registers (a + b == b + a: the same bits whichever finished
    // last) and need not store its own if the other was there first; with more, every part is
    // stored and they are added in k order. No CTA waits for another.
    // NOTE: the barriers here also stand for the one the epilogue opens with: no math thread
    // rewrites smem_sb for the next tile while another still reads this tile's scales.
    constexpr uint32_t kQuads = kNumWaves * kNumAccum / 4;
    auto split_fixup = [&](const Tile& t) -> bool {
      uint32_t* flag = split_flags + t.part_tile;
      float* slots = split_ws + static_cast<uint64_t>(t.part_tile) * kNumSplits * (BLOCK_M * BLOCK_N) +
                     threadIdx.x * 4;
      auto quad = [&](uint32_t q) -> float* {
        return &final_acc[q / (kNumAccum / 4)][(q % (kNumAccum / 4)) * 4];
      };
      bool others_done = false;
      if constexpr (kNumSplits == 2) {
        const uint32_t stored = threadIdx.x == 0 ? ld_acquire_gpu(flag) : 0;
        others_done = named_barrier_or(1, kNumMathThreads, stored == 1);
      }
      if (!others_done) {
        float* mine = slots + t.split * (BLOCK_M * BLOCK_N);
#pragma unroll
        for (uint32_t q = 0; q < kQuads; ++q) {
          const float* v = quad(q);
          st_global_v4_f32(mine + q * (4 * kNumMathThreads), v[0], v[1], v[2], v[3]);
        }
        // (every thread's stores fenced before the count says they are there)
        __threadfence();
        named_barrier_sync(1, kNumMathThreads);
        const uint32_t before = threadIdx.x == 0 ? atom_add_acq_rel_gpu(flag, 1) : 0;
        if (!named_barrier_or(1, kNumMathThreads, threadIdx.x == 0 && before + 1 == kNumSplits))
          return false;
      }
      if (threadIdx.x == 0) st_relaxed_gpu(flag, 0);  // every other part has counted itself
      __threadfence();
      // Two parts: the other's added to this one's sums. More: every part added in k order.
      auto add_part = [&](uint32_t part, bool first) {
        const float* src = slots + part * (BLOCK_M * BLOCK_N);
#pragma unroll
        for (uint32_t q = 0; q < kQuads; ++q) {
          const F32x4 v = ld_global_cg_v4_f32(src + q * (4 * kNumMathThreads));
          float* d = quad(q);
          if (first) {
            d[0] = v.x, d[1] = v.y, d[2] = v.z, d[3] = v.w;
          } else {
            d[0] += v.x, d[1] += v.y, d[2] += v.z, d[3] += v.w;
          }
        }
      };
      if constexpr (kNumSplits == 2) {
        add_part(1 - t.split, false);
      } else {
        add_part(0, true);
        // (one part at a time: loads hoisted across parts spill the sums)
#pragma unroll 1
        for (uint32_t part = 1; part < kNumSplits; ++part) add_part(part, false);
      }
      return true;
    };

    bool has_tile = scheduler.next(tile);
    bool has_prev = false;  // kTwoAccum: a computed tile whose epilogue has not run yet
    Tile prev_tile = tile, next_tile = tile;
    if (has_tile) prefetch_sb(tile);
    while (has_tile) {
      const uint32_t n0 = tile.n_block * BLOCK_N;
      sa_off = sa_shift_of<kKind>(tile);
      // Every math thread must be done reading smem_sb: without kTwoAccum the previous tile's
      // epilogue barriers see to that; with it, that epilogue comes later.
      if (kTwoAccum && has_prev) named_barrier_sync(1, kNumMathThreads);
#pragma unroll
      for (uint32_t j = 0; j < kSbPerThread; ++j) {
        const uint32_t i = threadIdx.x + j * kNumMathThreads;
        if (i < 2 * kNumKBlocks) smem_sb[i] = sb_prefetch[j];
      }
      named_barrier_sync(1, kNumMathThreads);
      FP8GEMM_STAMP(kTraceTileSynced);
      const bool has_next = scheduler.next(next_tile);
      if (has_next) prefetch_sb(next_tile);
      FP8GEMM_STAMP(kTraceTileReady);
      // 8-column groups [0, num_first) use the first block's scale, the rest the second's.
      const uint32_t num_first = (128 - n0 % 128) / 8;

      // The wgmma of a k-block (in the current stage) for wave w into acc_, committed as one group.
      auto issue = [&](float (&acc_)[kNumAccum], uint32_t w) {
        const uint64_t desc_a = desc_a0 + (stage * Layout::SMEM_A + w * WAVE_M * BLOCK_K) / 16;
        const uint64_t desc_b = desc_b0 + stage * (Layout::SMEM_B / 16);
#pragma unroll
        for (uint32_t i = 0; i < kNumAccum; ++i) fence_operand(acc_[i]);
        wgmma_fence();
        // NOTE: each k-step of 32 bytes moves the descriptor's start address by 32 >> 4 = 2.
#pragma unroll
        for (uint32_t k = 0; k < kNumKSteps; ++k)
          WgmmaFp8<BLOCK_N, kAE5M2>::mma(desc_a + 2 * k, desc_b + 2 * k, acc_, k > 0);
        wgmma_commit();
#pragma unroll
        for (uint32_t i = 0; i < kNumAccum; ++i) fence_operand(acc_[i]);
      };
      // The stage is free once this warp's last wgmma have read it: release it to every CTA
      // whose producer writes into it.
      auto release = [&](uint32_t stage_) {
        if constexpr (kNumTMAMulticast == 1) {
          if (lane == 0) mbar_arrive(&empty_bar[stage_]);
        } else {
          if (lane < kNumTMAMulticast) mbar_arrive_cluster(&empty_bar[stage_], lane);
        }
      };
      // NOTE: promotion (promote_sums): the tensor cores keep ~14 bits of the FP8 product sum,
      // so every 128 of K the partial sum moves to FP32 registers, scaled by sa * sb (rows r and
      // r + 8). The scales are read before the wgmma is waited for, off the critical path.
      auto next_stage = [&]() {
        if (++stage == kNumStages) stage = 0, phase ^= 1;
      };

      // NOTE: a math warpgroup whose 64 rows hold none of the tile's (a group's last block, rows
      // at or past masked_m) issues no wgmma and promotes nothing: it only waits for the stages
      // and releases them, in step with the other warpgroup. (BLOCK_M = 128 only: with one math
      // warpgroup a tile has rows in it, and the waves of a 256-row tile run through both.)
      // A pair's empty tile (halves == 0) idles both warpgroups, whatever the tile height.
      constexpr bool kSkipsHalves = kKind != kKindDense && kNumMathThreads == 256 && kNumWaves == 1;
      const bool idle = kSkipsHalves ? !((tile.halves >> warpgroup) & 1u) : tile.halves == 0;
      // NOTE: the idle k-loop is a branch of its own: a wgmma under a run-time condition inside
      // the unrolled k-blocks makes ptxas serialise every wgmma of the kernel (C7514).
      if ((kSkipsHalves || kPairs) && idle) {
        const uint32_t kb1 = kb_end(tile);
        for (uint32_t kb = kb_begin(tile); kb < kb1; ++kb) {
          mbar_wait(&full_bar[stage], phase);
          // (with two accumulators the previous tile's epilogue runs after the first wait, as
          // in the other warpgroup's loop below)
          if (kTwoAccum && kb == kb_begin(tile) && has_prev) epilogue(prev_tile);
          release(stage);
          next_stage();
        }
        zero_sums();
        if (kTwoAccum) prev_tile = tile, has_prev = true;
      } else if constexpr (kTwoAccum) {
        // NOTE: k-blocks alternate between acc (even offset in the chunk) and acc1; the A scales
        // are read at issue time (the producer may refill a stage once it is released).
        // ptxas serialises every wgmma (C7514) when a loop carries a group in flight across its
        // back edge, so the k-blocks run in fully unrolled chunks of kKChunk, each ending with
        // no group in flight: one bubble per chunk, which the other warpgroup's wgmma covers.
        float acc1[kNumAccum];
        float sa0[2], sa1[2], sb0[2], sb1[2];
        uint32_t held[2];  // stage of the k-block in flight in acc / acc1
        auto start = [&](float (&acc_)[kNumAccum], uint32_t slot, uint32_t kb) {
          mbar_wait(&full_bar[stage], phase);
          sa0[slot] = sa_rows[stage * Layout::kSaStage + sa_off];
          sa1[slot] = sa_rows[stage * Layout::kSaStage + sa_off + 8];
          sb0[slot] = smem_sb[kb];
          sb1[slot] = smem_sb[kNumKBlocks + kb];
          issue(acc_, 0);
          held[slot] = stage;
          next_stage();
        };
        // n is a compile-time constant at every (inlined) call, so the loop unrolls fully.
        auto chunk = [&](uint32_t n, uint32_t kb0, bool started) {
          if (!started) start(acc, 0, kb0);
#pragma unroll
          for (uint32_t j = 0; j < n; ++j) {
            float (&cur)[kNumAccum] = j % 2 == 0 ? acc : acc1;
            float (&nxt)[kNumAccum] = j % 2 == 0 ? acc1 : acc;
            if (j + 1 < n) {
              start(nxt, (j + 1) % 2, kb0 + j + 1);
              wgmma_wait<1>();
            } else {
              wgmma_wait<0>();
            }
            release(held[j % 2]);
            promote_sums<BLOCK_N, kAnySplit>(num_first, final_acc[0], cur, sa0[j % 2], sa1[j % 2],
                                             sb0[j % 2], sb1[j % 2]);
          }
        };
        // NOTE: the tile's first wgmma goes to the tensor cores before the previous tile's
        // epilogue, which then runs under it (the sums are free once the epilogue has read them).
        start(acc, 0, 0);
        if (has_prev) epilogue(prev_tile);
        zero_sums();
        constexpr uint32_t kFirst = kNumKBlocks < kKChunk ? kNumKBlocks : kKChunk;
        chunk(kFirst, 0, true);
        uint32_t kb = kFirst;
        for (; kb + kKChunk <= kNumKBlocks; kb += kKChunk) chunk(kKChunk, kb, false);
        if constexpr ((kNumKBlocks - kFirst) % kKChunk != 0)
          chunk((kNumKBlocks - kFirst) % kKChunk, kb, false);
        prev_tile = tile, has_prev = true;
      } else {
        zero_sums();
        const uint32_t kb1 = kb_end(tile);
        // NOTE: the next k-block's stage is tested (no wait) before this k-block's last
        // promotion, so that where it has landed its wgmma issues right after the promotion,
        // without the barrier's round trip between the two.
        auto kloop = [&](auto split, auto waves) {
          constexpr uint32_t kWaves = decltype(waves)::value;
          constexpr uint32_t kFirstWave = kWaves & 1u ? 0 : 1, kLastWave = kWaves & 2u ? 1 : 0;
          bool ready = false;
          for (uint32_t kb = kb_begin(tile); kb < kb1; ++kb) {
            if (!ready) mbar_wait(&full_bar[stage], phase);
            FP8GEMM_STAMP(kTraceLanded);
            const float sb0 = smem_sb[kb], sb1 = smem_sb[kNumKBlocks + kb];
#pragma unroll
            for (uint32_t w = 0; w < kNumWaves; ++w) {
              if (!((kWaves >> w) & 1u)) continue;  // (a constant once unrolled)
              const float sa0 = sa_rows[stage * Layout::kSaStage + sa_off + w * WAVE_M];
              const float sa1 = sa_rows[stage * Layout::kSaStage + sa_off + w * WAVE_M + 8];
              issue(acc, w);
              if (w == kFirstWave) FP8GEMM_STAMP(kTraceIssued);
              wgmma_wait<0>();
              if (w == kLastWave) {
                FP8GEMM_STAMP(kTraceDone);
                release(stage);
                next_stage();
                ready = kb + 1 < kb1 && mbar_test(&full_bar[stage], phase);
              }
              promote_sums<BLOCK_N, decltype(split)::value>(num_first, final_acc[w], acc, sa0, sa1,
                                                            sb0, sb1);
            }
            FP8GEMM_STAMP(kTracePromoted);
          }
        };
        // NOTE: with the split a run-time value, ptxas selects and multiplies out each 8-column
        // group's scale (about 100 instructions a k-block at BLOCK_N = 160) and places them
        // between the k-block's first and second wgmma, where they wait for the scale loads.
        // Where n0 % 128 takes at most 4 values (kSplitStep >= 32), the tile's whole k-loop is
        // instantiated per value, 4 products a k-block: on the H200, same run, 128x160 tiles
        // ran 1.07x faster than with the selects, 128x192 1.03-1.04x, 128x96 1.11x (M = 4096,
        // dense and contiguous). 8 or more instances (kSplitStep 16 or 8) keep the selects
        // (16 instances of the per-k-block variant ran 5 % slower than them at 256x136).
        // A half tile's k-loop is an instance of its own, its one wave a constant.
        auto run = [&](auto split) {
          if constexpr (kHalfTiles) {
            const uint32_t waves = waves_of(tile);
            if (waves == 1) kloop(split, Waves<1>{});
            else if (waves == 2) kloop(split, Waves<2>{});
            else kloop(split, Waves<kAllWaves>{});
          } else {
            kloop(split, Waves<kAllWaves>{});
          }
        };
        constexpr uint32_t kSplitStep = pow2_factor_128(BLOCK_N);
        if constexpr (128 % BLOCK_N == 0)
          run(Split<0>{});  // a tile never straddles two scale blocks
        else if constexpr (kSplitStep >= 32)
          with_split<kSplitStep, 0, 128 - kSplitStep>(n0 % 128, run);
        else
          run(Split<kAnySplit>{});
      }

      if constexpr (kNumSplits > 1) {
        if (split_fixup(tile)) epilogue(tile);
      } else if constexpr (!kTwoAccum) {
        FP8GEMM_STAMP(kTraceEpilogue);
        epilogue(tile);
        FP8GEMM_STAMP(kTraceEpilogueEnd);
      }
      tile = next_tile, has_tile = has_next;
    }
    if (has_prev) epilogue(prev_tile);
    if (threadIdx.x == 0) tma_store_wait_all();
  }

  // NOTE: a CTA must not exit while its cluster peer may still arrive on its barriers or write
  // into its shared memory.
  if constexpr (kNumTMAMulticast > 1) {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
  }
#else
  // Built for the wrong architecture: this kernel needs sm_90a (wgmma, setmaxnreg, TMA multicast).
  if (blockIdx.x == 0 && threadIdx.x == 0) asm volatile("trap;");
#endif
}

}  // namespace fp8gemm
