// sm_90a building blocks: mbarriers, TMA copies, wgmma control and descriptors, cluster helpers.
// Self-contained (no CUDA headers) so that NVRTC compiles a kernel in well under a second.
#pragma once

namespace fp8gemm {

// NOTE: NVRTC has no <cstdint> without the toolkit headers; keep our own names in our namespace.
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef int int32_t;

// A TMA descriptor as the driver encodes it (CUtensorMap: 128 bytes, 64-byte aligned). Passed by
// value as a __grid_constant__ kernel parameter and only ever addressed, never read.
struct alignas(64) TmaDescriptor {
  uint64_t opaque[16];
};

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ uint32_t lane_idx() {
  uint32_t lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

// Warp-wide minimum / maximum (every lane of the warp calls it).
__device__ __forceinline__ int32_t warp_min_s32(int32_t v) {
  int32_t r;
  asm volatile("redux.sync.min.s32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
  return r;
}

__device__ __forceinline__ int32_t warp_max_s32(int32_t v) {
  int32_t r;
  asm volatile("redux.sync.max.s32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
  return r;
}

// --- mbarriers -------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

// Spin until the phase with parity `phase` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(smem_addr(bar)),
      "r"(phase)
      : "memory");
}

// Whether the phase with parity `phase` has completed, without waiting.
__device__ __forceinline__ bool mbar_test(uint64_t* bar, uint32_t phase) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(phase)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Arrive on the barrier at the same shared-memory offset in CTA `cta` of this cluster.
// NOTE: default (CTA-scope) semantics on purpose: `.release.cluster` makes ptxas put a
// MEMBAR.ALL.GPU before every arrive. Releasing a stage needs no fence: wgmma.wait_group has
// already completed this warp's reads of it.
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(smem_addr(bar)),
      "r"(cta)
      : "memory");
}

// Arrive on the barrier at the same offset in CTA `cta`, at cluster scope without ordering
// this thread's memory operations: after `fence_acq_rel_cluster` (one fence for several
// arrivals), a release of what the thread, and what a CTA barrier ordered before the fence, wrote.
__device__ __forceinline__ void mbar_arrive_cluster_relaxed(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(smem_addr(bar)),
      "r"(cta)
      : "memory");
}

__device__ __forceinline__ void fence_acq_rel_cluster() {
  asm volatile("fence.acq_rel.cluster;" ::: "memory");
}

// mbar_wait, acquiring at cluster scope what the arrivals of other CTAs released.
__device__ __forceinline__ void mbar_wait_cluster(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_CLUSTER:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_CLUSTER;\n}\n" ::"r"(smem_addr(bar)),
      "r"(phase)
      : "memory");
}

__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The mbarriers of a ring of `num_stages` stages, set up by one thread: full_bar[s] completes on
// the producer's one arrival and the TMA bytes it expects, empty_bar[s] on `consumer_arrivals`
// arrivals; the initialisation is then released to the cluster.
__device__ __forceinline__ void init_stage_ring(uint64_t* full_bar, uint64_t* empty_bar,
                                                uint32_t num_stages, uint32_t consumer_arrivals) {
  for (uint32_t s = 0; s < num_stages; ++s) {
    mbar_init(&full_bar[s], 1);
    mbar_init(&empty_bar[s], consumer_arrivals);
  }
  fence_barrier_init();
}

// --- clusters --------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
}

// Every thread of every CTA of the cluster: arrive (releasing this thread's prior memory
// operations at cluster scope), then wait until all have arrived (acquiring theirs). Not
// `.aligned`, so that warps which diverged (one producer thread issuing loads) may take part.
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release;" ::: "memory");
}

// Arrive without ordering this thread's prior memory operations (nothing it wrote is read
// after the barrier); ptxas puts a MEMBAR.ALL.GPU before each `.release` arrive.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
}

__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
}

// --- distributed shared memory -------------------------------------------------------------------
// The shared::cluster address of the same offset as `addr` (a shared::cta address) in CTA `cta`.
__device__ __forceinline__ uint32_t mapa_shared(uint32_t addr, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(cta));
  return remote;
}

struct F32x4 {
  float x, y, z, w;
};

__device__ __forceinline__ F32x4 ld_shared_cluster_v4(uint32_t addr) {
  F32x4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// --- named barriers (id 0 is __syncthreads) ---------------------------------------------------
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

// A named barrier that also ORs `pred` over the num_threads threads that reach it.
__device__ __forceinline__ bool named_barrier_or(uint32_t id, uint32_t num_threads, bool pred) {
  uint32_t r;
  asm volatile(
      "{\n.reg .pred p, q;\n"
      "setp.ne.u32 p, %1, 0;\n"
      "bar.red.or.pred q, %2, %3, p;\n"
      "selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(r)
      : "r"(static_cast<uint32_t>(pred)), "r"(id), "r"(num_threads)
      : "memory");
  return r != 0;
}

// --- counters in global memory, between the CTAs of one grid -------------------------------------
__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* ptr) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t atom_add_acq_rel_gpu(uint32_t* ptr, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(ptr), "r"(v)
               : "memory");
  return old;
}

__device__ __forceinline__ void st_relaxed_gpu(uint32_t* ptr, uint32_t v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// --- TMA ---------------------------------------------------------------------------------------
__device__ __forceinline__ void tma_prefetch_descriptor(const TmaDescriptor* desc) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(desc)) : "memory");
}

// Bring the 128-byte line holding `p` into this SM's L1 without waiting: no register receives
// it, so nothing stalls on it; a later ld.global.nc of the line hits L1.
__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(reinterpret_cast<uint64_t>(p)));
}

// Bring `bytes` of global memory at `src` into L2 without waiting (both multiples of 16).
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(reinterpret_cast<uint64_t>(src)),
               "r"(bytes) : "memory");
}

// Bring the box at (c0, c1) of a 2-D tensor map into L2 without waiting (no shared memory, no
// barrier).
__device__ __forceinline__ void tma_prefetch_l2_2d(const TmaDescriptor* desc, int32_t c0,
                                                   int32_t c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];"
               ::"l"(reinterpret_cast<uint64_t>(desc)), "r"(c0), "r"(c1) : "memory");
}

// k-blocks of a decode GEMM's first tile whose B boxes go to L2 before the PDL dependency wait.
constexpr uint32_t kPrefetchKBlocks = 2;

// The B boxes (rows from n0, BLOCK_K wide) of the first kPrefetchKBlocks k-blocks of
// [kb_begin, kb_end) sent to L2, before griddepcontrol.wait: launched while the kernel before it
// still runs (PDL), a GEMM starts streaming B (the weights, nearly all the bytes at decode) from
// HBM meanwhile, and its first TMA loads hit L2. Two k-blocks, not a ring's worth: the
// prefetches queue ahead of the ring's own loads in the memory system, and a ring's worth cost a
// lone decode GEMM 3-7 % and a PDL chain link 1-14 % on the H200.
template <uint32_t BLOCK_K>
__device__ __forceinline__ void prefetch_first_b_l2(const TmaDescriptor* tmap_b, uint32_t kb_begin,
                                                    uint32_t kb_end, int32_t n0) {
#pragma unroll
  for (uint32_t kb = kb_begin; kb < kb_begin + kPrefetchKBlocks; ++kb)
    if (kb < kb_end) tma_prefetch_l2_2d(tmap_b, static_cast<int32_t>(kb * BLOCK_K), n0);
}

// Programmatic dependent launch (the host's FP8GEMM_PDL): a kernel launched with programmatic
// stream serialization may start while the kernel before it in the stream still runs, once
// every CTA of that kernel has called grid_launch_dependents (or exited).
// grid_dependency_wait returns when the grids this one depends on have completed and their
// memory operations are visible; without such a launch it returns at once. Every global
// access that may touch what an earlier kernel writes (A, scales, layouts, out) comes after
// it; before it, only the prologue and L2 prefetches (L2 is the GPU's point of coherence, so
// a prefetched line never shadows a later write).
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// Lets the next kernel in the stream (launched with programmatic serialization) start: its CTAs
// take SMs as this grid's CTAs exit and run their prologue before their own wait, which still
// waits for this whole grid.
__device__ __forceinline__ void grid_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ void tma_load_2d(void* dst, const TmaDescriptor* desc, uint64_t* bar,
                                            int32_t c0, int32_t c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(void* dst, const TmaDescriptor* desc, uint64_t* bar,
                                            int32_t c0, int32_t c1, int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// An L2 policy for the lines a load allocates: evict_first lines are the first to go when the
// cache needs room. For bytes read once (a decode GEMM's B), each new line then replaces one of
// them, not a line another kernel will read or a dirty line that must first be written to HBM.
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// tma_load_2d with an L2 cache policy (l2_policy_evict_first) for the lines it allocates.
__device__ __forceinline__ void tma_load_2d_hint(void* dst, const TmaDescriptor* desc, uint64_t* bar,
                                                 int32_t c0, int32_t c1, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "l"(policy)
      : "memory");
}

// One load written to the same offset in every CTA of `cta_mask`; each CTA's barrier at `bar`'s
// offset receives the bytes.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const TmaDescriptor* desc,
                                                      uint64_t* bar, int32_t c0, int32_t c1,
                                                      uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

__device__ __forceinline__ void tma_store_2d(const TmaDescriptor* desc, const void* src, int32_t c0,
                                             int32_t c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(desc)),
               "r"(smem_addr(src)), "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void tma_store_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Wait until no committed store still reads shared memory.
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

__device__ __forceinline__ void tma_store_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// NOTE: generic-proxy writes to shared memory (st.shared) must be fenced before the async proxy
// (TMA store, wgmma) reads them.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// --- register reallocation ---------------------------------------------------------------------
template <uint32_t kRegs>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

template <uint32_t kRegs>
__device__ __forceinline__ void warpgroup_reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// --- wgmma control -------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keep the compiler from moving accumulator reads/writes across wgmma issue and wait.
__device__ __forceinline__ void fence_operand(float& reg) {
  asm volatile("" : "+f"(reg)::"memory");
}

// The wgmma k-steps [kFirstStep, kFirstStep + kNumSteps) of one 128-deep k-block into acc
// through Mma (a WgmmaFp8 instance), one commit group, the first step starting a fresh sum; each
// k-step of 32 bytes moves the K-major descriptors' start address by 32 >> 4 = 2.
template <typename Mma, uint32_t kFirstStep, uint32_t kNumSteps, uint32_t kNumAccum>
__device__ __forceinline__ void wgmma_k_steps(float (&acc)[kNumAccum], uint64_t desc_a,
                                              uint64_t desc_b) {
#pragma unroll
  for (uint32_t i = 0; i < kNumAccum; ++i) fence_operand(acc[i]);
  wgmma_fence();
#pragma unroll
  for (uint32_t k = kFirstStep; k < kFirstStep + kNumSteps; ++k)
    Mma::mma(desc_a + 2 * k, desc_b + 2 * k, acc, k > kFirstStep);
  wgmma_commit();
#pragma unroll
  for (uint32_t i = 0; i < kNumAccum; ++i) fence_operand(acc[i]);
}

// Shared-memory matrix descriptor for a K-major tile stored as 128-byte rows with the 128-byte
// swizzle (what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and a 128-byte inner box).
// NOTE: bits 0-13 start address >> 4, 16-29 leading byte offset >> 4 (unused for swizzled K-major),
// 32-45 stride byte offset >> 4 (1024: one 8-row swizzle atom), 62-63 layout (1 = 128B swizzle).
// The tile base must be 1024-byte aligned so that the base-offset field stays 0.
__device__ __forceinline__ uint64_t make_smem_desc_sw128(const void* ptr) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_addr(ptr) & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>(1) << 16;
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;
  desc |= static_cast<uint64_t>(1) << 62;
  return desc;
}

// Two floats to packed bf16x2, round to nearest even: lo goes to the lower address.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
  return packed;
}

__device__ __forceinline__ void st_shared_u32(void* ptr, uint32_t value) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(smem_addr(ptr)), "r"(value) : "memory");
}

// Four 8x8 bf16 matrices to shared memory (stmatrix .x4): lane l gives the shared-memory address
// of row l % 8 of matrix l / 8; register j of each lane holds two columns of matrix j in the mma
// fragment layout (row lane / 4, columns 2 * (lane % 4) and + 1), as the wgmma accumulators are.
__device__ __forceinline__ void stmatrix_x4(uint32_t row_addr, uint32_t m0, uint32_t m1,
                                            uint32_t m2, uint32_t m3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(row_addr),
               "r"(m0), "r"(m1), "r"(m2), "r"(m3)
               : "memory");
}

struct U32x4 {
  uint32_t x, y, z, w;
};

__device__ __forceinline__ F32x4 ld_shared_v4f(const void* ptr) {
  F32x4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(smem_addr(ptr)));
  return v;
}

__device__ __forceinline__ U32x4 ld_shared_v4(const void* ptr) {
  U32x4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem_addr(ptr)));
  return v;
}

__device__ __forceinline__ void st_global_v4_f32(float* ptr, float a, float b, float c, float d) {
  asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "f"(a), "f"(b), "f"(c),
               "f"(d)
               : "memory");
}

// A load from L2, past L1: data another CTA of the grid wrote during this kernel.
__device__ __forceinline__ F32x4 ld_global_cg_v4_f32(const float* ptr) {
  F32x4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(ptr)
               : "memory");
  return v;
}

__device__ __forceinline__ void st_global_v4(void* ptr, U32x4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

}  // namespace fp8gemm
