"""The CUDA SageBwd dK/dV experiment's host side (bench/sagebwd_cuda_dkdv.py), on the CPU: the operand
images hold the reference's operands at the layout tables' offsets, the INT8 B images in the permuted
query order the kernel's A fragments assume, and the per-block vectors the reference's values."""
import math
import types

import pytest
import torch

import bench.sagebwd_cuda_dkdv as lab
from sage_diffusers.kernels.sagebwd_sm90 import key_entries_reference
from sage_diffusers.reference import sagebwd as ref
from sage_diffusers.reference.quant import quantize_int8_per_block


def _fake_ext(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tables = {}

    def layout_table(kind, d):
        rows, cols = {"kv16": (64, d), "q16": (64, d), "t8": (d, 64)}[kind]
        return tables.setdefault((kind, d), torch.randperm(rows * cols, generator=g).reshape(rows, cols))

    return types.SimpleNamespace(layout_table=layout_table, vec_floats=256)


def _decode(img: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, n, bytes) uint8 images -> (B, H, n, rows, cols) tiles of dtype."""
    flat = img.view(dtype)
    return flat[..., table.reshape(-1)].reshape(*flat.shape[:-1], *table.shape)


def test_permutation_is_the_forward_kernels():
    perm = lab.vt_position_to_query(torch.arange(64))
    assert sorted(perm.tolist()) == list(range(64))
    # position 4t + i of each 16-position half: query 2t + (i & 1) + 8 (i >> 1)
    assert perm[:16].tolist() == [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]
    assert perm[16:32].tolist() == [16 + p for p in perm[:16].tolist()]


@pytest.mark.parametrize("d,dtype", [(64, torch.float16), (128, torch.bfloat16)])
def test_images_hold_the_reference_operands(d, dtype):
    b, h, s = 1, 2, 256
    g = torch.Generator().manual_seed(d)
    q, k, v, do = (torch.randn(b, h, s, d, generator=g).to(dtype) for _ in range(4))
    st = ref.sagebwd_forward(q, k, v, pv="fp16", scores="fp16")
    ext = _fake_ext()
    ops = lab.operands(ext, q, k, v, do, st, 1 / math.sqrt(d))
    kv16, q16, t8 = (ext.layout_table(kind, d) for kind in ("kv16", "q16", "t8"))
    tiles = lambda x, rows: x.reshape(b, h, -1, rows, d)  # noqa: E731
    assert torch.equal(_decode(ops["k"], kv16, dtype), tiles(st.kc, 64))
    assert torch.equal(_decode(ops["v"], kv16, dtype), tiles(st.vc, 64))
    assert torch.equal(_decode(ops["q"], q16, dtype), tiles(st.qc, 64))
    assert torch.equal(_decode(ops["dO"], q16, dtype), tiles(do, 64))
    assert ops["bf16"] == (dtype == torch.bfloat16)

    perm = lab.vt_position_to_query(torch.arange(64))
    inv_l = torch.exp2(st.m2 - st.lse2)
    dos8, sdos = quantize_int8_per_block(do.float() * inv_l[..., None], 64)
    for name, codes in (("qt", st.q8), ("dot", dos8)):
        got = _decode(ops[name], t8, torch.int8)  # (B, H, nq, D, 64): position p of block i
        want = codes.reshape(b, h, -1, 64, d)[:, :, :, perm, :].transpose(-1, -2)
        assert torch.equal(got, want), name

    vec = ops["vec"]
    assert torch.equal(vec[..., 0:64].flatten(2), st.m2)
    assert torch.equal(vec[..., 64:128].flatten(2), inv_l * 2.0 ** 32)
    assert torch.allclose(vec[..., 128:192].flatten(2), (do.float() * st.out.float()).sum(-1))
    assert torch.equal(vec[..., 192], sdos * ref.P_SCALE)
    assert torch.equal(vec[..., 193], st.sq)


def test_shapes_the_kernel_does_not_cover_are_refused():
    q = torch.randn(1, 1, 96, 64)
    st = ref.sagebwd_forward(q, q, q, pv="fp16", scores="fp16")
    with pytest.raises(ValueError, match="Sq % 64"):
        lab.operands(_fake_ext(), q, q, q, q, st, 0.125)


def test_dq_images_hold_the_reference_operands():
    b, h, s, d = 1, 2, 256, 64
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(b, h, s, d, generator=g).to(torch.bfloat16) for _ in range(4))
    st = ref.sagebwd_forward(q, k, v, pv="fp16", scores="fp16")
    ext = _fake_ext(1)
    ops = lab.dq_operands(ext, q, do, st, 1 / math.sqrt(d))
    kv16, t8 = ext.layout_table("kv16", d), ext.layout_table("t8", d)
    tiles = lambda x: x.reshape(b, h, -1, 64, d)  # noqa: E731
    for name, want in (("q", st.qc), ("dO", do), ("k", st.kc), ("v", st.vc)):
        assert torch.equal(_decode(ops[name], kv16, torch.bfloat16), tiles(want)), name
    perm = lab.vt_position_to_query(torch.arange(64))
    assert torch.equal(_decode(ops["kt"], t8, torch.int8), tiles(st.k8)[:, :, :, perm, :].transpose(-1, -2))
    assert torch.equal(ops["k_scale"].view(torch.int32), key_entries_reference(st.sk))  # every key visible
    assert torch.equal(ops["inv_l"], torch.exp2(st.m2 - st.lse2) * 2.0 ** 32)
    assert torch.equal(ops["m"], st.m2)
    with pytest.raises(ValueError, match="Sq % 128"):
        lab.dq_operands(ext, q[:, :, :192], do[:, :, :192], st, 0.125)
    # the bf16 dQ product's operands: the smoothed K's 16-bit tiles in K^T's place
    ks16 = lab.smoothed_k16(k)
    ops16 = lab.dq_operands(ext, q, do, st, 1 / math.sqrt(d), ks16)
    assert torch.equal(_decode(ops16["kt"], kv16, torch.bfloat16), tiles(ks16))
    assert torch.equal(ks16, (k.float() - k.float().mean(2, keepdim=True)).to(torch.bfloat16))


def test_dk16_reference_is_the_reference_dk_without_its_int8_steps():
    """The lab's spec of the bf16 dK product (DkAcc::kBf16InPlace): with the reference's dS, it is the
    reference's dK up to the INT8 steps (the tile-quantized dS and Q^), so it lies closer to float64
    autograd than the reference (the error budget's 16-bit dK), and it sums over queries as dK must
    (a zero dO gives a zero dK)."""
    b, h, s, d = 1, 2, 256, 64
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(b, h, s, d, generator=g).to(torch.bfloat16) for _ in range(4))
    k = k + 3 * torch.randn(1, h, 1, d, generator=g).to(torch.bfloat16)  # per-channel offsets, as DiT keys
    sm_scale = 1 / math.sqrt(d)
    st = ref.sagebwd_forward(q, k, v, pv="fp16", scores="fp16")
    _, dk_ref, _ = ref.sagebwd_backward(do, st, scores="fp16")
    dk16 = lab.dk16_reference(st, do, sm_scale)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd)
    dk64 = torch.autograd.grad(out, kd, do.double())[0]
    from sage_diffusers.reference import relative_l1

    err16, err8 = relative_l1(dk16, dk64), relative_l1(dk_ref, dk64)
    assert err16 < err8 / 3, (err16, err8)
    assert relative_l1(dk16, dk_ref) < 2 * err8
    assert torch.equal(lab.dk16_reference(st, torch.zeros_like(do), sm_scale), torch.zeros_like(dk16))


def test_dq16_reference_needs_the_smoothed_k():
    """The lab's spec of the bf16 dQ product (DqAcc::kBf16InPlace): with the smoothed K in bf16 it lies
    closer to float64 autograd than the reference's INT8 dQ; with K as given (per-channel offsets kept)
    it is several times less accurate, since the rows of dS do not sum to zero exactly and K's mean
    multiplies the residue (on the error budget's flat heads, worse than INT8)."""
    b, h, s, d = 1, 2, 256, 64
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(b, h, s, d, generator=g).to(torch.bfloat16) for _ in range(4))
    k = k + 3 * torch.randn(1, h, 1, d, generator=g).to(torch.bfloat16)
    sm_scale = 1 / math.sqrt(d)
    st = ref.sagebwd_forward(q, k, v, pv="fp16", scores="fp16")
    dq_ref, _, _ = ref.sagebwd_backward(do, st, scores="fp16")
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd)
    dq64 = torch.autograd.grad(out, qd, do.double())[0]
    from sage_diffusers.reference import relative_l1

    err8 = relative_l1(dq_ref, dq64)
    err16 = relative_l1(lab.dq16_reference(st, do, lab.smoothed_k16(k), sm_scale), dq64)
    err_raw = relative_l1(lab.dq16_reference(st, do, k, sm_scale), dq64)
    assert err16 < err8 / 3, (err16, err8)
    assert err_raw > err16 * 2, (err_raw, err16)
