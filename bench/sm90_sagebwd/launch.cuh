// The experiment's launches, one translation unit per head dim (dkdv_hd64.cu, dkdv_hd128.cu), so the
// JIT build compiles them in parallel.
#pragma once

#include <cuda_runtime.h>

#include "dkdv_kernel.cuh"

namespace sagebwd_sm90 {

template <int D, class Elem, Schedule kSchedule>
void launch(const Params& p, int batch, cudaStream_t stream) {
  using C = Config<D, Elem>;
  auto kernel = dkdv_kernel<D, Elem, kSchedule>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  dim3 grid(p.skv / kBlockN, p.heads, batch);
  kernel<<<grid, kThreads, C::kSmemBytes, stream>>>(p);
}

#define SAGEBWD_LAB_LAUNCH(D, E, S) template void launch<D, E, S>(const Params&, int, cudaStream_t)
extern SAGEBWD_LAB_LAUNCH(64, cute::bfloat16_t, Schedule::kSerial);
extern SAGEBWD_LAB_LAUNCH(64, cute::half_t, Schedule::kSerial);
extern SAGEBWD_LAB_LAUNCH(64, cute::bfloat16_t, Schedule::kOverlap);
extern SAGEBWD_LAB_LAUNCH(64, cute::half_t, Schedule::kOverlap);
extern SAGEBWD_LAB_LAUNCH(128, cute::bfloat16_t, Schedule::kSerial);
extern SAGEBWD_LAB_LAUNCH(128, cute::half_t, Schedule::kSerial);

}  // namespace sagebwd_sm90
