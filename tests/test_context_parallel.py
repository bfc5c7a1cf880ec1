"""Context parallelism on the CPU: diffusers' ring / Ulysses path with the sage_diffusers backends, over gloo.

Workers are separate processes started like torchrun does (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free
MASTER_PORT; this file is their entry point). Each builds the same tiny random transformer (Flux, Wan 2.1,
HunyuanVideo with its padded-text key mask, LTX-Video with its padded-text bias), runs
``sage_diffusers.enable(model, mode=...)`` then ``enable_context_parallel`` (diffusers' ``enable_parallelism``
with the model's plan; ours for HunyuanVideo) and one forward; rank 0 saves the gathered output. The test compares it with the single-process output of the same
mode and with exact attention (single-process SDPA): the CP run must be as accurate as the single-process run.

Every collective our path uses (functional all_gather and all_to_all_single) has a gloo implementation, and
diffusers' split/gather hooks run as they do on GPUs, so the whole CP path runs here; what only the GPU run
covers is NCCL transport and the CUDA int8/fp4 kernels inside it (here the same algorithms run as torch
references). The worker also checks our path directly (random Q/K/V, GQA, a key mask whose shard on one rank
is all padding for a row) against one local call, and ``sage_forward_op`` inside diffusers' own templated
ring / Ulysses functions.
"""
from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflows" / "diffusers"))

import _sage_tiny  # noqa: E402
from _sage_tiny import Family  # noqa: E402

from sage_diffusers.options import Int8Precision, Mode  # noqa: E402
from sage_diffusers.processors.context_parallel import (  # noqa: E402
    context_parallel_attention,
    context_parallel_plan,
    local_joint_key_mask,
)
from sage_diffusers.reference.metrics import cosine, relative_l1  # noqa: E402

FAMILIES = (Family.FLUX, Family.WAN21, Family.HUNYUANVIDEO, Family.LTXVIDEO)
MODES = (Mode.SDPA, Mode.INT8, Mode.FP4)
# name -> (ring_degree, ulysses_degree)
CP_CONFIGS = {"ring2": (2, 1), "ulysses2": (1, 2), "ring2xulysses2": (2, 2)}
# The four-process run (2 cores in CI; its direct checks cover all modes): the masked model in INT8.
WORLD4 = [(Family.HUNYUANVIDEO, "ring2xulysses2", Mode.INT8)]
# Two processes: every family in SDPA (exact) and INT8 under ring and Ulysses; FP4 on the masked model.
WORLD2 = [(f, c, m) for f in FAMILIES for c in ("ring2", "ulysses2") for m in (Mode.SDPA, Mode.INT8)] + [
    (Family.HUNYUANVIDEO, c, Mode.FP4) for c in ("ring2", "ulysses2")]
TEXT_LEN = 8  # text tokens: divisible by every world size here (diffusers splits in equal shards)
WORKER_TIMEOUT_S = 420


# ---------------------------------------------------------------------------------------------------------------
# Worker side


def _inputs(family: Family, model: torch.nn.Module) -> dict:
    """The family's tiny inputs with TEXT_LEN text tokens (HunyuanVideo and LTX-Video: sample 0 has 6 padded ones,
    so rank 0's text shard holds padding too and a mask split like the joint sequence instead of like the keys is
    wrong)."""
    inputs = _sage_tiny.tiny_inputs(family, model)
    g = torch.Generator().manual_seed(7)
    batch = inputs["encoder_hidden_states"].shape[0]
    inputs["encoder_hidden_states"] = torch.randn(batch, TEXT_LEN, _sage_tiny.TEXT_DIM, generator=g)
    if family is Family.FLUX:
        inputs["txt_ids"] = torch.zeros(TEXT_LEN, 3)
    if family in (Family.HUNYUANVIDEO, Family.LTXVIDEO):
        # LTX-Video: the cross-attention keys are the text tokens alone, so rank 1's key shard of sample 0 is
        # all padding (its bias -10000 on every local key, which alone would read as "no mask").
        inputs["encoder_attention_mask"] = _sage_tiny.text_mask(batch, TEXT_LEN, [2, TEXT_LEN]).long()
    return inputs


def _forward(family: Family, mode: Mode, cp: tuple[int, int] | None) -> torch.Tensor:
    import sage_diffusers as sd
    from diffusers.models._modeling_parallel import ContextParallelConfig

    from sage_diffusers.processors.context_parallel import enable_context_parallel

    model = _sage_tiny.tiny_transformer(family)
    sd.enable(model, mode=mode.value)
    if cp is not None:
        enable_context_parallel(model, ContextParallelConfig(ring_degree=cp[0], ulysses_degree=cp[1]))
    with torch.no_grad():
        return model(**_inputs(family, model), return_dict=False)[0]


def _direct_checks(world: int) -> dict:
    """Our path on random BSHD Q/K/V vs one local call; sage_forward_op inside diffusers' templated functions."""
    import functools

    import torch.distributed as dist
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _AttentionBackendRegistry,
        _templated_context_parallel_attention,
    )
    from torch.distributed.device_mesh import init_device_mesh

    import sage_diffusers as sd
    from sage_diffusers.processors.backend import backend_name, register_backend
    from sage_diffusers.processors.context_parallel import sage_backward_op, sage_forward_op
    from sage_diffusers.processors.dispatched import padding_bias_to_keep

    register_backend()
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(3)  # the same global tensors on every rank
    b, s, hq, hkv, d = 2, 64 * world, 4, 2, 64
    q, k, v = (torch.randn(b, s, h, d, generator=g) for h in (hq, hkv, hkv))
    key_mask = torch.rand(b, s, generator=g) > 0.2
    key_mask[1, : s // world] = False  # batch row 1: rank 0's key shard is all padding (lse -inf there)
    shard = slice(rank * s // world, (rank + 1) * s // world)
    results = {}
    degrees = [(world, 1), (1, world)] if world == 2 else [(2, 2)]
    for ring, uly in degrees:
        mesh = init_device_mesh("cpu", (ring, uly), mesh_dim_names=("ring", "ulysses"))
        pc = ParallelConfig(context_parallel_config=ContextParallelConfig(ring_degree=ring, ulysses_degree=uly))
        pc.setup(rank, world, torch.device("cpu"), mesh=mesh)
        exact, exact_lse = sd.attention(q, k, v, key_mask=key_mask, layout="BSHD", mode="sdpa", return_lse=True)
        exact, exact_lse = exact[:, shard], exact_lse[:, :, shard]
        for mode in MODES if world == 2 else (Mode.SDPA, Mode.INT8):  # four processes share 2 CI cores
            full, full_lse = sd.attention(q, k, v, key_mask=key_mask, layout="BSHD", mode=mode, return_lse=True)
            out, lse = context_parallel_attention(q[:, shard], k[:, shard], v[:, shard], mode=mode,
                                                  parallel_config=pc, key_mask=key_mask[:, shard], return_lse=True)
            results[f"direct-r{ring}u{uly}-{mode.value}"] = dict(
                cp=relative_l1(out, exact), single=relative_l1(full[:, shard], exact),
                cp_lse=float((lse - exact_lse).abs().max()),
                single_lse=float((full_lse[:, :, shard] - exact_lse).abs().max()),
            )
        # diffusers' templated CP refuses GQA and reuses one mask for every ring share: equal heads, no mask.
        qe, ke, ve = (t[:, shard, :hkv].contiguous() for t in (q, k, v))
        op = functools.partial(sage_forward_op, mode=Mode.SDPA)
        theirs = _templated_context_parallel_attention(qe, ke, ve, None, 0.0, False, None, False, False,
                                                       forward_op=op, backward_op=sage_backward_op,
                                                       _parallel_config=pc)
        ours = context_parallel_attention(qe, ke, ve, mode=Mode.SDPA, parallel_config=pc)
        results[f"templated-r{ring}u{uly}"] = dict(cp=float((theirs - ours).abs().max()))
        # The backend with a (B, H, 1, Skv) mask (per-head copies of the key padding, as LTX-Video's processor
        # builds it): batch row 1's shard on rank 0 is all padding, which must not read as "these rows see no key".
        heads_mask = key_mask[:, None, None, :].expand(b, hkv, 1, s)
        backend = _AttentionBackendRegistry._backends[AttentionBackendName(backend_name(Mode.SDPA))]
        with sd.mask_scope():
            want = backend(q[..., :hkv, :], k, v, attn_mask=heads_mask)[:, shard]
            got = backend(qe, ke, ve, attn_mask=heads_mask[..., shard].contiguous(), _parallel_config=pc)
        results[f"headsmask-r{ring}u{uly}"] = dict(cp=float((got - want).abs().max()))
        # LTX-Video's additive text-padding bias -> bool keep-mask on each rank's text shard (rank 0's is checked):
        # sample 0 has padding only in rank 0's shard, sample 1 no text at all (SDPA attends uniformly: keep all).
        text = 4 * world
        keep = torch.ones(2, 1, text, dtype=torch.bool)
        keep[0, :, : text // world] = False
        keep[1] = False
        bias = (1 - keep.float()) * -10000.0
        tshard = slice(rank * text // world, (rank + 1) * text // world)
        with sd.mask_scope():
            want = padding_bias_to_keep(bias)[..., tshard]
            got = padding_bias_to_keep(bias[..., tshard].clone(), pc)
        results[f"bias-r{ring}u{uly}"] = dict(cp=float((got != want).sum()))
        # A bias that is padding on rank 0's shard only (a real bias elsewhere): every rank must take the same
        # branch (one collective each; a rank that skipped it left the others waiting) and keep its bias.
        mixed = bias.clone()
        mixed[..., text // world:] = -0.5
        with sd.mask_scope():
            got = padding_bias_to_keep(mixed[..., tshard].clone(), pc)
        results[f"bias-mixed-r{ring}u{uly}"] = dict(cp=float(not torch.equal(got, mixed[..., tshard])))
    return results


def _worker_main(out_dir: str, scenarios: list[list[str]]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    # diffusers' _resolve_parallel_config takes rank % torch.accelerator.device_count(), 0 on a CPU-only host.
    if torch.accelerator.device_count() == 0:
        torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    saved, metrics = {}, {}
    metrics.update(_direct_checks(world))
    for family, cp_name, mode in scenarios:
        out = _forward(Family(family), Mode(mode), CP_CONFIGS[cp_name])
        saved[f"{family}-{cp_name}-{mode}"] = out
    if rank == 0:
        for family in sorted({s[0] for s in scenarios}):
            for mode in sorted({s[2] for s in scenarios if s[0] == family} | {Mode.SDPA.value}):
                saved[f"{family}-single-{mode}"] = _forward(Family(family), Mode(mode), None)
        torch.save(saved, Path(out_dir) / "outputs.pt")
        (Path(out_dir) / "metrics.json").write_text(json.dumps(metrics))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# Test side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, scenarios: list, out_dir: Path) -> tuple[dict, dict]:
    """Run ``world`` worker processes (torchrun's environment) and load rank 0's outputs and metrics."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    arg = json.dumps([[f.value, c, m.value] for f, c, m in scenarios])
    logs = [out_dir / f"rank{r}.log" for r in range(world)]
    procs = []
    for r, log in enumerate(logs):
        with log.open("w") as f:
            procs.append(subprocess.Popen([sys.executable, __file__, str(out_dir), arg], stdout=f,
                                          stderr=subprocess.STDOUT, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))))
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        # A rank that fails leaves the others waiting in a collective: stop them all at the first failure.
        while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        tails = [f"rank {r} (exit {p.returncode}):\n{log.read_text()[-4000:]}" for r, (p, log) in
                 enumerate(zip(procs, logs))]
        pytest.fail("context-parallel workers failed or timed out:\n" + "\n----\n".join(tails))
    outputs = torch.load(out_dir / "outputs.pt", weights_only=True)
    return outputs, json.loads((out_dir / "metrics.json").read_text())


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _launch(2, WORLD2, tmp_path_factory.mktemp("cp2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _launch(4, WORLD4, tmp_path_factory.mktemp("cp4"))


def _assert_cp_as_accurate(outputs: dict, family: Family, cp_name: str, mode: Mode) -> None:
    cp = outputs[f"{family.value}-{cp_name}-{mode.value}"].double()
    single = outputs[f"{family.value}-single-{mode.value}"].double()
    exact = outputs[f"{family.value}-single-sdpa"].double()
    assert cp.shape == exact.shape and torch.isfinite(cp).all()
    if mode is Mode.SDPA:
        assert relative_l1(cp, exact) < 1e-5, relative_l1(cp, exact)
        return
    # Ulysses computes each head over all keys as one call: the same numbers; ring quantizes per key share.
    err_cp, err_single = relative_l1(cp, exact), relative_l1(single, exact)
    assert err_single > 1e-5, "the low-bit path did not run (output equals SDPA)"
    assert err_cp <= 1.5 * err_single + 1e-4, (err_cp, err_single)
    assert 1 - cosine(cp, exact) <= 1.5 * (1 - cosine(single, exact)) + 1e-6


@pytest.mark.parametrize("family,cp_name,mode", WORLD2, ids=[f"{f.value}-{c}-{m.value}" for f, c, m in WORLD2])
def test_two_ranks_match_single_process(world2, family, cp_name, mode):
    _assert_cp_as_accurate(world2[0], family, cp_name, mode)


@pytest.mark.parametrize("family,cp_name,mode", WORLD4, ids=[f"{f.value}-{c}-{m.value}" for f, c, m in WORLD4])
def test_ring_and_ulysses_together_on_four_ranks(world4, family, cp_name, mode):
    _assert_cp_as_accurate(world4[0], family, cp_name, mode)


def test_direct_path_and_diffusers_templated_functions(world2, world4):
    """Random GQA Q/K/V with a key mask (one rank's shard all padding for a row) vs one local call; the backend
    with a per-head (B, H, 1, Skv) key mask; LTX-Video's padding bias read on each rank's text shard."""
    metrics = {**world2[1], **world4[1]}
    assert len([k for k in metrics if k.startswith("direct")]) == 2 * len(MODES) + 2
    for name, m in metrics.items():
        if name.startswith("bias"):  # the keep-mask of each rank's shard, as the single process reads it
            assert m["cp"] == 0, (name, m)
        elif name.startswith(("templated", "headsmask")) or name.endswith("-sdpa"):
            assert m["cp"] < 1e-5 and m.get("cp_lse", 0.0) < 1e-4, (name, m)
        else:  # ring shares quantize on their own: as accurate as one call, not equal to it
            assert m["single"] > 1e-3, (name, m)  # the low-bit path ran
            assert m["cp"] <= 1.5 * m["single"] + 1e-3 and m["cp_lse"] <= 1.5 * m["single_lse"] + 1e-2, (name, m)


# In-process checks (no collectives are reached)


def _fake_config(ring=2, uly=1, **flags):
    return SimpleNamespace(context_parallel_config=SimpleNamespace(ring_degree=ring, ulysses_degree=uly, **flags))


def _qkv(heads=2):
    return [torch.randn(1, 16, heads, 64) for _ in range(3)]


def test_refuses_what_it_cannot_split():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="key-padding masks only"):
        context_parallel_attention(q, k, v, mode=Mode.SDPA, parallel_config=_fake_config(),
                                   attn_mask=torch.zeros(16, 16))
    with pytest.raises(ValueError, match="is_causal"):
        context_parallel_attention(q, k, v, mode=Mode.SDPA, parallel_config=_fake_config(), is_causal=True)
    with pytest.raises(ValueError, match="even shards"):
        context_parallel_attention(q, k, v, mode=Mode.SDPA, parallel_config=_fake_config(ring_anything=True))
    with pytest.raises(ValueError, match="divisible by ulysses_degree"):
        context_parallel_attention(*_qkv(heads=3), mode=Mode.SDPA, parallel_config=_fake_config(1, 2))
    q.requires_grad_(True)
    with pytest.raises(NotImplementedError, match="inference only"):
        context_parallel_attention(q, k, v, mode=Mode.SDPA, parallel_config=_fake_config())


def test_backend_routes_parallel_config_and_is_declared():
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    from sage_diffusers.processors.backend import BACKEND_NAMES, POLICY_BACKEND_NAME, register_backend

    register_backend()
    assert set(BACKEND_NAMES.values()) | {POLICY_BACKEND_NAME} <= _AttentionBackendRegistry._supports_context_parallel
    from sage_diffusers.processors.backend import sage_attention_backend

    q, k, v = _qkv()
    with pytest.raises(ValueError, match="is_causal"):  # reached the CP path, which refuses causal
        sage_attention_backend(q, k, v, is_causal=True, _parallel_config=_fake_config())


def test_local_joint_key_mask_layout():
    """[latent; text] over the global sequence -> [latent shard r; text shard r], as the ranks hold their keys."""
    latent, text = torch.arange(12), torch.arange(100, 104)
    mask = torch.cat([latent, text])[None, None, None, :]  # values stand for positions
    got = local_joint_key_mask(mask, latent_len=12, world=2, rank=1)
    assert got.flatten().tolist() == [6, 7, 8, 9, 10, 11, 102, 103]


def test_plans():
    hv = _sage_tiny.tiny_transformer(Family.HUNYUANVIDEO)
    plan = context_parallel_plan(hv)
    assert set(plan) == {"rope", "transformer_blocks.0", "proj_out"}
    flux = _sage_tiny.tiny_transformer(Family.FLUX)
    assert context_parallel_plan(flux) is flux._cp_plan


def test_enable_after_enable_parallelism_keeps_the_parallel_config():
    """sd.enable after enable_parallelism: the new processors must carry the config, or attention goes local."""
    import sage_diffusers as sd

    model = _sage_tiny.tiny_transformer(Family.FLUX)
    config = _fake_config()
    for module in model.modules():
        if hasattr(getattr(module, "processor", None), "_parallel_config"):
            module.processor._parallel_config = config  # what enable_parallelism does
    sd.enable(model, mode="int8")
    processors = [m.processor for m in model.modules() if hasattr(m, "processor")]
    assert processors and all(p._parallel_config is config for p in processors)
    assert all(type(p).__module__.startswith("sage_diffusers") for p in processors)


def test_bench_arguments_and_tiny_single_process_report(tmp_path, monkeypatch):
    """eval/context_parallel_bench.py: its options, and its tiny path on one process (the CP runs need torchrun)."""
    sys.path.insert(0, str(ROOT / "eval"))
    import context_parallel_bench as bench

    args = bench.parse_args([])
    assert args.models == ["hunyuanvideo", "wan21-14b"] and args.out == bench.DEFAULT_OUT
    runs = [f"{p.value}/{b.value}" for p, b in bench.runs(2)]
    assert runs[:3] == ["single/diffusers", "single/int8", "ring/diffusers"] and len(runs) == 8
    assert bench.diffusers_backend(bench.Parallel.RING) == "_native_cudnn"
    assert bench.latent_tokens(bench.MODELS["wan21-14b"], quick=False) == 21 * 45 * 80
    assert bench.command_line(["--models", "wan21-14b"], 2) == (
        "torchrun --nproc-per-node 2 eval/context_parallel_bench.py --models wan21-14b")
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "report"
    assert bench.main(["--tiny", "--models", "wan21-14b", "--iters", "1", "--warmup", "0", "--out", str(out)]) == 0
    report = out.with_suffix(".md").read_text()
    assert "| wan21-14b | single | native |" in report and "| wan21-14b | single | sage_diffusers int8 |" in report
    assert "Command: `python eval/context_parallel_bench.py --tiny" in report


if __name__ == "__main__":
    _worker_main(sys.argv[1], json.loads(sys.argv[2]))


def test_backends_keep_their_int8_precision_under_context_parallelism():
    """A pinned-precision backend reaches the shares' calls through the context-parallel path (one rank here:
    no collective), and diffusers' forward_op convention takes it bound like the mode."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    from _util import record_int8_precisions
    from sage_diffusers.processors.backend import backend_name, register_backend
    from sage_diffusers.processors.context_parallel import sage_forward_op

    register_backend()
    q, k, v = _qkv()
    with record_int8_precisions() as seen:
        for precision in ("fast", "accurate"):
            backend = _AttentionBackendRegistry._backends[AttentionBackendName(backend_name(Mode.INT8, precision))]
            cp = backend(q, k, v, _parallel_config=_fake_config(1, 1))
            local = backend(q, k, v)
            op = functools.partial(sage_forward_op, mode=Mode.INT8, int8_precision=precision)(None, q, k, v)
            torch.testing.assert_close(cp, local, rtol=0, atol=0)
            torch.testing.assert_close(op, local, rtol=0, atol=0)
    assert [Int8Precision.parse(p).value for p in seen] == ["fast"] * 3 + ["accurate"] * 3
