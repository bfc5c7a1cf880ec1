// wgmma on plain register arrays (CuTe's atoms take every accumulator register as a separate
// argument), the register / proxy fences around them, and the operands' smem descriptors.
#pragma once

#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/tensor.hpp>

namespace sage_common::sm90 {

// D (+)= A B with both operands described by smem descriptors; d is flat or m16n8-tiled ([N][4]).
template <class Atom, class Acc, int N, size_t... I>
__device__ __forceinline__ void wgmma_ss(uint64_t desc_a, uint64_t desc_b, Acc (&d)[N],
                                         cute::GMMA::ScaleOut scale_d, std::index_sequence<I...>) {
  Atom::fma(desc_a, desc_b, d[I]..., scale_d);
}
template <class Atom, int N, size_t... I>
__device__ __forceinline__ void wgmma_ss(uint64_t desc_a, uint64_t desc_b, float (&d)[N][4],
                                         cute::GMMA::ScaleOut scale_d, std::index_sequence<I...>) {
  Atom::fma(desc_a, desc_b, d[I / 4][I % 4]..., scale_d);
}
// D (+)= A B with A from registers (a[0..3], one k-step's fragment) and B from a descriptor.
template <class Atom, class Acc, int N, size_t... I>
__device__ __forceinline__ void wgmma_rs(const uint32_t* a, uint64_t desc_b, Acc (&d)[N],
                                         cute::GMMA::ScaleOut scale_d, std::index_sequence<I...>) {
  Atom::fma(a[0], a[1], a[2], a[3], desc_b, d[I]..., scale_d);
}
template <class Atom, int N, size_t... I>
__device__ __forceinline__ void wgmma_rs(const uint32_t* a, uint64_t desc_b, float (&d)[N][4],
                                         cute::GMMA::ScaleOut scale_d, std::index_sequence<I...>) {
  Atom::fma(a[0], a[1], a[2], a[3], desc_b, d[I / 4][I % 4]..., scale_d);
}

// Registers an in-flight wgmma reads or writes (accumulators, A fragments) must not be moved or
// redefined by the compiler across the issue / wait: fence each one.
template <class E, int N>
__device__ __forceinline__ void fence_regs(E (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(d[i]);
}
template <class E, int N, int M>
__device__ __forceinline__ void fence_regs(E (&d)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int e = 0; e < M; ++e) cute::warpgroup_fence_operand(d[i][e]);
  }
}

// Generic-proxy stores to shared memory (e.g. a tile written by threads) made visible to the
// async proxy (wgmma operands, bulk copies).
__device__ __forceinline__ void fence_view_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// GMMA descriptors of one warpgroup's slice of a shared-memory operand (CuTe builds them from the
// smem layout): A (the M-side operand) or B; one descriptor per k-step (and stage, when the layout
// has a stage mode). Elem is the operand's element type in shared memory.
template <class TiledMma, class Layout, class Elem>
__device__ __forceinline__ auto gmma_desc_a(Elem* smem, int tid_in_wg) {
  return TiledMma{}.get_slice(tid_in_wg).partition_fragment_A(cute::make_tensor(cute::make_smem_ptr(smem), Layout{}));
}
template <class TiledMma, class Layout, class Elem>
__device__ __forceinline__ auto gmma_desc_b(Elem* smem, int tid_in_wg) {
  return TiledMma{}.get_slice(tid_in_wg).partition_fragment_B(cute::make_tensor(cute::make_smem_ptr(smem), Layout{}));
}
template <class TiledMma, class Layout, class Elem>
using GmmaDescA = decltype(gmma_desc_a<TiledMma, Layout, Elem>(nullptr, 0));
template <class TiledMma, class Layout, class Elem>
using GmmaDescB = decltype(gmma_desc_b<TiledMma, Layout, Elem>(nullptr, 0));

}  // namespace sage_common::sm90
