// Named barriers (bar.sync / bar.arrive with an id and a thread count) and the inter-warpgroup
// ping-pong schedule built on them (FA3's: while one consumer warpgroup's wgmmas occupy the
// tensor cores, the other runs its softmax). Barrier 0 is __syncthreads; each kernel owns the
// numbering of the others (its ids are named constants next to its kernel).
#pragma once

namespace sage_common::sm90 {

// kThreads: threads taking part (a multiple of 32), a compile-time constant in every use.
template <int kThreads>
__device__ __forceinline__ void named_barrier_sync(int id) {
  static_assert(kThreads % 32 == 0, "named barriers count whole warps");
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(kThreads) : "memory");
}
template <int kThreads>
__device__ __forceinline__ void named_barrier_arrive(int id) {
  static_assert(kThreads % 32 == 0, "named barriers count whole warps");
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(kThreads) : "memory");
}

// Two consumer warpgroups take turns issuing their wgmma groups. Barrier kFirstBarrier + w means
// "warpgroup w may issue". Each issue block is bracketed by begin() (wait for the own turn) and
// end() (hand the turn to the other warpgroup). start() lets warpgroup 0 go first; warpgroup 1
// skips its last hand-over, so both barriers see matching sync / arrive counts (n_blocks + 1 each
// for n_blocks issue blocks per warpgroup). kEnabled = false compiles every call away.
template <bool kEnabled, int kFirstBarrier, int kConsumerThreads = 256>
struct WarpgroupPingPong {
  static_assert(kConsumerThreads == 256, "two consumer warpgroups");
  static_assert(kFirstBarrier >= 1, "barrier 0 is __syncthreads");
  static constexpr bool kOn = kEnabled;
  int wg;  // this thread's consumer warpgroup, 0 or 1

  __device__ __forceinline__ void start() const {
    if constexpr (kEnabled) {
      if (wg == 1) named_barrier_arrive<kConsumerThreads>(kFirstBarrier);
    }
  }
  __device__ __forceinline__ void begin() const {
    if constexpr (kEnabled) named_barrier_sync<kConsumerThreads>(kFirstBarrier + wg);
  }
  __device__ __forceinline__ void end(bool last) const {
    if constexpr (kEnabled) {
      if (!(last && wg == 1)) named_barrier_arrive<kConsumerThreads>(kFirstBarrier + (wg ^ 1));
    }
  }
};

}  // namespace sage_common::sm90
