// Programmatic dependent launch (PDL, sm_90+): a kernel launched with programmatic stream
// serialization may start while the kernel before it on the stream is still running; it must call
// pdl_wait() before its first read of that kernel's results (griddepcontrol.wait blocks until the
// primary grid has completed and its memory is visible). A primary kernel may call
// pdl_launch_dependents() to let the dependent grid be scheduled before it exits (else that happens
// as each of its blocks exits). Both instructions are no-ops in a kernel launched without the
// attribute, so one kernel serves both launch kinds.
#pragma once

namespace sage_common::sm90 {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace sage_common::sm90
