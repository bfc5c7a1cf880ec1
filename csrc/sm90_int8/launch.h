// Host-side interface of the sm_90a 8-bit attention: plain structs of raw pointers and strides.
// No torch headers here: binding.cpp fills these from tensors, the .cu files launch kernels.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace sage_sm90 {

enum class DType : int { kF16 = 0, kBF16 = 1 };

// Which shipped policy serves a call (policy.hpp): the fast one (FP8 P~ V, the default) or the
// accurate one (16-bit P~ V: a third of the error, 3-18 % more kernel time). The Python side passes
// the same numbers (int8_sm90._PRECISION_ID, from options.Int8Precision).
enum class Precision : int { kFast = 0, kAccurate = 1 };

// Forward-kernel options (one line each here; DESIGN.md: what each does in detail and what was measured): one template axis of fwd_kernel, a
// structural type so every instantiation names its options (instantiations/*.cu). The regular
// build compiles one option set per head dim and Precision (policy.hpp ShippedPolicy<D>,
// AccuratePolicy<D>, which generate_instantiations.py reads to write the tables and the Python side);
// flags() is an option set's run-time key, by which the shipped build picks the policy of a call's
// precision and the benchmark build (bench/sm90_int8/) picks among several.
struct FwdOptions {
  bool lean_softmax = false;        // fewer instructions per score; O rescale skipped when no max moved
  bool overlap_softmax_pv = false;  // softmax of tile t under the PV wgmma of tile t-1
  bool pingpong = false;            // the two consumer warpgroups take turns issuing wgmmas
  bool q_in_registers = false;      // Q K^T as an RS wgmma with Q held in registers
  // (flags() 16: fp16_exp2, deleted, never built; DESIGN.md. The value stays reserved.)
  bool split_reductions = false;    // row max / sum as four chains of 8 (a lean-softmax variant)
  bool fp32_pv_tiles = false;       // each key tile's P V from zero on the tensor cores, O summed in fp32
  int exp2_poly_every = 0;          // every N-th exp2 on the FMA pipes (0 = all on MUFU)
  int smem_o_every = 0;             // O's fp32 sum in smem, the tensor-core one flushed into it
                                    // every N key tiles (0 = O only in registers); power of 2
  // (flags() 1 << kFlagsHighShift: seed_reductions, deleted, never built; DESIGN.md. Reserved.)
  // (flags() 1 << (kFlagsHighShift + 1): persistent, deleted; DESIGN.md. Reserved.)
  bool phase_clock = false;         // (benchmarks) %globaltimer / %clock64 at fixed phase points (FwdParams::phase_clock)
  bool epilogue_summary = false;    // the epilogue skips V's non-finite lookup when FwdParams::v_summary says none is seen
  // (flags() 1 << (kFlagsHighShift + 4): q_in_kernel, deleted; DESIGN.md. Reserved.)
  bool epilogue_staged = false;     // the epilogue stages O in smem and writes rows with 16-byte stores
  bool three_consumers = false;     // three consumer warpgroups (192 query rows per CTA) instead of two;
                                    // no ping-pong or phase_clock; at head dim 128 no overlap_softmax_pv
                                    // (fwd_kernel, which knows D, static_asserts it)
  // (flags() 1 << (kFlagsHighShift + 7): late_pv_wait, deleted; DESIGN.md. Reserved.)
  bool tc_row_sum = false;          // the row sums of P~ on the tensor cores: 8 columns of ones after V^T's D
                                    // rows in smem (PV's N = D + 8)
  bool tile_sums = false;           // (tc_row_sum, no fp32_pv_tiles) each tile's row sums leave the FP8
                                    // accumulator into fp32 as soon as its PV retired
  bool fused_rescale = false;       // (fp32_pv_tiles, plain loop) O = alpha O + tile in one FFMA per value
                                    // after the PV instead of O *= alpha before it and O += tile after
  bool seeded_scores = false;       // S's int32 accumulator starts from the bits of 1.5 * 2^23,
                                    // so each score arrives as its biased float: no convert add per score
  bool long_tile = false;           // (lean, no three_consumers) 192-key tiles of
                                    // three 64-key K scale blocks (the pre-pass's kv_block = 64)
  bool pv_16bit = false;            // (no tc_row_sum, fp32_pv_tiles, smem_o_every, long_tile) P~ V as a
                                    // 16-bit wgmma in the input dtype, fp32 accumulation: P~ = p, V as given
                                    // (the pre-pass's 16-bit image): 3x lower rel-L1, emulated (int8_error_budget_cpu.md)

  // Deleted options keep their bits unused, so the flags (and kernel names) of the others stay:
  // 16 (fp16_exp2), 1 << kFlagsHighShift (seed_reductions), 1 << (kFlagsHighShift + 1) (persistent),
  // 1 << (kFlagsHighShift + 4) (q_in_kernel), 1 << (kFlagsHighShift + 7) (late_pv_wait),
  // 1 << (kFlagsHighShift + 11) (fma_convert).
  constexpr int flags() const {
    return (lean_softmax ? 1 : 0) | (overlap_softmax_pv ? 2 : 0) | (pingpong ? 4 : 0) |
           (q_in_registers ? 8 : 0) | (split_reductions ? 32 : 0) |
           (fp32_pv_tiles ? 64 : 0) | (smem_o_every << kFlagsIntShift) |
           (phase_clock ? 1 << (kFlagsHighShift + 2) : 0) | (epilogue_summary ? 1 << (kFlagsHighShift + 3) : 0) |
           (epilogue_staged ? 1 << (kFlagsHighShift + 5) : 0) |
           (three_consumers ? 1 << (kFlagsHighShift + 6) : 0) |
           (tc_row_sum ? 1 << (kFlagsHighShift + 8) : 0) | (tile_sums ? 1 << (kFlagsHighShift + 9) : 0) |
           (fused_rescale ? 1 << (kFlagsHighShift + 10) : 0) | (seeded_scores ? 1 << (kFlagsHighShift + 12) : 0) |
           (long_tile ? 1 << (kFlagsHighShift + 13) : 0) | (pv_16bit ? 1 << (kFlagsHighShift + 14) : 0);
  }
  static constexpr int kFlagsIntShift = 7;  // smem_o_every (<= 16: 5 bits) sits above the first bools
  static constexpr int kFlagsHighShift = 12;  // bools added later sit above it (flags stay stable)
  // The inverse of (flags(), exp2_poly_every). The __global__ kernel takes these two ints as its
  // template arguments: nvcc's host stubs cannot spell a class-type template argument.
  static constexpr FwdOptions from_flags(int flags, int exp2_poly_every) {
    FwdOptions o;
    o.lean_softmax = (flags & 1) != 0;
    o.overlap_softmax_pv = (flags & 2) != 0;
    o.pingpong = (flags & 4) != 0;
    o.q_in_registers = (flags & 8) != 0;
    o.split_reductions = (flags & 32) != 0;
    o.fp32_pv_tiles = (flags & 64) != 0;
    o.smem_o_every = (flags >> kFlagsIntShift) & ((1 << (kFlagsHighShift - kFlagsIntShift)) - 1);
    o.phase_clock = ((flags >> (kFlagsHighShift + 2)) & 1) != 0;
    o.epilogue_summary = ((flags >> (kFlagsHighShift + 3)) & 1) != 0;
    o.epilogue_staged = ((flags >> (kFlagsHighShift + 5)) & 1) != 0;
    o.three_consumers = ((flags >> (kFlagsHighShift + 6)) & 1) != 0;
    o.tc_row_sum = ((flags >> (kFlagsHighShift + 8)) & 1) != 0;
    o.tile_sums = ((flags >> (kFlagsHighShift + 9)) & 1) != 0;
    o.fused_rescale = ((flags >> (kFlagsHighShift + 10)) & 1) != 0;
    o.seeded_scores = ((flags >> (kFlagsHighShift + 12)) & 1) != 0;
    o.long_tile = ((flags >> (kFlagsHighShift + 13)) & 1) != 0;
    o.pv_16bit = ((flags >> (kFlagsHighShift + 14)) & 1) != 0;
    o.exp2_poly_every = exp2_poly_every;
    return o;
  }
  // Combinations the kernel implements (fwd_kernel static_asserts it instead of dropping options).
  constexpr bool valid() const {
    return (!split_reductions || lean_softmax) && exp2_poly_every >= 0 &&
           smem_o_every >= 0 && smem_o_every <= 16 && (smem_o_every & (smem_o_every - 1)) == 0 &&
           !(fp32_pv_tiles && smem_o_every > 0) &&
           // three_consumers: the ping-pong schedule and the phase record are written for two
           // consumer warpgroups (at head dim 128 also no overlap: fwd_kernel, which knows D, asserts that)
           (!three_consumers || (!pingpong && !phase_clock)) &&
           // tile_sums: the sums are tc_row_sum's; with fp32_pv_tiles every tile is in fp32 already
           (!tile_sums || (tc_row_sum && !fp32_pv_tiles)) &&
           // fused_rescale: O and the tile are separate registers only with fp32_pv_tiles, and the
           // FFMA needs the alpha of the tile just retired, which only the plain loop has at hand
           (!fused_rescale || (fp32_pv_tiles && !overlap_softmax_pv && !pingpong)) &&
           // long_tile: per-block K scales in the lean fp32 steps (softmax.hpp); two consumer
           // warpgroups (S's 96 registers)
           (!long_tile || (lean_softmax && !three_consumers)) &&
           // pv_16bit: the row sums from the softmax (the ones rows are FP8); O accumulates in fp32
           // in the tensor core already (and the smem after the barriers holds the staged epilogue's
           // tile only: tile_config.hpp); 128-key tiles (V's image is per 128-key block)
           (!pv_16bit || (!tc_row_sum && !fp32_pv_tiles && smem_o_every == 0 && !long_tile));
  }
  // Keys per tile and per K scale block (tile_config.hpp kLongTileKeys, kKBlockKeys).
  constexpr int tile_keys() const { return long_tile ? 192 : 128; }
  constexpr int kv_block() const { return long_tile ? 64 : 128; }
  // tc_row_sum: the columns of ones appended to V^T in smem (one 8-row swizzle atom; TileConfig kSumCols).
  constexpr int sum_cols() const { return tc_row_sum ? 8 : 0; }
  // The loops that hold two P arrays (overlap or ping-pong) take a whole producer warpgroup; so
  // do three consumer warpgroups, whose 160 registers each exist only with setmaxnreg (512 threads
  // launch with 128), and pv_16bit, whose P array is twice the FP8 one (32 registers: the plain
  // two-warpgroup loop spills at the 168 registers 288 threads get).
  constexpr bool producer_warpgroup() const { return overlap_softmax_pv || pingpong || three_consumers || pv_16bit; }
  // Consumer warpgroups of a CTA (64 query rows each: tile_config.hpp CtaShape).
  constexpr int consumer_warpgroups() const { return three_consumers ? 3 : 2; }
};
// from_flags inverts flags() for the bools above smem_o_every's bits (which they must not touch).
static_assert(FwdOptions::from_flags(FwdOptions{.smem_o_every = 16, .phase_clock = true}.flags(), 0).phase_clock &&
                  FwdOptions::from_flags(FwdOptions{.smem_o_every = 16, .phase_clock = true}.flags(), 0).smem_o_every == 16 &&
                  FwdOptions{.phase_clock = true}.flags() == 4 << FwdOptions::kFlagsHighShift,
              "FwdOptions::flags / from_flags");
static_assert(FwdOptions::from_flags(FwdOptions{.phase_clock = true}.flags(), 0).phase_clock &&
                  !FwdOptions::from_flags(FwdOptions{.phase_clock = true}.flags(), 0).epilogue_summary &&
                  FwdOptions::from_flags(FwdOptions{.epilogue_summary = true}.flags(), 0).epilogue_summary &&
                  FwdOptions{.phase_clock = true}.flags() == 1 << 14 &&
                  FwdOptions{.epilogue_summary = true}.flags() == 1 << 15,
              "FwdOptions::flags / from_flags: phase_clock, epilogue_summary");

// phase_clock: the phase points of one CTA's record (kernel_fwd.cuh). Lane 0 of warp 0 of consumer
// warpgroup w writes slots w * kConsumerPhases + ConsumerPhase, the producer lane the slots from
// kProducerSlot0 on; each slot holds {%globaltimer ns, %clock64 SM cycles} (kSmSlot: the SM).
enum class ConsumerPhase : int {
  kEntry = 0,         // kernel entry (before pdl_wait)
  kReady = 1,         // after pdl_wait and the barrier init (__syncthreads)
  kQReady = 2,        // Q arrived (q_full) and, with q_in_registers, is in registers
  kFirstSoftmax = 3,  // the first key tile's softmax done
  kLastPV = 4,        // the loop's last PV wgmma retired
  kEpilogue = 5,      // O complete (smem_o_every: the smem sum added), the epilogue starts
  kStored = 6,        // the epilogue's output (and LSE) stores issued
  kCount = 7
};
enum class ProducerPhase : int {
  kEntry = 0,     // kernel entry
  kReady = 1,     // after the barrier init: the Q copy and the first K/V copies are issued next
  kLastCopy = 2,  // the last K/V copy issued
  kCount = 3
};
constexpr int kConsumerPhases = static_cast<int>(ConsumerPhase::kCount);
constexpr int kProducerSlot0 = 2 * kConsumerPhases;  // two consumer warpgroups
// The last slot is no phase: {%smid, 0} of the CTA (the producer lane writes it at entry), so the
// gap between consecutive CTAs on one SM can be measured too.
constexpr int kSmSlot = kProducerSlot0 + static_cast<int>(ProducerPhase::kCount);
constexpr int kPhaseSlots = kSmSlot + 1;
constexpr int kPhaseWords = 2;  // per slot: globaltimer, clock64
static_assert(FwdOptions{.epilogue_staged = true}.flags() == 1 << 17 &&
                  FwdOptions::from_flags(1 << 17, 0).epilogue_staged && !FwdOptions::from_flags(1 << 17, 0).three_consumers &&
                  !FwdOptions::from_flags(1 << 16, 0).epilogue_staged,
              "FwdOptions::epilogue_staged flag bit (generate_instantiations._HIGH_BITS)");
static_assert(FwdOptions{.three_consumers = true}.flags() == 1 << 18 &&
                  FwdOptions::from_flags(1 << 18, 0).three_consumers && !FwdOptions::from_flags(1 << 18, 0).epilogue_staged &&
                  FwdOptions::from_flags(1 << 18, 0).consumer_warpgroups() == 3 &&
                  !FwdOptions{.pingpong = true, .three_consumers = true}.valid() &&
                  !FwdOptions{.phase_clock = true, .three_consumers = true}.valid(),
              "FwdOptions::three_consumers flag bit (generate_instantiations._HIGH_BITS) and validity");
static_assert(FwdOptions{.tile_sums = true}.flags() == 1 << 21 &&
                  FwdOptions::from_flags(1 << 21, 0).tile_sums && !FwdOptions::from_flags(1 << 20, 0).tile_sums,
              "FwdOptions::tile_sums flag bit (generate_instantiations._HIGH_BITS)");
static_assert(FwdOptions{.long_tile = true}.flags() == 1 << 25 && FwdOptions::from_flags(1 << 25, 0).long_tile &&
                  !FwdOptions::from_flags(1 << 24, 0).long_tile && !FwdOptions{.long_tile = true}.valid() &&
                  FwdOptions{.lean_softmax = true, .long_tile = true}.valid(),
              "FwdOptions::long_tile flag bit (generate_instantiations._HIGH_BITS) and validity");
static_assert(FwdOptions{.pv_16bit = true}.flags() == 1 << 26 && FwdOptions::from_flags(1 << 26, 0).pv_16bit &&
                  !FwdOptions::from_flags(1 << 25, 0).pv_16bit && FwdOptions{.pv_16bit = true}.valid() &&
                  !FwdOptions{.tc_row_sum = true, .pv_16bit = true}.valid() &&
                  !FwdOptions{.fp32_pv_tiles = true, .pv_16bit = true}.valid() &&
                  !FwdOptions{.smem_o_every = 4, .pv_16bit = true}.valid() &&
                  !FwdOptions{.lean_softmax = true, .long_tile = true, .pv_16bit = true}.valid(),
              "FwdOptions::pv_16bit flag bit (generate_instantiations._HIGH_BITS) and validity");

// Everything the quantization pre-pass reads and writes. Strides are in elements; the last
// (head) dimension of q, k, v is contiguous and rows are 16-byte aligned (checked by the binding).
struct PrepassParams {
  const void* q;
  const void* k;
  const void* v;
  int64_t q_sb, q_sh, q_ss;
  int64_t k_sb, k_sh, k_ss;
  int64_t v_sb, v_sh, v_ss;
  const uint8_t* key_mask;  // (B, Skv) bool, or nullptr
  int B, Hq, Hkv, Sq, Skv;
  int n_q_tiles;   // 64-row Q image tiles per (b, h): (R / 64) * ceil(Sq / R), R = fwd_rows_per_cta
  int n_kv_tiles;  // K blocks of kv_block keys per (b, kv head): ceil(Skv / 128), or (long_tile) 3 ceil(Skv / 192)
  int n_split;     // token chunks of the k-mean / v-absmax reduction
  int split_len;   // tokens per chunk
  float scale;     // softmax scale, for the LSE correction scale * q . k_mean
  int q_in_stats;   // 1: Q blocks run in the stats launch (needs qkm == nullptr; PrepassMode)
  int kernel_mode;  // the pre-pass mode's kernel-side bits (kPrepassBatchLoads | kPrepassL2Reuse |
                    // kPrepassFastDiv), a template argument of the kernels (prepass.cuh); with
                    // kPrepassV16Image where the forward variant reads a 16-bit V image
  int skip_q;       // 1: no Q blocks, q_img / sq / qkm unused (for FwdOptions::q_in_kernel, deleted: 0 now)
  // outputs
  int8_t* q_img;      // (B, Hq, n_q_tiles, 64*D) swizzled tile images
  float* sq;          // (B, Hq, n_q_tiles*64)
  float* qkm;         // (B, Hq, n_q_tiles*64) scale * q . k_mean, or nullptr (no LSE)
  int8_t* k_img;      // (B, Hkv, n_kv_tiles, 128*D)
  float* sk;          // (B, Hkv, n_kv_tiles)
  uint8_t* vt_img;    // (B, Hkv, n_kv_tiles, D*128) fp8 e4m3, keys permuted (tile_config.hpp); with
                      // kPrepassV16Image (B, Hkv, n_kv_tiles, 2*128*D) bytes of 16-bit V, not quantized
                      // (tile_config.hpp SmemLayoutVt's MN-major image)
  float* sv;          // (B, Hkv, D)
  float* kmean;       // (B, Hkv, D)
  int* v_first;       // (B, Hkv, 3, D) first attended key with V = +Inf, -Inf, NaN (numerics.hpp);
                      // memset to 0x7f bytes (kNoKey) before the pre-pass
  // workspace
  float* partial;     // (B*Hkv, n_split, 2, D)
  int* split_count;   // (B*Hkv, n_split) attended keys per chunk (the k mean's divisor)
  int* counter;       // (B*Hkv) zero-initialised
  int* kv_len;        // (B) zero-initialised; written only when key_mask != nullptr
  uint32_t* mask_bits;  // (B, 4*n_kv_tiles) bit j%32 of word j/32 = key j attends
  // added later, last so the offsets of the fields above stay
  int* v_summary;     // (B, Hkv) min of v_first over kinds and channels; follows v_first in
                      // memory so one memset covers both
  int kv_block;       // keys per K block (one K scale, one K / V^T image): 128, or 64 for a long_tile
                      // forward (whose 192-key tiles are three blocks: n_kv_tiles a multiple of 3)
};

struct FwdParams {
  // Unused: the 16-bit Q and its strides of q_in_kernel (deleted; DESIGN.md), kept so that the offsets of
  // the fields after them, and so the kernels' SASS, stay.
  const void* unused_q;
  int64_t unused_q_strides[3];
  const int8_t* q_img;
  const float* sq;        // NaN for a query row with a non-finite element: that row's out / lse are NaN
  const float* qkm;       // nullptr unless lse != nullptr
  const int8_t* k_img;
  const float* sk;
  const uint8_t* vt_img;
  const float* sv;
  const int* v_first;     // (B, Hkv, 3, D) from the pre-pass: V's non-finite elements (numerics.hpp)
  const int* kv_len;      // nullptr: every batch uses Skv
  const uint32_t* mask_bits;  // nullptr: no key mask
  void* out;              // (B, Hq, Sq, D) with strides below, last dim contiguous
  int64_t o_sb, o_sh, o_ss;
  float* lse;             // (B, Hq, Sq) contiguous, or nullptr
  int B, Hq, Hkv, Sq, Skv, n_q_tiles, n_kv_tiles;  // n_kv_tiles: K blocks (PrepassParams's)
  float scale_log2;       // scale * log2(e)
  // Fields added later sit last, so the offsets of the others (and the SASS of the variants that
  // do not read them) stay as they were.
  const int* v_summary;   // (B, Hkv): min of v_first over kinds and channels (epilogue_summary)
  // phase_clock variants: (CTAs, kPhaseSlots, kPhaseWords) timestamps, CTA = blockIdx.x +
  // gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); nullptr: nothing recorded
  unsigned long long* phase_clock;
};

// Pre-pass modes, a bit set; every mode writes the same output bits. The shipped binding runs
// kPrepassDefaultMode; the benchmark build (bench/sm90_int8/binding_bench.cpp) runs any of them.
// What each bit does and what it measured: DESIGN.md, "Pre-pass modes".
constexpr int kPrepassQInStats = 1;     // Q's blocks ride in the stats launch (calls without LSE)
constexpr int kPrepassBatchLoads = 2;   // each thread issues all loads of a block before using them
constexpr int kPrepassOneAlloc = 4;     // host: one workspace allocation + a raw memset (calls without LSE)
constexpr int kPrepassPdl = 8;          // the quant launch and the forward kernel launch with PDL
constexpr int kPrepassL2Reuse = 16;     // L2 eviction hints, the quant launch's K / V blocks reversed
constexpr int kPrepassFastDiv = 32;     // one reciprocal per scale instead of a division per element
constexpr int kPrepassModeMax = 63;
// Not a mode: the host sets it in PrepassParams::kernel_mode from the forward variant's shape
// (FwdOptions::pv_16bit): V's image is the 16-bit input as given (masked and non-finite elements 0)
// instead of FP8 V^T. A template bit of the kernels, so the others' code stays as it was; the shipped
// pre-pass has them in kPrepassDefaultMode (the accurate policy's), the benchmark build in every mode
// (prepass_v16.cu).
constexpr int kPrepassV16Image = 64;
// The shipped build's mode (binding.cpp; prepass.cu compiles only its kernels, the benchmark build every
// mode's); chosen from variants_bench.py's pre-pass table.
constexpr int kPrepassDefaultMode = 7;  // all three: the fastest in variants_bench.py's pre-pass table

// Return cudaSuccess or the launch error. head_dim in {64, 128}; p.kv_block 128 (the 64-key blocks of
// the long_tile variants: bench/sm90_int8/prepass_long.cu). pdl: the quant launch with programmatic
// dependent launch (kPrepassPdl).
cudaError_t run_prepass(const PrepassParams& p, int head_dim, DType dtype, bool pdl, cudaStream_t stream);
// The forward variant for a call is the build's option set for (head dim, dtype, causal, exp2 share,
// precision): instantiations/variants.inc, generated from policy.hpp's ShippedPolicy and AccuratePolicy.
// exp_poly_every: 0 = every exp2 on MUFU; N > 0 = every N-th exp2 from the FMA polynomial
// (compiled variants only: see instantiations/). pdl: the kernel launches with programmatic dependent
// launch and waits for the launch before it (kPrepassPdl).
cudaError_t run_fwd(const FwdParams& p, int head_dim, DType dtype, bool causal, int exp_poly_every, Precision precision,
                    bool pdl, cudaStream_t stream);
// Whether run_fwd has a compiled variant for these arguments.
bool has_fwd_variant(int head_dim, bool causal, int exp_poly_every, Precision precision);
// Query rows per CTA of the variant run_fwd picks for these arguments (64 per consumer warpgroup:
// 128, or 192 with FwdOptions::three_consumers; 128 where none matches). The Q images are sized by
// it: n_q_tiles = (rows / 64) * ceil(Sq / rows) tiles of 64 rows (rows >= Sq zero), so that every
// CTA's Q tiles exist (fwd_q_tiles).
int fwd_rows_per_cta(int head_dim, bool causal, int exp_poly_every, Precision precision);
// Keys per tile (128, or 192 with FwdOptions::long_tile) and per K scale block (128, or 64) of the
// variant run_fwd picks (128 / 128 where none matches): the pre-pass quantizes K in blocks of the
// latter and covers whole tiles (fwd_kv_blocks).
int fwd_tile_keys(int head_dim, bool causal, int exp_poly_every, Precision precision);
int fwd_kv_block(int head_dim, bool causal, int exp_poly_every, Precision precision);
// Whether the variant run_fwd picks reads V as a 16-bit image (FwdOptions::pv_16bit; false where none
// matches): the pre-pass then writes that image (kPrepassV16Image) instead of FP8 V^T.
bool fwd_pv_16bit(int head_dim, bool causal, int exp_poly_every, Precision precision);
constexpr int64_t fwd_kv_blocks(int64_t Skv, int tile_keys, int kv_block) {
  return tile_keys / kv_block * ((Skv + tile_keys - 1) / tile_keys);
}
static_assert(fwd_kv_blocks(128, 128, 128) == 1 && fwd_kv_blocks(129, 128, 128) == 2 && fwd_kv_blocks(193, 192, 64) == 6 &&
                  fwd_kv_blocks(4608, 192, 64) == 72,
              "fwd_kv_blocks: whole tiles of K blocks");
constexpr int kQImageRows = 64;  // rows of one Q image tile = one consumer warpgroup's (tile_config.hpp kRowsPerWG)
constexpr int64_t fwd_q_tiles(int64_t Sq, int rows_per_cta) {
  return rows_per_cta / kQImageRows * ((Sq + rows_per_cta - 1) / rows_per_cta);
}
static_assert(fwd_q_tiles(128, 128) == 2 && fwd_q_tiles(129, 128) == 4 && fwd_q_tiles(192, 192) == 3 &&
                  fwd_q_tiles(4429, 192) == 3 * 24,
              "fwd_q_tiles: whole CTAs of 64-row tiles");
}  // namespace sage_sm90
