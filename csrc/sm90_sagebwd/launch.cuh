// The backward kernels' launches and the shipped schedule per head dim and dtype. One translation
// unit per head dim (hd64.cu, hd128.cu) instantiates them, so the JIT build compiles both in parallel.
#pragma once

#include <type_traits>

#include <cuda_runtime.h>

#include "../common/launch.cuh"
#include "dkdv_kernel.cuh"
#include "dq_kernel.cuh"

namespace sagebwd_sm90 {

// The shipped schedules (eval/results/sagebwd_cuda_dkdv_h100.md, H100, 16K tokens).
template <int D, class Elem>
struct ShippedPolicy {
  // hd64: a step's dV and dK stay in flight under the next step's softmax gradient (19.7 against
  // 20.1 ms serial); at hd128 two products' int32 results do not fit the registers.
  static constexpr Schedule kDkdv = D == 64 ? Schedule::kOverlap : Schedule::kSerial;
  // The next key block's S / dP run under a step's dQ scale-add (9.6 against 11.0 ms at hd128);
  // built and checked on the GPU for bf16 only, so fp16 keeps the serial schedule.
  static constexpr Schedule kDq = std::is_same_v<Elem, cute::bfloat16_t> ? Schedule::kOverlap : Schedule::kSerial;
  // dV in place (dO' quantized per channel over all queries, dV's int32 sums kept in the wgmma
  // accumulator: 11.8 against 15.2 ms at hd128, 17.5 against 19.7 at hd64) where the caller allows
  // it: not causal (per-channel scales starve causal attention's later rows), Sq <=
  // kDvInPlaceMaxQueries; built and checked on the GPU for bf16, so fp16 scales dV per query block.
  static constexpr bool kDvInPlace = std::is_same_v<Elem, cute::bfloat16_t>;
};

template <int D, class Elem, Schedule kSchedule, DvAcc kDvAcc, DkAcc kDkAcc = DkAcc::kInt8PerStep>
cudaError_t launch_dkdv(const Params& p, int batch, cudaStream_t stream) {
  dim3 grid(p.skv / kBlockN, p.heads, batch);
  return sage_common::launch_with_smem(dkdv_kernel<D, Elem, kSchedule, kDvAcc, kDkAcc>, grid, kThreads,
                                       Config<D, Elem>::kSmemBytes, p, stream);
}

template <int D, class Elem, Schedule kSchedule, DqAcc kDqAcc = DqAcc::kInt8PerStep>
cudaError_t launch_dq(const DqParams& p, int batch, cudaStream_t stream) {
  dim3 grid(p.sq / (kConsumerWGs * kBlockM), p.heads, batch);
  return sage_common::launch_with_smem(dq_kernel<D, Elem, kSchedule, kDqAcc>, grid, kThreads,
                                       DqConfig<D, Elem, kDqAcc>::kSmemBytes, p, stream);
}

// The shipped policy's two kernels at one head dim and dtype; dv_in_place where the policy builds it.
template <int D, class Elem>
cudaError_t launch_shipped_dkdv(const Params& p, int batch, bool dv_in_place, cudaStream_t stream) {
  using P = ShippedPolicy<D, Elem>;
  if constexpr (P::kDvInPlace) {
    if (dv_in_place) return launch_dkdv<D, Elem, P::kDkdv, DvAcc::kInPlace>(p, batch, stream);
  }
  if (dv_in_place) return cudaErrorInvalidValue;
  return launch_dkdv<D, Elem, P::kDkdv, DvAcc::kScaledPerStep>(p, batch, stream);
}

template <int D, class Elem>
cudaError_t launch_shipped_dq(const DqParams& p, int batch, cudaStream_t stream) {
  return launch_dq<D, Elem, ShippedPolicy<D, Elem>::kDq>(p, batch, stream);
}

#define SAGEBWD_SM90_SHIPPED(PREFIX, D)                                                                         \
  PREFIX template cudaError_t launch_shipped_dkdv<D, cute::bfloat16_t>(const Params&, int, bool, cudaStream_t); \
  PREFIX template cudaError_t launch_shipped_dkdv<D, cute::half_t>(const Params&, int, bool, cudaStream_t);     \
  PREFIX template cudaError_t launch_shipped_dq<D, cute::bfloat16_t>(const DqParams&, int, cudaStream_t);      \
  PREFIX template cudaError_t launch_shipped_dq<D, cute::half_t>(const DqParams&, int, cudaStream_t)
SAGEBWD_SM90_SHIPPED(extern, 64);
SAGEBWD_SM90_SHIPPED(extern, 128);

}  // namespace sagebwd_sm90
