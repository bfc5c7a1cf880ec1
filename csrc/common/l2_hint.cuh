// L2 eviction-priority hints for global loads (sm_80+: createpolicy + ld.global.L2::cache_hint).
// A pass that reads a tensor now and again soon (the pre-passes' stats launch, then their quant
// launch) marks the first read evict_last and the last read evict_first, so the second read can
// hit L2 and single-use traffic in between does not push those lines out. Hints change no value:
// the loaded bits are those of a plain load.
#pragma once

#include <cstdint>

namespace sage_common {

enum class L2Hint : int {
  kNormal = 0,      // a plain load (no policy)
  kEvictLast = 1,   // read again soon: keep in L2 ahead of normal lines
  kEvictFirst = 2,  // last (or only) use: evicted first
};

// The 64-bit cache policy of a hint (for all of each access: fraction 1.0).
template <L2Hint kHint>
__device__ __forceinline__ uint64_t l2_policy() {
  static_assert(kHint != L2Hint::kNormal, "a normal load needs no policy");
  uint64_t policy;
  if constexpr (kHint == L2Hint::kEvictLast) {
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  } else {
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  }
  return policy;
}

// 16 read-only bytes (a 16-byte aligned address) through the non-coherent path, as __ldg, with
// the hint's L2 policy. Not volatile (as __ldg): the compiler may batch and hoist these loads and
// share one policy register between them.
template <L2Hint kHint>
__device__ __forceinline__ uint4 ldg16(const void* ptr) {
  if constexpr (kHint == L2Hint::kNormal) {
    return __ldg(reinterpret_cast<const uint4*>(ptr));
  } else {
    uint4 r;
    asm("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(ptr), "l"(l2_policy<kHint>()));
    return r;
  }
}

}  // namespace sage_common
