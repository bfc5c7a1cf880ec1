// How the pre-passes record V's non-finite elements (host-visible part: the bindings size and
// fill the record with these). FP8 and FP4 codes have no Inf and a NaN times P~ would reach
// masked rows too, so V's +-Inf / NaN are quantized as 0 and, per (b, kv head) and channel, the
// first attended key holding each kind is recorded; the epilogues write it over the output rows
// that see that key, as exact attention would (nonfinite.cuh).
#pragma once

namespace sage_common {

// v_first: int32 (B, Hkv, kCount, D); every byte 0x7f before the pre-pass (kNoKey), atomicMin of keys.
enum class NonFinite : int { kPosInf = 0, kNegInf = 1, kNaN = 2, kCount = 3 };
constexpr int kNoKey = 0x7f7f7f7f;  // "no such key": the byte pattern of the workspace memset

}  // namespace sage_common
