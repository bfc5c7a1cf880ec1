// setmaxnreg split between one producer warpgroup and the consumer warpgroups of a warp-
// specialized kernel: every thread launches with 65536 / threads registers; the producer gives
// part of its share back and the consumers take it. The register file is handed out per
// warpgroup, so the budget is counted in warpgroups of 128 threads.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

namespace sage_common::sm90 {

template <int kProducerRegs_, int kConsumerRegs_, int kConsumerWarpgroups = 2>
struct RegisterSplit {
  static constexpr int kProducerRegs = kProducerRegs_;
  static constexpr int kConsumerRegs = kConsumerRegs_;
  static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0, "setmaxnreg takes multiples of 8");
  static_assert(kProducerRegs >= 24 && kConsumerRegs <= 256, "setmaxnreg range is 24 .. 256");
  static_assert(128 * (kProducerRegs + kConsumerWarpgroups * kConsumerRegs) <= 65536,
                "the split must fit the 64K-register file of one SM (one CTA per SM)");
  __device__ __forceinline__ static void producer() { cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>(); }
  __device__ __forceinline__ static void consumer() { cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>(); }
};

}  // namespace sage_common::sm90
