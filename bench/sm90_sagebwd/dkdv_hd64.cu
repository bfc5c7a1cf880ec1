#include "launch.cuh"

namespace sagebwd_sm90 {
SAGEBWD_LAB_LAUNCH(64, cute::bfloat16_t, Schedule::kSerial);
SAGEBWD_LAB_LAUNCH(64, cute::half_t, Schedule::kSerial);
SAGEBWD_LAB_LAUNCH(64, cute::bfloat16_t, Schedule::kOverlap);
SAGEBWD_LAB_LAUNCH(64, cute::half_t, Schedule::kOverlap);
}  // namespace sagebwd_sm90
