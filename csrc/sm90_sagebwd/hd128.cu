// The shipped backward kernels at head dim 128 (launch.cuh).
#include "launch.cuh"

namespace sagebwd_sm90 {
SAGEBWD_SM90_SHIPPED(, 128);
}  // namespace sagebwd_sm90
