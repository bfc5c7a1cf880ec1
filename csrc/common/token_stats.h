// Host side of the pre-passes' K mean / V absmax reduction (token_stats.cuh): its block size and
// how the keys are cut into chunks. Plain C++, so the torch bindings include it too.
#pragma once

#include <algorithm>
#include <cstdint>

namespace sage_common {

constexpr int kStatsThreads = 256;             // threads per stats block
constexpr int64_t kStatsTargetBlocks = 4 * 132;  // ~4 waves of H100/H200 SMs for the reduction

// Token chunks of the reduction: enough blocks to fill the GPU, at least 256 tokens each.
struct StatsSplit {
  int64_t n_split;    // chunks per (b, kv head): the grid is B * Hkv * n_split blocks
  int64_t split_len;  // tokens per chunk (the last may be shorter)
};
inline StatsSplit stats_split(int64_t bh, int64_t skv) {
  int64_t n_split = std::max<int64_t>(1, (kStatsTargetBlocks + bh - 1) / bh);
  n_split = std::min<int64_t>(n_split, (skv + 255) / 256);
  n_split = std::max<int64_t>(n_split, 1);
  const int64_t split_len = (skv + n_split - 1) / n_split;
  return {(skv + split_len - 1) / split_len, split_len};
}

}  // namespace sage_common
