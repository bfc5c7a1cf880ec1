// The lab's variants of the backward kernels (csrc/sm90_sagebwd/launch.cuh's templates): every built
// schedule and dV accumulation, not only the shipped policy's. One translation unit per head dim
// (lab_hd64.cu, lab_hd128.cu), so the JIT build compiles them in parallel.
#pragma once

#include "../../csrc/sm90_sagebwd/launch.cuh"

namespace sagebwd_sm90 {

// Per head dim and dtype the serial schedule with the shipped dV numerics; at hd64 the overlapped one
// too; dV in place (bf16 only) with the hd64 overlapped and the hd128 serial schedule; dK as a bf16
// product (DkAcc::kBf16InPlace) with either dV, on the same schedules. dQ: serial per dtype,
// overlapped (bf16), overlapped as a bf16 product (DqAcc::kBf16InPlace).
#define SAGEBWD_LAB_DKDV(PREFIX, D, E, S, A) \
  PREFIX template cudaError_t launch_dkdv<D, E, Schedule::S, DvAcc::A>(const Params&, int, cudaStream_t)
#define SAGEBWD_LAB_DKDV16(PREFIX, D, S, A)                                                                    \
  PREFIX template cudaError_t launch_dkdv<D, cute::bfloat16_t, Schedule::S, DvAcc::A, DkAcc::kBf16InPlace>( \
      const Params&, int, cudaStream_t)
#define SAGEBWD_LAB_DQ(PREFIX, D, E, S) \
  PREFIX template cudaError_t launch_dq<D, E, Schedule::S>(const DqParams&, int, cudaStream_t)
#define SAGEBWD_LAB_DQ16(PREFIX, D, S)                                                                           \
  PREFIX template cudaError_t launch_dq<D, cute::bfloat16_t, Schedule::S, DqAcc::kBf16InPlace>(const DqParams&, \
                                                                                              int, cudaStream_t)
#define SAGEBWD_LAB_HD64(PREFIX)                                            \
  SAGEBWD_LAB_DKDV(PREFIX, 64, cute::bfloat16_t, kSerial, kScaledPerStep);  \
  SAGEBWD_LAB_DKDV(PREFIX, 64, cute::half_t, kSerial, kScaledPerStep);      \
  SAGEBWD_LAB_DKDV(PREFIX, 64, cute::bfloat16_t, kOverlap, kScaledPerStep); \
  SAGEBWD_LAB_DKDV(PREFIX, 64, cute::half_t, kOverlap, kScaledPerStep);     \
  SAGEBWD_LAB_DKDV(PREFIX, 64, cute::bfloat16_t, kOverlap, kInPlace);       \
  SAGEBWD_LAB_DKDV16(PREFIX, 64, kOverlap, kScaledPerStep);                  \
  SAGEBWD_LAB_DKDV16(PREFIX, 64, kOverlap, kInPlace);                        \
  SAGEBWD_LAB_DQ(PREFIX, 64, cute::bfloat16_t, kSerial);                    \
  SAGEBWD_LAB_DQ(PREFIX, 64, cute::bfloat16_t, kOverlap);                   \
  SAGEBWD_LAB_DQ16(PREFIX, 64, kOverlap);                                    \
  SAGEBWD_LAB_DQ(PREFIX, 64, cute::half_t, kSerial)
#define SAGEBWD_LAB_HD128(PREFIX)                                            \
  SAGEBWD_LAB_DKDV(PREFIX, 128, cute::bfloat16_t, kSerial, kScaledPerStep);  \
  SAGEBWD_LAB_DKDV(PREFIX, 128, cute::half_t, kSerial, kScaledPerStep);      \
  SAGEBWD_LAB_DKDV(PREFIX, 128, cute::bfloat16_t, kSerial, kInPlace);        \
  SAGEBWD_LAB_DKDV16(PREFIX, 128, kSerial, kScaledPerStep);                   \
  SAGEBWD_LAB_DKDV16(PREFIX, 128, kSerial, kInPlace);                         \
  SAGEBWD_LAB_DQ(PREFIX, 128, cute::bfloat16_t, kSerial);                    \
  SAGEBWD_LAB_DQ(PREFIX, 128, cute::bfloat16_t, kOverlap);                   \
  SAGEBWD_LAB_DQ16(PREFIX, 128, kOverlap);                                    \
  SAGEBWD_LAB_DQ(PREFIX, 128, cute::half_t, kSerial)
SAGEBWD_LAB_HD64(extern);
SAGEBWD_LAB_HD128(extern);

}  // namespace sagebwd_sm90
