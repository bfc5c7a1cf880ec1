"""Tests written for mutants that survived ``bench/mutation/run.sh`` (see eval/results/mutation.md).

Each test pins a documented behaviour that the rest of the CPU suite never exercised; its docstring
names the mutation it catches. CPU, small shapes, a few seconds in all.
"""
import importlib
import math

import pytest
import torch
import torch.nn.functional as F

import sage_diffusers as sd
from sage_diffusers import _shared, api

from inputs import dit_qkv, exact_attention, key_padding_mask


@pytest.fixture(autouse=True)
def _fresh_stats():
    sd.reset_fallback_stats()


def _row_bias(b: int, sq: int, skv: int, *, seed: int, dead_key: int, dead_row: int) -> torch.Tensor:
    """Additive float mask (B, 1, Sq, Skv) that differs per query row (so it is no key padding):
    random biases, scattered -inf, key ``dead_key`` hidden from every row, query row ``dead_row``
    of batch 0 sees no key."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(b, 1, sq, skv, generator=g)
    bias = bias.masked_fill(torch.rand(b, 1, sq, skv, generator=g) < 0.2, -math.inf)
    bias[..., 0] = 0.0  # every other row keeps key 0
    bias[..., dead_key] = -math.inf
    bias[0, 0, dead_row] = -math.inf
    return bias


# The (Hq, Hkv, Sq, Skv) cases: grouped heads with as many keys as query heads (a head count read
# from the wrong dim goes unnoticed when the two differ), and more heads x batch than keys.
_SHAPES = [(4, 2, 9, 4), (4, 2, 50, 37)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", _SHAPES)
def test_sdpa_path_general_mask_scale_gqa_and_lse(monkeypatch, shape, causal):
    """The SDPA path with a per-row additive mask, a non-default scale, grouped heads and the LSE,
    in one chunk and in chunks of 3 query rows, against float64 attention.

    Catches: the chunk's mask rows taken from row 0 (``attn_mask[..., :kend]`` for a per-row mask),
    the LSE ignoring ``attn_mask``, the causal chunks' SDPA call without ``scale`` or ``enable_gqa``,
    the GQA flag computed from the key length, ``_visible`` with ``>=`` (keys hidden by -inf from
    every row then keep their NaN), and a chunk step computed with ``/`` (a float step)."""
    hq, hkv, sq, skv = shape
    q, k, v = dit_qkv(2, hq, hkv, sq, skv, 64, seed=3)
    bias = _row_bias(2, sq, skv, seed=4, dead_key=skv - 1, dead_row=sq // 2)
    expect, expect_lse = exact_attention(q, k, v, attn_mask=bias, is_causal=causal, scale=0.3)
    k, v = k.clone(), v.clone()
    k[:, :, skv - 1] = math.nan  # hidden from every row by the mask: must not reach any output
    v[:, :, skv - 1] = math.nan
    for chunk in (1 << 24, skv * 2 * hq * 3):
        monkeypatch.setattr(_shared, "CHUNK_ELEMENTS", chunk)
        out, lse = sd.attention(q, k, v, bias, is_causal=causal, scale=0.3, mode="sdpa", return_lse=True)
        torch.testing.assert_close(out.double(), expect, rtol=1e-4, atol=1e-4)  # float32 of sharp rows
        torch.testing.assert_close(lse.double(), expect_lse, rtol=1e-5, atol=1e-5)
        assert (out[0, :, sq // 2] == 0).all() and torch.isneginf(lse[0, :, sq // 2]).all()


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_with_a_mask_is_sdpas_dropout(causal):
    """dropout_p with a key mask (and causal): the same draws as torch SDPA with the same seed.

    Catches: the masked SDPA call (non-causal) and the chunked causal call without ``dropout_p``."""
    q, k, v = dit_qkv(2, 2, 2, 40, 40, 64, seed=5)
    kp = key_padding_mask(2, 40, seed=6)
    mask = kp[:, None, None, :]
    if causal:
        mask = mask & torch.ones(40, 40, dtype=torch.bool).tril()
    torch.manual_seed(0)
    out = sd.attention(q, k, v, dropout_p=0.5, is_causal=causal, key_mask=kp, mode="sdpa")
    torch.manual_seed(0)
    expect = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5)
    torch.testing.assert_close(out, expect)
    torch.manual_seed(0)
    assert not torch.allclose(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("mode", ["sdpa", "int8", "fp4"])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_empty_input_keeps_every_input_in_the_graph(mode, which):
    """Sq = 0: whichever of q, k, v requires grad gets a zero gradient of its shape, as with SDPA.

    Catches: ``_empty_result`` asking ``_needs_grad`` about q and only one of k, v."""
    t = [torch.randn(2, 2, 0, 64), torch.randn(2, 2, 16, 64), torch.randn(2, 2, 16, 64)]
    t[which] = t[which].requires_grad_()
    out = sd.attention(*t, mode=mode)
    assert out.requires_grad
    out.sum().backward()
    assert t[which].grad.shape == t[which].shape and (t[which].grad == 0).all()


def _mask(b: int, skv: int, seed: int) -> torch.Tensor:
    """A (B, 1, Sq, Skv) bool mask whose query rows are all equal: key padding in disguise."""
    return key_padding_mask(b, skv, seed=seed)[:, None, None, :].expand(b, 1, 3, skv).contiguous()


def test_mask_scope_classifies_once_per_tensor_and_forgets_at_exit():
    """Catches: the memo keyed without the owner (a view's geometry alone), kept past the scope, or
    shared by nested scopes incorrectly."""
    calls = []

    def compute(m):
        calls.append(m)
        return m[:, 0, 0, :].clone()

    a, b = _mask(2, 20, 1), _mask(2, 20, 2)
    with api.mask_scope():
        for m in (a, b, a, a[:, :, :, :]):
            assert torch.equal(api.classify_in_scope(m, compute), m[:, 0, 0, :])
        with api.mask_scope():  # nested: the outer scope's answers
            api.classify_in_scope(b, compute)
        assert len(calls) == 2
    assert api.classify_in_scope(a, compute) is None  # no scope: nothing read
    with api.mask_scope():
        api.classify_in_scope(a, compute)
    assert len(calls) == 3


def test_mask_scope_reads_nothing_while_compiling_or_on_meta(monkeypatch):
    """Under torch.compile, and for meta / fake tensors, nothing is read (the mask counts as
    general and runs SDPA). Regression: meta/FakeTensor inputs with a general mask failed in
    int8 / fp4 (``.item()`` on meta)."""
    with api.mask_scope():
        assert api.classify_in_scope(torch.ones(1, 1, 2, 2, device="meta"), lambda m: pytest.fail("read")) is None
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert api.classify_in_scope(_mask(2, 20, 1), lambda m: pytest.fail("the mask was read")) is None


@pytest.mark.parametrize("cap, algo", [(90, "int8"), (120, "fp4"), (121, "fp4"), (80, None), (89, None),
                                       (100, None)])
def test_auto_algorithm_per_arch(cap, algo):
    """"auto" runs INT8 on sm_9x, FP4 on sm_12x and nothing else (the CPU suite never asked)."""
    got = api._auto_algorithm_of(cap)
    assert (got.value if got is not None else None) == algo


def test_resolved_lookups_keep_each_key_apart():
    """What the constant-result lookups resolved is found again under exactly its own key."""
    r = api._Resolved()
    gated, plain = object(), object()
    r.put(gated, "backend", "int8", 90, True)
    r.put(plain, "backend", "int8", 90, False)
    assert r.get("backend", "int8", 90, True) is gated and r.get("backend", "int8", 90, False) is plain
    assert api._Resolved._name("auto_rules", 90) == "auto_rules_90"
    with pytest.raises(AttributeError):
        r.get("backend", "fp4", 90, True)


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("mode", ["int8", "fp4"])
def test_any_one_input_requiring_grad_chooses_the_gradient_path(monkeypatch, mode, which):
    """Whichever one of q, k, v requires grad: "int8" trains through SageBwd, "fp4" runs SDPA
    counted "backward" (never the inference reference, whose gradients are silently wrong).

    Catches: ``_plan`` asking ``_needs_grad`` about only two of q, k, v (either check)."""
    sagebwd = importlib.import_module("sage_diffusers._sagebwd_autograd")  # where the API takes its gradient path
    calls = []
    real = sagebwd.attention_sagebwd
    monkeypatch.setattr(sagebwd, "attention_sagebwd", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    t = list(dit_qkv(1, 2, 2, 24, 24, 64, seed=7))
    t[which] = t[which].requires_grad_()
    sd.attention(*t, mode=mode).sum().backward()
    assert t[which].grad is not None
    assert (len(calls), sd.fallback_stats()) == ((1, {}) if mode == "int8" else (0, {"fp4: backward": 1}))


@pytest.mark.parametrize("mode", ["int8", "fp4"])
def test_a_float_mask_that_requires_grad_runs_sdpa(mode):
    """A float key-padding mask (0 / -inf) that requires grad has no gradient on the low-bit paths
    (SageBwd included): SDPA runs, counted "backward", and the mask gets its gradient.

    Catches: the float mask left out of the gradient decision (always None, or ``_needs_grad(None)``)."""
    q, k, v = dit_qkv(1, 2, 2, 24, 24, 64, seed=8)
    kp = key_padding_mask(1, 24, seed=9)
    bias = torch.zeros(1, 1, 1, 24).masked_fill(~kp[:, None, None, :], -math.inf).requires_grad_()
    qg = q.clone().requires_grad_()
    sd.attention(qg, k, v, bias, mode=mode).sum().backward()
    assert sd.fallback_stats() == {f"{mode}: backward": 1}
    assert bias.grad is not None and qg.grad is not None


def test_sagebwd_path_gets_causal_and_returns_the_lse():
    """mode "int8" with gradients: causal and return_lse reach SageBwd (output and LSE of causal
    attention). Catches: SageBwd called without ``is_causal`` or ``return_lse``."""
    q, k, v = dit_qkv(1, 2, 2, 40, 40, 64, seed=10, dtype=torch.bfloat16)
    qg = q.clone().requires_grad_()
    out, lse = sd.attention(qg, k, v, is_causal=True, mode="int8", return_lse=True)
    expect, expect_lse = exact_attention(q, k, v, is_causal=True)
    assert torch.nn.functional.cosine_similarity(out.detach().double().flatten(), expect.flatten(), 0) > 0.995
    assert lse is not None and (lse.double() - expect_lse).abs().max() < 1e-4


def test_a_bool_key_padding_attn_mask_is_never_read_on_the_host(monkeypatch):
    """A bool (B, 1, 1, Skv) attn_mask is key padding by its shape: used as a view, its values
    never read (no host sync). Catches: the shape test looking at the wrong dim or size."""
    reads = []
    real = api._classify_key_padding
    monkeypatch.setattr(api, "_classify_key_padding", lambda m: reads.append(1) or real(m))
    q, k, v = dit_qkv(2, 2, 2, 24, 24, 64, seed=11)
    kp = key_padding_mask(2, 24, seed=12)
    out = sd.attention(q, k, v, kp[:, None, None, :], mode="int8")
    assert reads == [] and torch.equal(out, sd.attention(q, k, v, key_mask=kp, mode="int8"))


_Q = lambda: torch.randn(2, 2, 16, 64)  # noqa: E731
_K = lambda: torch.randn(2, 2, 16, 64)  # noqa: E731


@pytest.mark.parametrize("args, kwargs, match", [
    ((None, _K(), _K()), {}, r"^q: expected a torch.Tensor, got NoneType"),
    ((_Q(), [1.0], _K()), {}, r"^k: expected a torch.Tensor, got list"),
    ((_Q(), _K(), 3), {}, r"^v: expected a torch.Tensor, got int"),
    ((_Q(), _K(), torch.randn(2, 2, 15, 64)), {}, r"\(H, S\) \(2, 16\) vs \(2, 15\)"),
    ((torch.randn(2, 2, 16, 0), torch.randn(2, 2, 16, 0), _K()), {}, r"^q and k: head dim must be at least 1$"),
    ((_Q(), _K(), _K()), {"key_mask": [True] * 16}, r"^key_mask: expected a tensor or None, got list"),
    ((_Q(), _K(), _K()), {"key_mask": torch.ones(2, 16, dtype=torch.bool, device="meta")},
     r"^key_mask: expected device cpu, got meta"),
    ((_Q(), _K(), _K()), {"key_mask": torch.ones(2, 16, 1, dtype=torch.bool)}, r"^key_mask: expected shape"),
    ((_Q(), _K(), _K(), "mask"), {}, r"^attn_mask: expected a tensor or None, got str"),
    ((_Q(), _K(), _K(), torch.ones(16, 16, dtype=torch.int32)), {}, r"^attn_mask: expected bool or floating"),
    ((_Q(), _K(), _K(), torch.ones(2, 16, dtype=torch.bool)), {}, r"pass key padding as key_mask=\(B, Skv\)\)$"),
])
def test_malformed_input_is_refused_with_a_message_that_names_it(args, kwargs, match):
    """Every malformed argument raises ValueError whose message names it and what it got (the
    existing validation tests check only that something is raised). Catches: messages replaced
    (None, another name, the wrong shape slice) and the key-mask shape test joined with ``and``."""
    with pytest.raises(ValueError, match=match):
        sd.attention(*args, mode="int8", **kwargs)


def test_a_key_mask_of_one_row_broadcasts_over_the_batch():
    """key_mask (1, Skv) is valid for any batch size (one padding pattern for every row).
    Catches: the batch check accepting (2, B) instead of (1, B)."""
    q, k, v = dit_qkv(3, 2, 2, 24, 24, 64, seed=13)
    kp = key_padding_mask(1, 24, seed=14)
    out = sd.attention(q, k, v, key_mask=kp, mode="int8")
    assert torch.equal(out, sd.attention(q, k, v, key_mask=kp.expand(3, 24), mode="int8"))


@pytest.mark.parametrize("mode", ["sdpa", "int8"])
def test_dropout_of_one_is_accepted_like_sdpa(mode):
    """dropout_p = 1.0 is valid SDPA (every weight dropped: zeros). Catches: ``value < 1.0``."""
    q, k, v = dit_qkv(1, 2, 2, 16, 16, 64, seed=15)
    assert (sd.attention(q, k, v, dropout_p=1.0, mode=mode) == 0).all()


def test_the_kernel_branch_hands_every_argument_to_the_backend():
    """``_run_sage`` on a kernel plan calls the backend as the backend contract says:
    backend(q, k, v, *, key_mask, is_causal, scale, return_lse) on BHSD views, float32 rounded to
    bfloat16 first (the CPU suite cannot reach a real kernel). Catches: a dropped argument."""
    seen = {}

    def backend(q, k, v, *, key_mask, is_causal, scale, return_lse):
        seen.update(q=q, k=k, v=v, key_mask=key_mask, is_causal=is_causal, scale=scale, return_lse=return_lse)
        return q, None

    q, k, v = dit_qkv(1, 2, 2, 8, 8, 64, seed=16)
    kp = key_padding_mask(1, 8, seed=17)
    api._run_sage(api.Plan("kernel", api.Mode.INT8, backend), q, k, v, kp, True, 0.25, True)
    assert all(torch.equal(seen[n], t.to(torch.bfloat16)) for n, t in (("q", q), ("k", k), ("v", v)))
    assert seen["key_mask"] is kp and (seen["is_causal"], seen["scale"], seen["return_lse"]) == (True, 0.25, True)


def test_q_block_mean_of_a_single_token_block_is_that_token():
    """A 128-token Q block with one real (or one finite) row has that row as its mean, so the
    smoothed row is 0. Catches: the count clamped to 2 instead of 1 (halving such a mean)."""
    from sage_diffusers.reference.sage3 import smooth_q

    q = torch.randn(1, 2, 129, 64)  # the second block holds one token
    q[0, 1, 1:128] = math.nan  # the first block of head 1 has one finite row, row 0
    qs, qbar = smooth_q(q)
    assert torch.equal(qbar[:, :, 128], q[:, :, 128]) and (qs[:, :, 128] == 0).all()
    assert torch.equal(qbar[0, 1, 0], q[0, 1, 0]) and (qs[0, 1, 0] == 0).all()


def test_sage3_reference_without_k_smoothing_takes_half_precision_inputs():
    """The smooth_k=False ablation on bfloat16 inputs computes from their float32 values, like
    float32 inputs of the same values. Catches: the zero K mean built in the input dtype (then the
    LSE shift multiplies float32 by bfloat16)."""
    from sage_diffusers.reference import sage3_reference

    q, k, v = dit_qkv(1, 2, 2, 40, 40, 64, seed=18, dtype=torch.bfloat16)
    out, lse = sage3_reference(q, k, v, smooth_k=False, return_lse=True)
    ref, ref_lse = sage3_reference(q.float(), k.float(), v.float(), smooth_k=False, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_sage3_reference_follows_its_block_kv():
    """block_kv sets the P~ tiles (their running max and two-level scale): 64-key tiles give other
    P~ codes than 128-key ones, both within the reference's accuracy. Catches: block_kv not
    passed to the tiled loop (the default 128 always)."""
    from sage_diffusers.reference import cosine, sage3_reference

    q, k, v = dit_qkv(1, 2, 2, 64, 256, 64, seed=19)
    out64 = sage3_reference(q, k, v, block_kv=64)
    out128 = sage3_reference(q, k, v, block_kv=128)
    expect, _ = exact_attention(q, k, v)
    assert not torch.equal(out64, out128)
    assert cosine(out64, expect) > 0.97 and cosine(out128, expect) > 0.97


@pytest.mark.parametrize("bad", ["q3d", "k3d", "v5d", "v_len", "heads"])
def test_references_refuse_malformed_shapes_with_a_value_error(bad):
    """The references' own shape check: any operand that is not 4-D, or a V that does not match K,
    raises ValueError naming the shapes. Catches: ``and`` in the 4-D test (a 5-D V passed) and a
    message that fails to build (TypeError instead of the ValueError)."""
    from sage_diffusers.reference import sage3_reference, sage8_reference

    q, k, v = (torch.randn(1, 2, 16, 64) for _ in range(3))
    q = q[0] if bad == "q3d" else (torch.randn(1, 3, 16, 64) if bad == "heads" else q)
    k = k[0] if bad == "k3d" else k
    v = v[..., None] if bad == "v5d" else (v[:, :, :15] if bad == "v_len" else v)
    for ref in (sage8_reference, sage3_reference):
        with pytest.raises(ValueError, match=r"^(expected 4-D|incompatible shapes|query heads \(3\) must be a multiple)"):
            ref(q, k, v)


def test_k_mean_over_a_single_attended_key_is_that_key():
    """The attended-key mean of a batch row with one visible key is that key (count 1, not clamped
    higher). Catches: ``clamp_min(2)`` on the key count."""
    from sage_diffusers.reference._common import attended_mean

    k = torch.randn(2, 2, 10, 64)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, 3] = True
    mask[1, :4] = True
    mean = attended_mean(k, mask)
    torch.testing.assert_close(mean[0, :, 0], k[0, :, 3], rtol=0, atol=0)
    torch.testing.assert_close(mean[1, :, 0], k[1, :, :4].mean(1), rtol=1e-6, atol=1e-6)
