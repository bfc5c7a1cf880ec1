#include "launch.cuh"

namespace sagebwd_sm90 {
SAGEBWD_LAB_LAUNCH(128, cute::bfloat16_t, Schedule::kSerial);
SAGEBWD_LAB_LAUNCH(128, cute::half_t, Schedule::kSerial);
}  // namespace sagebwd_sm90
