// The experiment's launches (dK/dV and dQ), one translation unit per head dim (dkdv_hd64.cu, dkdv_hd128.cu), so the
// JIT build compiles them in parallel.
#pragma once

#include <cuda_runtime.h>

#include "dkdv_kernel.cuh"
#include "dq_kernel.cuh"

namespace sagebwd_sm90 {

template <int D, class Elem, Schedule kSchedule, DvAcc kDvAcc>
void launch(const Params& p, int batch, cudaStream_t stream) {
  using C = Config<D, Elem>;
  auto kernel = dkdv_kernel<D, Elem, kSchedule, kDvAcc>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  dim3 grid(p.skv / kBlockN, p.heads, batch);
  kernel<<<grid, kThreads, C::kSmemBytes, stream>>>(p);
}

template <int D, class Elem, Schedule kSchedule>
void launch_dq(const DqParams& p, int batch, cudaStream_t stream) {
  using Q = DqConfig<D, Elem>;
  auto kernel = dq_kernel<D, Elem, kSchedule>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Q::kSmemBytes);
  dim3 grid(p.sq / (kConsumerWGs * kBlockM), p.heads, batch);
  kernel<<<grid, kThreads, Q::kSmemBytes, stream>>>(p);
}

// The built variants: per head dim and dtype the serial schedule with the shipped dV numerics; at hd64
// the overlapped one too; with dV in place (bf16 only) the hd64 overlapped and the hd128 serial one.
// dQ: serial per head dim and dtype, overlapped (bf16) at both head dims.
#define SAGEBWD_LAB_LAUNCH(D, E, S, A) template void launch<D, E, S, A>(const Params&, int, cudaStream_t)
#define SAGEBWD_LAB_HD64(PREFIX)                                                                   \
  PREFIX SAGEBWD_LAB_LAUNCH(64, cute::bfloat16_t, Schedule::kSerial, DvAcc::kScaledPerStep);       \
  PREFIX SAGEBWD_LAB_LAUNCH(64, cute::half_t, Schedule::kSerial, DvAcc::kScaledPerStep);           \
  PREFIX SAGEBWD_LAB_LAUNCH(64, cute::bfloat16_t, Schedule::kOverlap, DvAcc::kScaledPerStep);      \
  PREFIX SAGEBWD_LAB_LAUNCH(64, cute::half_t, Schedule::kOverlap, DvAcc::kScaledPerStep);          \
  PREFIX SAGEBWD_LAB_LAUNCH(64, cute::bfloat16_t, Schedule::kOverlap, DvAcc::kInPlace);                \
  PREFIX template void launch_dq<64, cute::bfloat16_t, Schedule::kSerial>(const DqParams&, int, cudaStream_t);         \
  PREFIX template void launch_dq<64, cute::bfloat16_t, Schedule::kOverlap>(const DqParams&, int, cudaStream_t);         \
  PREFIX template void launch_dq<64, cute::half_t, Schedule::kSerial>(const DqParams&, int, cudaStream_t)
#define SAGEBWD_LAB_HD128(PREFIX)                                                                  \
  PREFIX SAGEBWD_LAB_LAUNCH(128, cute::bfloat16_t, Schedule::kSerial, DvAcc::kScaledPerStep);      \
  PREFIX SAGEBWD_LAB_LAUNCH(128, cute::half_t, Schedule::kSerial, DvAcc::kScaledPerStep);          \
  PREFIX SAGEBWD_LAB_LAUNCH(128, cute::bfloat16_t, Schedule::kSerial, DvAcc::kInPlace);               \
  PREFIX template void launch_dq<128, cute::bfloat16_t, Schedule::kSerial>(const DqParams&, int, cudaStream_t);         \
  PREFIX template void launch_dq<128, cute::bfloat16_t, Schedule::kOverlap>(const DqParams&, int, cudaStream_t);        \
  PREFIX template void launch_dq<128, cute::half_t, Schedule::kSerial>(const DqParams&, int, cudaStream_t)
SAGEBWD_LAB_HD64(extern);
SAGEBWD_LAB_HD128(extern);

}  // namespace sagebwd_sm90
