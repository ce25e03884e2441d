// Host stand-ins for the device functions that sm90_scheduler.cuh uses, so that the schedulers'
// walks run on the CPU (tests/test_cuda_scheduler.py copies the real header beside this one).
// A warp is 32 std::threads, one per lane; warp collectives meet at a barrier. Every global read
// (__ldg) and L1 prefetch is checked against the one array the scheduler may touch.
#pragma once

#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define __device__
#define __host__
#define __forceinline__ inline

struct SimDim3 {
  uint32_t x = 0, y = 1, z = 1;
};
inline thread_local SimDim3 blockIdx;
inline SimDim3 gridDim;
inline thread_local uint32_t sim_lane = 0;
inline thread_local uint32_t sim_cluster_rank = 0;

// The array the scheduler reads (the grouped layout or ks); [sim_array, sim_array + sim_len).
inline const int32_t* sim_array = nullptr;
inline size_t sim_len = 0;

[[noreturn]] inline void sim_fail(const char* what, const void* p) {
  const long off = sim_array ? static_cast<long>(static_cast<const int32_t*>(p) - sim_array) : -1;
  std::fprintf(stderr, "%s outside the array: element %ld of %zu (CTA %u, lane %u)\n", what, off,
               sim_len, blockIdx.x, sim_lane);
  std::fflush(stderr);
  std::_Exit(3);
}

inline bool sim_in_array(const void* p) {
  const int32_t* q = static_cast<const int32_t*>(p);
  return sim_array != nullptr && q >= sim_array && q < sim_array + sim_len;
}

namespace fp8gemm {

template <typename T>
constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }

inline uint32_t lane_idx() { return sim_lane; }
inline uint32_t cluster_cta_rank() { return sim_cluster_rank; }

inline void prefetch_l1(const void* p) {
  if (!sim_in_array(p)) sim_fail("prefetch_l1", p);
}

// The 32 lanes of the simulated warp.
struct SimWarp {
  std::barrier<> bar{32};
  int64_t vals[32];
};
inline SimWarp* sim_warp = nullptr;

template <typename F>
inline int64_t sim_collective(int64_t v, F combine) {
  SimWarp& w = *sim_warp;
  w.vals[sim_lane] = v;
  w.bar.arrive_and_wait();
  int64_t r = w.vals[0];
  for (int i = 1; i < 32; ++i) r = combine(r, w.vals[i]);
  w.bar.arrive_and_wait();
  return r;
}

inline int32_t warp_min_s32(int32_t v) {
  const auto lower = [](int64_t a, int64_t b) { return a < b ? a : b; };
  return static_cast<int32_t>(sim_collective(v, lower));
}

inline int32_t warp_max_s32(int32_t v) {
  const auto higher = [](int64_t a, int64_t b) { return a > b ? a : b; };
  return static_cast<int32_t>(sim_collective(v, higher));
}

}  // namespace fp8gemm

inline int32_t __ldg(const int32_t* p) {
  if (!sim_in_array(p)) sim_fail("__ldg", p);
  return *p;
}

inline bool __any_sync(uint32_t, bool pred) {
  return fp8gemm::sim_collective(pred ? 1 : 0, [](int64_t a, int64_t b) { return a | b; }) != 0;
}

inline uint32_t __ballot_sync(uint32_t, bool pred) {
  const int64_t bit = pred ? (int64_t{1} << sim_lane) : 0;
  return static_cast<uint32_t>(
      fp8gemm::sim_collective(bit, [](int64_t a, int64_t b) { return a | b; }));
}
