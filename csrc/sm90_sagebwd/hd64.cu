// The shipped backward kernels at head dim 64 (launch.cuh).
#include "launch.cuh"

namespace sagebwd_sm90 {
SAGEBWD_SM90_SHIPPED(, 64);
}  // namespace sagebwd_sm90
