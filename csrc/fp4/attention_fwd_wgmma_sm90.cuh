// The FP4 forward kernel of the emulated atom with EmuGemm::kWgmma (sm_90a): composes the Q
// prologue (shared with the mma.sync kernel), the producer and consumer warpgroups of
// mainloop_wgmma_sm90.cuh and the epilogue. Reads K / V^T as decoded tile images
// (p.k_img / p.v_img, kv_images_sm90.cuh).
#pragma once

#include <cstdint>

#include "../common/smem.cuh"
#include "attention_fwd.cuh"
#include "epilogue.cuh"
#include "fp4_api.h"
#include "mainloop_wgmma_sm90.cuh"
#include "q_prologue.cuh"
#include "softmax_pquant.cuh"
#include "tile_config.cuh"

namespace sage_fp4 {

// The two consumer warpgroups take turns issuing their wgmmas unless no_wgmma_pingpong.
constexpr bool kWgmmaPingPong = !kOptions.no_wgmma_pingpong;

template <class Atom, int kHeadDim, typename T>
__global__ void __launch_bounds__(WgmmaConfig<kHeadDim, Atom::kFormat>::kThreads, 1)
    fp4_attention_fwd_wgmma_kernel(const __grid_constant__ FwdParams p) {
  constexpr Fp4Format kFmt = Atom::kFormat;
  using W = WgmmaConfig<kHeadDim, kFmt>;
  static_assert(!Atom::kNative, "the wgmma variant runs the emulated atom's decoded operands");
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // GMMA-swizzled tiles need 1024-byte aligned addresses (the slack is in kSmemBytes).
  const WgmmaSmem<kHeadDim, kFmt> sm{smem_raw + sage_common::smem_align_pad<1024>(smem_addr(smem_raw))};
  const int q0 = blockIdx.x * kBlockM, h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.Hq / p.Hkv);  // GQA: query head h reads kv head h / group
  const int warp = static_cast<int>(threadIdx.x >> 5);

  int n_tiles = (p.Skv + kBlockN - 1) / kBlockN;
  if (p.causal) {  // top-left causal: the CTA's last row sees keys up to its own index
    const int last_row = min(q0 + kBlockM, p.Sq) - 1;
    n_tiles = min(n_tiles, last_row / kBlockN + 1);
  }
  if (threadIdx.x == 0) sm.init_barriers();
  __syncthreads();

  if (warp >= W::kConsumerThreads / 32) {
    W::RegSplit::producer();
    const int64_t img0 = (int64_t(b) * p.Hkv + hk) * (p.skv_pad / kBlockN) * (kBlockN * kHeadDim);
    producer_wgmma<Atom, kHeadDim>(p, sm, n_tiles, static_cast<const uint16_t*>(p.k_img) + img0,
                                   static_cast<const uint16_t*>(p.v_img) + img0);
    return;
  }
  W::RegSplit::consumer();

  typename Atom::FragA qf[kHeadDim / 64];
  q_prologue<Atom, kHeadDim, T>(p, reinterpret_cast<T*>(sm.base), sm.qbar(), sm.qk_mean(), b, h, hk, q0, qf,
                                ConsumerSync{});
  named_barrier_arrive<W::kThreads>(kBarQbar);  // qbar is written (the prologue's last barrier is behind it)
  ConsumerSync{}();                     // every consumer is done reading the 16-bit Q rows
  store_q_decoded<Atom, kHeadDim>(sm, qf);
  fence_view_async_shared();
  ConsumerSync{}();

  float o[kHeadDim / 8][4];
  zero_acc(o);
  RowState rs = RowState::start();
  float g_scale[2] = {0.0f, 0.0f};
  consumer_wgmma<Atom, kHeadDim, kWgmmaPingPong>(p, sm, n_tiles, q0 + 16 * warp, o, rs, g_scale);
  scale_rows(o, g_scale);
  store_output<kHeadDim, T>(p, o, rs, sm.qk_mean(), b, h, q0);
}

template <class Atom>
cudaError_t dispatch_fwd_wgmma_fmt(const FwdParams& p, cudaStream_t stream) {
  return dispatch_dim_dtype(p, [&](auto dim, auto tag) {
    constexpr int kHeadDim = decltype(dim)::value;
    using W = WgmmaConfig<kHeadDim, Atom::kFormat>;
    return launch_row_blocks(fp4_attention_fwd_wgmma_kernel<Atom, kHeadDim, typename decltype(tag)::type>,
                             W::kThreads, W::kSmemBytes, p, stream);
  });
}

}  // namespace sage_fp4
