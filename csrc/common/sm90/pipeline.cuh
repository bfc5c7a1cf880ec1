// Bulk-copy rings: an mbarrier with transaction bytes per stage ("full": the producer's
// arrive.expect_tx plus the bytes its cp.async.bulk copies land) and a plain one ("empty": the
// consumers release the stage). The n-th use (0-based) of stage s of a kStages ring is item
// t = n * kStages + s; consumers wait full[s] with parity n & 1, the producer waits empty[s] with
// parity (n - 1) & 1 before use n >= 1.
#pragma once

#include <cstdint>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

namespace sage_common::sm90 {

using TxBarrier = cutlass::arch::ClusterTransactionBarrier;  // mbarrier (+ transaction bytes)

// One elected thread: copy `bytes` (a multiple of 16, 16-byte aligned ends) from global memory
// into shared memory, counted on `full` (which must expect them).
__device__ __forceinline__ void bulk_copy_g2s(const void* src, uint64_t* full, void* dst, int bytes) {
  cute::SM90_BULK_COPY_G2S::copy(src, full, dst, bytes);
}

}  // namespace sage_common::sm90
