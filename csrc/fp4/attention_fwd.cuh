// The FP4 forward kernel with per-warp mma.sync (EmuGemm::kMmaSync; the wgmma variant is
// attention_fwd_wgmma_sm90.cuh): composes the prologue, the two-stage K/V pipeline, the MMA
// sweeps, the fused softmax / P quantization and the epilogue. The MMA atom (which carries the
// microscaling format, NVFP4 or MXFP4), head dim and element type are template parameters;
// attention_fwd_{native,emulated}.cu instantiate the bounded set.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/launch.cuh"
#include "epilogue.cuh"
#include "fp4_api.h"
#include "mainloop.cuh"
#include "q_prologue.cuh"
#include "softmax_pquant.cuh"
#include "tile_config.cuh"

namespace sage_fp4 {

template <class Atom, int kHeadDim, typename T>
__global__ void __launch_bounds__(kThreads, 1) fp4_attention_fwd_kernel(const FwdParams p) {
  constexpr Fp4Format kFmt = Atom::kFormat;
  using Cfg = FwdConfig<kHeadDim, kFmt>;
  using Stage = StageView<kHeadDim, kFmt>;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem = smem_raw;
  const int q0 = blockIdx.x * kBlockM, h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.Hq / p.Hkv);  // GQA: query head h reads kv head h / group
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int64_t bhk = int64_t(b) * p.Hkv + hk;

  // Rebuilt where used rather than kept live across the main loop (registers are at the limit).
  auto kv_head = [&]() {
    KvHead kv;
    kv.kq = p.kq + bhk * p.skv_pad * (kHeadDim / 2);
    kv.ksf = p.ksf + bhk * p.skv_pad * Cfg::kKSfRowBytes;
    kv.vq = p.vq + bhk * kHeadDim * (p.skv_pad / 2);
    kv.vsf = p.vsf + bhk * kHeadDim * (p.skv_pad / Cfg::kSfBlock);
    kv.skv_pad = p.skv_pad;
    return kv;
  };

  int n_tiles = (p.Skv + kBlockN - 1) / kBlockN;
  if (p.causal) {  // top-left causal: the CTA's last row sees keys up to its own index
    const int last_row = min(q0 + kBlockM, p.Sq) - 1;
    n_tiles = min(n_tiles, last_row / kBlockN + 1);
  }

  auto stage = [&](int i) { return Stage{smem + i * Cfg::kStageBytes}; };
  load_kv_tile<kHeadDim, kFmt>(stage(0), kv_head(), 0);  // overlaps the Q prologue
  cp_async_commit();

  typename Atom::FragA qf[kHeadDim / 64];
  q_prologue<Atom, kHeadDim, T>(p, smem, b, h, hk, q0, qf);

  float acc[kHeadDim / 8][4];
  zero_acc(acc);
  RowState rs = RowState::start();
  const int warp_row0 = q0 + 16 * warp;

  {
    uint8_t* q_tile = smem + Cfg::kOffQ;
    if constexpr (Atom::kStagesDecoded) {
      __syncwarp();  // the warp's lanes are done reading its 16 Q rows
  #pragma unroll
      for (int c = 0; c < kHeadDim / 64; ++c) Atom::store_a(staged_q_frag<Atom, kHeadDim>(q_tile, c), qf[c]);
      __syncwarp();
    }
    const float* qbar = reinterpret_cast<const float*>(smem + Cfg::kOffQbar);
    // Decoded staging (if the atom uses it): qbar A fragments, then the tile's B fragments.
    uint32_t* qbar_frags = reinterpret_cast<uint32_t*>(smem + Cfg::template qbar_frag_offset<Atom>());
    uint32_t* staged = reinterpret_cast<uint32_t*>(smem + Cfg::template staged_offset<Atom>());
    if constexpr (Atom::kStagesDecoded) {
      if (warp == 0) build_qbar_frags<Atom, kHeadDim>(qbar, qbar_frags);  // read after the loop's first barrier
    }

    // Tensor scales: s_k joins the softmax scale, s_q multiplies the unsmoothed product only
    // (scores_to_log2); rebuilt from p rather than kept live across the loop.
    const float scale_log2 = p.scale * 1.4426950408889634f * p.k_scale[bhk];

    // Scores, softmax, P~ quantization and P.V of one tile whose K/V fragments (raw stage `st`,
    // decoded `staged_buf`), corrections and key-valid bits are ready and visible.
    auto compute_tile = [&](int tile, const Stage& st, uint32_t* staged_buf, const float* corr,
                            const uint32_t* valid) {
      float s[kBlockN / 8][4];
      qk_tile<Atom, kHeadDim>(s, qf, q_tile, st, staged_buf);
      float alpha[2], s1[2];
      typename Atom::FragA pf[kBlockN / kKeyChunk];
      scores_to_p_tile<Atom>(s, p, tile, warp_row0, corr, valid, scale_log2, p.q_scale[int64_t(b) * p.Hq + h], rs,
                             alpha, s1, pf);
      pv_tile<Atom, kHeadDim>(acc, pf, alpha, s1, st, staged_buf);
    };
    auto corr_buf = [&](int i) { return reinterpret_cast<float*>(smem + Cfg::kOffCorr) + i * kBlockN; };
    auto valid_buf = [&](int i) { return reinterpret_cast<uint32_t*>(smem + Cfg::kOffValid) + i * (kBlockN / 32); };
    const uint8_t* key_mask_row = p.key_mask ? p.key_mask + int64_t(b) * p.Skv : nullptr;

    if constexpr (Atom::kStagesDecoded && kOptPipelinedStaging) {
      // Decoded staging double-buffered: iteration i multiplies tile i from decoded buffer i & 1
      // while the same iteration has already decoded tile i + 1 into the other buffer, and the raw
      // copy of tile i + 2 is in flight into the raw stage tile i occupied. One barrier per tile;
      // warps drift apart within a tile, so one warp's decode overlaps another's MMAs.
      constexpr int kStagedWords = Cfg::template staged_words<Atom>();
      if (n_tiles > 1) load_kv_tile<kHeadDim, kFmt>(stage(1), kv_head(), 1);
      cp_async_commit();  // possibly empty: keeps the group count uniform
      cp_async_wait<1>();  // this thread's copies of tile 0
      __syncthreads();     // everyone's tile-0 copies and the qbar fragments are visible
      key_valid_bits(valid_buf(0), 0, p.Skv, key_mask_row);
      stage_decoded_b<Atom, kHeadDim>(stage(0), staged, qbar_frags, corr_buf(0));
      for (int tile = 0; tile < n_tiles; ++tile) {
        const int cur = tile & 1, nxt = cur ^ 1;
        cp_async_wait<0>();  // raw tile + 1 (issued one iteration earlier)
        // Decoded tile `tile` is visible; every warp is done with tile - 1, so decoded buffer `nxt`
        // and raw stage `cur` (decoded last iteration) are free.
        __syncthreads();
        if (tile + 2 < n_tiles) {
          load_kv_tile<kHeadDim, kFmt>(stage(cur), kv_head(), tile + 2);
          cp_async_commit();
        }
        if (tile + 1 < n_tiles) {
          key_valid_bits(valid_buf(nxt), tile + 1, p.Skv, key_mask_row);
          stage_decoded_b<Atom, kHeadDim>(stage(nxt), staged + nxt * kStagedWords, qbar_frags, corr_buf(nxt));
        }
        compute_tile(tile, stage(cur), staged + cur * kStagedWords, corr_buf(cur), valid_buf(cur));
      }
    } else {
      for (int tile = 0; tile < n_tiles; ++tile) {
        const int cur = tile & 1;
        cp_async_wait<0>();  // this tile's copies, issued one iteration earlier
        // Makes the tile visible to all threads, and every warp is past tile - 1: its stage (now
        // refilled below) and the decoded fragments (restaged below) are free.
        __syncthreads();
        if (tile + 1 < n_tiles) {  // prefetch overlaps this tile's compute
          load_kv_tile<kHeadDim, kFmt>(stage(cur ^ 1), kv_head(), tile + 1);
          cp_async_commit();
        }
        const Stage st = stage(cur);
        key_valid_bits(valid_buf(cur), tile, p.Skv, key_mask_row);
        if constexpr (Atom::kStagesDecoded) {
          stage_decoded_b<Atom, kHeadDim>(st, staged, qbar_frags, corr_buf(cur));
        } else {
          correction_cuda_cores<kHeadDim, kFmt>(st, qbar, corr_buf(cur));
        }
        __syncthreads();
        compute_tile(tile, st, staged, corr_buf(cur), valid_buf(cur));
      }
    }
  }

  const float* qk_mean = reinterpret_cast<const float*>(smem + Cfg::kOffQkMean);
  store_output<kHeadDim, T>(p, acc, rs, qk_mean, b, h, q0);
}

// One forward kernel over (Sq / kBlockM, Hq, B) CTAs; `kernel` takes the FwdParams by value.
template <class Kernel>
cudaError_t launch_row_blocks(Kernel kernel, int threads, int smem, const FwdParams& p, cudaStream_t stream) {
  const dim3 grid((p.Sq + kBlockM - 1) / kBlockM, p.Hq, p.B);
  return sage_common::launch_with_smem(kernel, grid, threads, smem, p, stream);
}

template <class T>
struct TypeTag {
  using type = T;
};

// Calls launch(std::integral_constant<int, D>, TypeTag<T>) for the head dim (64, 128) and element
// type (fp16, bf16) of p.
template <class Launch>
cudaError_t dispatch_dim_dtype(const FwdParams& p, Launch&& launch) {
  const bool bf16 = p.dtype == ElemType::kBFloat16;
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  if (p.D == 64) return bf16 ? launch(D64{}, TypeTag<__nv_bfloat16>{}) : launch(D64{}, TypeTag<__half>{});
  if (p.D == 128) return bf16 ? launch(D128{}, TypeTag<__nv_bfloat16>{}) : launch(D128{}, TypeTag<__half>{});
  return cudaErrorInvalidValue;
}

template <class Atom>
cudaError_t dispatch_fwd_fmt(const FwdParams& p, cudaStream_t stream) {
  return dispatch_dim_dtype(p, [&](auto dim, auto tag) {
    constexpr int kHeadDim = decltype(dim)::value;
    using T = typename decltype(tag)::type;
    return launch_row_blocks(fp4_attention_fwd_kernel<Atom, kHeadDim, T>, kThreads,
                             FwdConfig<kHeadDim, Atom::kFormat>::template smem_bytes<Atom>(), p, stream);
  });
}

// The instantiated set: format (NVFP4, MXFP4) x head dim (64, 128) x element type (fp16, bf16).
// `Dispatch<Atom>` is the per-format entry (dispatch_fwd_fmt here, dispatch_fwd_wgmma_fmt for the
// wgmma variant).
template <class Atom>
struct FwdFmtDispatch {
  static cudaError_t run(const FwdParams& p, cudaStream_t stream) { return dispatch_fwd_fmt<Atom>(p, stream); }
};
template <template <Fp4Format> class Atom, template <class> class Dispatch = FwdFmtDispatch>
cudaError_t dispatch_fwd(const FwdParams& p, cudaStream_t stream) {
  if (p.Sq == 0 || p.B == 0 || p.Hq == 0) return cudaSuccess;
  switch (p.fmt) {
    case Fp4Format::kNvfp4: return Dispatch<Atom<Fp4Format::kNvfp4>>::run(p, stream);
    case Fp4Format::kMxfp4: return Dispatch<Atom<Fp4Format::kMxfp4>>::run(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace sage_fp4
