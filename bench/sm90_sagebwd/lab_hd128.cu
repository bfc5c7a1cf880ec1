#include "launch.cuh"

namespace sagebwd_sm90 {
SAGEBWD_LAB_HD128();
}  // namespace sagebwd_sm90
