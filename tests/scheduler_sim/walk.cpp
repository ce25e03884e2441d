// Runs the CUDA kernels' tile schedulers (sm90_scheduler.cuh) on the CPU and prints every CTA's
// tiles, for tests/test_cuda_scheduler.py. configs.inc (written by the test) lists the template
// instances as SCHED(id, kind, BLOCK_M, kNumNBlocks, kBandSize, kBandAlongM, kNumSplits, kPairs)
// and WALK1D1D(id, kKGrouped, BLOCK_M, kNumNBlocks, kBandSize).
//
// stdin: config id, grid, shape_m, shape_k, num_groups, the array's length L, then its L values
// (the grouped layout, or ks). stdout: per tile, "cta m0 sa_m n_block group rows full b_once
// halves split last" (TileScheduler; last: multicast with pairs, part_tile with split-K, else 0)
// or "cta m0 n_block group kb0 num_kb" (Scheduler1d1d).
// One simulated warp (32 threads) walks every CTA's tiles in turn; the lanes must agree on each.
#include <cstdio>
#include <thread>
#include <vector>

#include "sm90_scheduler.cuh"

using namespace fp8gemm;

struct Args {
  uint32_t grid, shape_m, shape_k, num_groups;
  std::vector<int32_t> array;
};

// Runs walk(blockIdx, tiles) for every CTA of the grid on the 32 lane threads of one simulated
// warp (the CTAs one after another); returns each CTA's tiles after checking that every lane saw
// the same ones.
template <typename Row, typename Walk>
std::vector<std::vector<Row>> run_grid(uint32_t grid, uint32_t cluster, Walk walk) {
  SimWarp warp;
  sim_warp = &warp;
  std::vector<std::vector<std::vector<Row>>> rows(32, std::vector<std::vector<Row>>(grid));
  std::vector<std::thread> lanes;
  for (uint32_t lane = 0; lane < 32; ++lane) {
    lanes.emplace_back([&, lane] {
      sim_lane = lane;
      for (uint32_t cta = 0; cta < grid; ++cta) {
        blockIdx.x = cta;
        sim_cluster_rank = cta % cluster;
        walk(rows[lane][cta]);
      }
      warp.bar.arrive_and_drop();
    });
  }
  for (auto& t : lanes) t.join();
  for (uint32_t lane = 1; lane < 32; ++lane) {
    for (uint32_t cta = 0; cta < grid; ++cta) {
      if (rows[lane][cta] != rows[0][cta]) {
        std::fprintf(stderr, "CTA %u: lane %u's tiles differ from lane 0's\n", cta, lane);
        std::_Exit(4);
      }
    }
  }
  return rows[0];
}

template <typename Row>
void print_tiles(const std::vector<std::vector<Row>>& tiles) {
  for (size_t cta = 0; cta < tiles.size(); ++cta) {
    for (const Row& r : tiles[cta]) {
      std::printf("%zu", cta);
      for (long v : r) std::printf(" %ld", v);
      std::printf("\n");
    }
  }
}

template <uint32_t kKind, uint32_t BLOCK_M, uint32_t kNumNBlocks, uint32_t kBandSize,
          bool kBandAlongM, uint32_t kNumSplits, bool kPairs>
void walk_tiles(const Args& a) {
  using Row = std::vector<long>;
  print_tiles(run_grid<Row>(a.grid, kPairs ? 2 : 1, [&](std::vector<Row>& out) {
    TileScheduler<kKind, BLOCK_M, kNumNBlocks, kBandSize, kBandAlongM, kNumSplits, kPairs> s(
        a.shape_m, a.array.empty() ? nullptr : a.array.data(), a.num_groups);
    Tile t{};
    while (s.next(t)) {
      out.push_back({t.m0, t.sa_m, t.n_block, t.group, t.rows, t.full, t.b_once, t.halves,
                     kNumSplits > 1 ? t.split : 0,
                     kPairs ? t.multicast : (kNumSplits > 1 ? t.part_tile : 0)});
      t = Tile{};
      if (out.size() > 1000000) break;  // (a walk that does not end)
    }
  }));
}

template <bool kKGrouped, uint32_t BLOCK_M, uint32_t kNumNBlocks, uint32_t kBandSize>
void walk_1d1d(const Args& a) {
  using Row = std::vector<long>;
  print_tiles(run_grid<Row>(a.grid, 1, [&](std::vector<Row>& out) {
    Scheduler1d1d<kKGrouped, BLOCK_M, kNumNBlocks, kBandSize> s(
        a.shape_m, a.shape_k, a.array.empty() ? nullptr : a.array.data(), a.num_groups);
    Tile1d1d t{};
    while (s.next(t)) {
      out.push_back({t.m0, t.n_block, t.group, t.kb0, t.num_kb});
      t = Tile1d1d{};
      if (out.size() > 1000000) break;
    }
  }));
}

int main() {
  int id;
  Args a;
  size_t len;
  if (std::scanf("%d %u %u %u %u %zu", &id, &a.grid, &a.shape_m, &a.shape_k, &a.num_groups,
                 &len) != 6) {
    std::fprintf(stderr, "bad input\n");
    return 2;
  }
  a.array.resize(len);
  for (auto& v : a.array) {
    if (std::scanf("%d", &v) != 1) {
      std::fprintf(stderr, "bad input\n");
      return 2;
    }
  }
  sim_array = a.array.empty() ? nullptr : a.array.data();
  sim_len = a.array.size();
  gridDim.x = a.grid;
  switch (id) {
#define SCHED(ID, KIND, BM, NB, BAND, ALONG_M, SPLITS, PAIRS) \
  case ID:                                                    \
    walk_tiles<KIND, BM, NB, BAND, ALONG_M, SPLITS, PAIRS>(a); \
    return 0;
#define WALK1D1D(ID, KGROUPED, BM, NB, BAND) \
  case ID:                                   \
    walk_1d1d<KGROUPED, BM, NB, BAND>(a);    \
    return 0;
#include "configs.inc"
    default:
      std::fprintf(stderr, "unknown config %d\n", id);
      return 2;
  }
}
