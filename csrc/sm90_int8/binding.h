// The torch side of one call of the sm_90a 8-bit attention, shared by the shipped binding
// (binding.cpp) and the benchmark build's (bench/sm90_int8/binding_bench.cpp): tensor checks, the
// pre-pass's outputs and workspace, the forward kernel's parameters, the forward call. What differs
// between the two is the `Variants` policy they pass: which forward variant serves a call and how
// the pre-pass launches (the shipped one is fixed: binding.cpp ShippedVariants).
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../common/launch_context.h"
#include "../common/nonfinite.h"
#include "../common/token_stats.h"
#include "launch.h"

namespace sage_sm90_torch {

using sage_sm90::DType;

constexpr int kQTileRows = sage_sm90::kQImageRows;

// The shape of the forward variant that serves a call (launch.h fwd_rows_per_cta, fwd_tile_keys,
// fwd_kv_block, fwd_pv_16bit; a Variants policy's shape()), which sizes the pre-pass's outputs: Q images of whole CTAs, K / V^T images and
// scales in K blocks of kv_block keys covering whole tiles of tile_keys keys; v16: V's image 16-bit.
struct FwdShape {
  int rows_per_cta = 2 * kQTileRows;
  int tile_keys = 128;
  int kv_block = 128;
  bool v16 = false;  // FwdOptions::pv_16bit: V as the 16-bit image (launch.h kPrepassV16Image), twice the bytes
};
// v_first (launch.h): +Inf, -Inf, NaN per channel, "no key" = every byte 0x7f (common/nonfinite.h).
constexpr int kNonFiniteKinds = static_cast<int>(sage_common::NonFinite::kCount);
constexpr int kNoKeyByte = sage_common::kNoKey & 0xff;
constexpr int kNoKey = sage_common::kNoKey;

// ints of V's non-finite record: v_first (B, Hkv, kinds, D), then v_summary (B, Hkv) right after
// it, so the one memset to kNoKey covers both (launch.h PrepassParams).
inline int64_t v_record_ints(int64_t B, int64_t Hkv, int64_t D) { return B * Hkv * (kNonFiniteKinds * D + 1); }

inline void check_qkv(const at::Tensor& x, const char* name, const at::Tensor& q) {
  TORCH_CHECK(x.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(x.dim() == 4, name, " must be (B, H, S, D), got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == q.scalar_type(), name, " dtype ", x.scalar_type(), " != q dtype ",
              q.scalar_type());
  TORCH_CHECK(x.device() == q.device(), name, " is on ", x.device(), ", q on ", q.device());
  TORCH_CHECK(x.stride(3) == 1, name, " needs a contiguous last dim, strides ", x.strides());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && x.stride(0) % 8 == 0 &&
                  x.stride(1) % 8 == 0 && x.stride(2) % 8 == 0,
              name, " rows must be 16-byte aligned (strides ", x.strides(), ")");
}

inline DType dtype_of(const at::Tensor& q) {
  if (q.scalar_type() == at::kHalf) return DType::kF16;
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "q must be float16 or bfloat16, got ", q.scalar_type());
  return DType::kBF16;
}

struct Prepared {
  at::Tensor q_img, sq, qkm, k_img, sk, vt_img, sv, kmean, v_first, v_summary, ws_int, partial, split_count, mask_bits;
  at::Tensor ws;  // kPrepassOneAlloc: every buffer above carved from this one (tensors undefined)
  int n_ints = 0;  // split counters + kv_len, zeroed before the pre-pass
  sage_sm90::PrepassParams p;
};

// Byte layout of the single workspace (kPrepassOneAlloc): each buffer 256-byte aligned.
struct Carver {
  int64_t bytes = 0;
  int64_t take(int64_t n) {
    const int64_t at = bytes;
    bytes += (n + 255) / 256 * 256;
    return at;
  }
};

// shape: the forward variant's (fwd_shape): the Q images cover whole CTAs, the K blocks whole key tiles.
// prepass_mode: the kPrepass* bit set (launch.h) the buffers and the pre-pass launch follow. The
// pre-pass itself is the caller's to launch (Variants::run_prepass).
inline Prepared prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const c10::optional<at::Tensor>& key_mask, double scale, bool want_qkm,
                        const FwdShape& shape, int prepass_mode) {
  check_qkv(q, "q", q);
  check_qkv(k, "k", q);
  check_qkv(v, "v", q);
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Skv = k.size(2);
  TORCH_CHECK(D == 64 || D == 128, "head dim must be 64 or 128, got ", D);
  TORCH_CHECK(k.sizes() == v.sizes(), "k ", k.sizes(), " and v ", v.sizes(), " must match");
  TORCH_CHECK(k.size(0) == B && k.size(3) == D, "k ", k.sizes(), " does not match q ", q.sizes());
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "Hq (", Hq, ") must be a multiple of Hkv (", Hkv, ")");
  TORCH_CHECK(Sq >= 1 && Skv >= 1, "empty sequences are not supported: Sq=", Sq, " Skv=", Skv);
  TORCH_CHECK(Sq < (1 << 30) && Skv < (1 << 30), "sequence too long");
  if (key_mask.has_value()) {
    const at::Tensor& m = *key_mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 2 && m.size(0) == B && m.size(1) == Skv &&
                    m.is_contiguous() && m.device() == q.device(),
                "key_mask must be a contiguous bool (B, Skv) = (", B, ", ", Skv, ") tensor on ",
                q.device(), ", got ", m.scalar_type(), " ", m.sizes());
  }

  Prepared r;
  const int64_t n_q_tiles = sage_sm90::fwd_q_tiles(Sq, shape.rows_per_cta);
  const int64_t kv_block = shape.kv_block;  // keys per K block (launch.h PrepassParams::kv_block)
  const int64_t n_kv_tiles = sage_sm90::fwd_kv_blocks(Skv, shape.tile_keys, shape.kv_block);
  const int64_t v_bytes = shape.v16 ? 2 : 1;  // per V image element: FP8, or the 16-bit input
  TORCH_CHECK(!shape.v16 || (shape.kv_block == 128 && shape.tile_keys == 128),
              "internal: a 16-bit V image has 128-key blocks and tiles");
  // token chunks of the k-mean / v-absmax reduction (common/token_stats.h, shared with FP4)
  const auto [n_split, split_len] = sage_common::stats_split(B * Hkv, Skv);

  // Fewer host calls before the first launch (the GPU idles until then when the caller waits
  // on each call): one caching-allocator request and a raw memset instead of ~12 tensors and a
  // fill kernel. Calls that want qkm (tests' prepass(), LSE) keep the tensors.
  const bool one_alloc = (prepass_mode & sage_sm90::kPrepassOneAlloc) != 0 && !want_qkm;
  sage_sm90::PrepassParams& p = r.p;
  r.n_ints = static_cast<int>(B * Hkv + B);
  if (one_alloc) {
    Carver c;
    const int64_t q_elems = B * Hq * n_q_tiles * kQTileRows;
    const int64_t o_q = c.take(q_elems * D);
    const int64_t o_sq = c.take(4 * q_elems);
    const int64_t o_k = c.take(B * Hkv * n_kv_tiles * kv_block * D);
    const int64_t o_sk = c.take(4 * B * Hkv * n_kv_tiles);
    const int64_t o_v = c.take(B * Hkv * n_kv_tiles * D * kv_block * v_bytes);
    const int64_t o_sv = c.take(4 * B * Hkv * D);
    const int64_t o_km = c.take(4 * B * Hkv * D);
    const int64_t o_vf = c.take(4 * v_record_ints(B, Hkv, D));
    const int64_t o_part = c.take(4 * B * Hkv * n_split * 2 * D);
    const int64_t o_cnt = c.take(4 * B * Hkv * n_split);
    const int64_t o_int = c.take(4 * (B * Hkv + B));
    const int64_t o_bits = c.take(key_mask.has_value() ? 4 * B * (kv_block / 32) * n_kv_tiles : 0);
    r.ws = at::empty({c.bytes}, q.options().dtype(at::kByte));
    uint8_t* base = r.ws.data_ptr<uint8_t>();
    p.q_img = reinterpret_cast<int8_t*>(base + o_q);
    p.sq = reinterpret_cast<float*>(base + o_sq);
    p.qkm = nullptr;
    p.k_img = reinterpret_cast<int8_t*>(base + o_k);
    p.sk = reinterpret_cast<float*>(base + o_sk);
    p.vt_img = base + o_v;
    p.sv = reinterpret_cast<float*>(base + o_sv);
    p.kmean = reinterpret_cast<float*>(base + o_km);
    p.v_first = reinterpret_cast<int*>(base + o_vf);
    p.v_summary = p.v_first + B * Hkv * kNonFiniteKinds * D;
    p.partial = reinterpret_cast<float*>(base + o_part);
    p.split_count = reinterpret_cast<int*>(base + o_cnt);
    p.counter = reinterpret_cast<int*>(base + o_int);
    p.kv_len = p.counter + B * Hkv;
    p.mask_bits = key_mask.has_value() ? reinterpret_cast<uint32_t*>(base + o_bits) : nullptr;
    const cudaError_t e = cudaMemsetAsync(p.counter, 0, sizeof(int) * r.n_ints, c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(e == cudaSuccess, "sage sm90 workspace memset failed: ", cudaGetErrorString(e));
    const cudaError_t e2 = cudaMemsetAsync(p.v_first, kNoKeyByte, sizeof(int) * v_record_ints(B, Hkv, D),
                                           c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(e2 == cudaSuccess, "sage sm90 workspace memset failed: ", cudaGetErrorString(e2));
  }
  const auto u8 = q.options().dtype(at::kByte);
  const auto i8 = q.options().dtype(at::kChar);
  const auto f32 = q.options().dtype(at::kFloat);
  const auto i32 = q.options().dtype(at::kInt);
  if (!one_alloc) {
    r.q_img = at::empty({B, Hq, n_q_tiles, kQTileRows * D}, i8);
    r.sq = at::empty({B, Hq, n_q_tiles * kQTileRows}, f32);
    r.qkm = want_qkm ? at::empty({B, Hq, n_q_tiles * kQTileRows}, f32) : at::empty({0}, f32);
    r.k_img = at::empty({B, Hkv, n_kv_tiles, kv_block * D}, i8);
    r.sk = at::empty({B, Hkv, n_kv_tiles}, f32);
    r.vt_img = at::empty({B, Hkv, n_kv_tiles, D * kv_block * v_bytes}, u8);
    r.sv = at::empty({B, Hkv, D}, f32);
    r.kmean = at::empty({B, Hkv, D}, f32);
    const at::Tensor v_record = at::full({v_record_ints(B, Hkv, D)}, kNoKey, i32);
    r.v_first = v_record.narrow(0, 0, B * Hkv * kNonFiniteKinds * D).view({B, Hkv, kNonFiniteKinds, D});
    r.v_summary = v_record.narrow(0, B * Hkv * kNonFiniteKinds * D, B * Hkv).view({B, Hkv});
    r.partial = at::empty({B * Hkv, n_split, 2, D}, f32);
    r.split_count = at::empty({B * Hkv, n_split}, i32);
    r.ws_int = at::zeros({B * Hkv + B}, i32);  // split counters, then kv_len per batch
    r.mask_bits = key_mask.has_value() ? at::empty({B, kv_block / 32 * n_kv_tiles}, i32) : at::empty({0}, i32);
  }
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_sb = q.stride(0); p.q_sh = q.stride(1); p.q_ss = q.stride(2);
  p.k_sb = k.stride(0); p.k_sh = k.stride(1); p.k_ss = k.stride(2);
  p.v_sb = v.stride(0); p.v_sh = v.stride(1); p.v_ss = v.stride(2);
  p.key_mask = key_mask.has_value() ? reinterpret_cast<const uint8_t*>(key_mask->data_ptr()) : nullptr;
  p.B = B; p.Hq = Hq; p.Hkv = Hkv; p.Sq = Sq; p.Skv = Skv;
  p.n_q_tiles = n_q_tiles;
  p.n_kv_tiles = n_kv_tiles;
  p.n_split = n_split;
  p.split_len = split_len;
  p.scale = static_cast<float>(scale);
  p.q_in_stats = (prepass_mode & sage_sm90::kPrepassQInStats) != 0 && !want_qkm;
  p.kernel_mode = (prepass_mode &
                   (sage_sm90::kPrepassBatchLoads | sage_sm90::kPrepassL2Reuse | sage_sm90::kPrepassFastDiv)) |
                  (shape.v16 ? sage_sm90::kPrepassV16Image : 0);
  p.skip_q = 0;  // every forward variant reads the pre-pass's Q (q_in_kernel, which did not, is deleted)
  p.kv_block = shape.kv_block;
  if (!one_alloc) {
    p.q_img = r.q_img.data_ptr<int8_t>();
    p.sq = r.sq.data_ptr<float>();
    p.qkm = want_qkm ? r.qkm.data_ptr<float>() : nullptr;
    p.k_img = r.k_img.data_ptr<int8_t>();
    p.sk = r.sk.data_ptr<float>();
    p.vt_img = r.vt_img.data_ptr<uint8_t>();
    p.sv = r.sv.data_ptr<float>();
    p.kmean = r.kmean.data_ptr<float>();
    p.v_first = r.v_first.data_ptr<int>();
    p.v_summary = r.v_summary.data_ptr<int>();
    p.partial = r.partial.data_ptr<float>();
    p.split_count = r.split_count.data_ptr<int>();
    p.counter = r.ws_int.data_ptr<int>();
    p.kv_len = r.ws_int.data_ptr<int>() + B * Hkv;
    p.mask_bits = key_mask.has_value() ? reinterpret_cast<uint32_t*>(r.mask_bits.data_ptr<int>()) : nullptr;
  }

  return r;
}

// The forward kernel's parameters for r's pre-pass outputs and `out`, without a key mask or LSE
// (fwd adds those; the benchmarks run without).
inline sage_sm90::FwdParams fwd_params(const Prepared& r, const at::Tensor& q, const at::Tensor& k,
                                const at::Tensor& out, double scale) {
  sage_sm90::FwdParams p{};
  p.q_img = r.p.q_img;
  p.sq = r.p.sq;
  p.k_img = r.p.k_img;
  p.sk = r.p.sk;
  p.vt_img = r.p.vt_img;
  p.sv = r.p.sv;
  p.v_first = r.p.v_first;
  p.v_summary = r.p.v_summary;
  p.out = out.data_ptr();
  p.o_sb = out.stride(0); p.o_sh = out.stride(1); p.o_ss = out.stride(2);
  p.B = q.size(0); p.Hq = q.size(1); p.Hkv = k.size(1); p.Sq = q.size(2); p.Skv = k.size(2);
  p.n_q_tiles = r.p.n_q_tiles;
  p.n_kv_tiles = r.p.n_kv_tiles;
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  return p;
}


// A Variants policy (binding.cpp ShippedVariants, bench/sm90_int8/binding_bench.cpp BenchVariants) says,
// for a call's (head dim, causal, exp2 share):
//   int prepass_mode() const;                     the kPrepass* bit set of the pre-pass
//   bool has(d, causal, e) const;                 whether a compiled forward variant serves it
//   FwdShape shape(d, causal, e) const;           its rows per CTA, keys per tile and per K block, V's image
//   cudaError_t run_prepass(p, d, dtype, stream) const;
//   cudaError_t run_fwd(p, d, dtype, causal, e, stream) const;

// prepare() with the policy's pre-pass mode, then the pre-pass launch.
template <class Variants>
Prepared prepare_and_launch(const Variants& variants, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& key_mask, double scale, bool want_qkm,
                            const FwdShape& shape) {
  Prepared r = prepare(q, k, v, key_mask, scale, want_qkm, shape, variants.prepass_mode());
  const cudaError_t err =
      variants.run_prepass(r.p, static_cast<int>(q.size(3)), dtype_of(q), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "sage sm90 pre-pass launch failed: ", cudaGetErrorString(err));
  return r;
}

// Pre-pass only, for tests: the quantized images and scales (layouts in launch.h). kv_block: keys
// per K block, 128, or 64 in whole 192-key tiles (the long_tile variants' pre-pass, which only the
// benchmark build compiles). v16: V as the pv_16bit variants' 16-bit image (128-key blocks: the
// accurate policy's).
template <class Variants>
std::vector<at::Tensor> prepass_outputs(const Variants& variants, const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const c10::optional<at::Tensor>& key_mask, double scale,
                                        int64_t kv_block, bool v16 = false) {
  const sage_common::LaunchContext launch(q);  // q's device and its current stream (common/launch_context.h)
  TORCH_CHECK(kv_block == 128 || kv_block == 64, "kv_block must be 128 or 64, got ", kv_block);
  TORCH_CHECK(!v16 || kv_block == 128, "a 16-bit V image has 128-key blocks, got kv_block ", kv_block);
  const sage_sm90::FwdOptions tiles{.long_tile = kv_block == 64};  // the tile / K block of such variants
  FwdShape shape;
  shape.kv_block = tiles.kv_block();
  shape.tile_keys = tiles.tile_keys();
  shape.v16 = v16;
  Prepared r = prepare_and_launch(variants, q, k, v, key_mask, scale, /*want_qkm=*/true, shape);
  const int64_t B = q.size(0), Hkv = k.size(1);
  at::Tensor kv_len = r.ws_int.slice(0, B * Hkv, B * Hkv + B);
  return {r.q_img, r.sq, r.qkm, r.k_img, r.sk, r.vt_img, r.sv, r.kmean, kv_len, r.mask_bits, r.v_first, r.v_summary};
}

// The forward: pre-pass, then the attention kernel of the variant the policy picks.
template <class Variants>
std::vector<at::Tensor> forward(const Variants& variants, const at::Tensor& q, const at::Tensor& k,
                                const at::Tensor& v, const c10::optional<at::Tensor>& key_mask, bool is_causal,
                                double scale, bool return_lse, int64_t exp_poly_every) {
  const sage_common::LaunchContext launch(q);  // q's device and its current stream (common/launch_context.h)
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3);
  const int d = static_cast<int>(D), e = static_cast<int>(exp_poly_every);
  TORCH_CHECK(variants.has(d, is_causal, e), "no compiled variant for head dim ", D, ", causal ", is_causal,
              ", exp_poly_every ", exp_poly_every);
  Prepared r = prepare_and_launch(variants, q, k, v, key_mask, scale, return_lse, variants.shape(d, is_causal, e));
  at::Tensor out = at::empty_like(q);  // keeps q's memory layout: BSHD callers get BSHD back
  at::Tensor lse = return_lse ? at::empty({B, Hq, Sq}, q.options().dtype(at::kFloat))
                              : at::empty({0}, q.options().dtype(at::kFloat));
  TORCH_CHECK(out.stride(3) == 1, "internal: output last dim must be contiguous");

  sage_sm90::FwdParams p = fwd_params(r, q, k, out, scale);
  p.qkm = return_lse ? r.p.qkm : nullptr;
  p.kv_len = key_mask.has_value() ? r.p.kv_len : nullptr;
  p.mask_bits = r.p.mask_bits;
  p.lse = return_lse ? lse.data_ptr<float>() : nullptr;
  const cudaError_t err = variants.run_fwd(p, d, dtype_of(q), is_causal, e, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "sage sm90 attention launch failed: ", cudaGetErrorString(err));
  return {out, lse};
}

}  // namespace sage_sm90_torch
