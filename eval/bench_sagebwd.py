"""SageBwd on one GPU: forward, backward and forward + backward time against torch SDPA.

    python eval/bench_sagebwd.py              # hd64 and hd128, 4K-32K tokens (H200: a few minutes)
    python eval/bench_sagebwd.py --quick      # two shapes, fewer rounds
    python eval/bench_sagebwd.py --methods sagebwd,sagebwd_scores_int8,sdpa_cudnn --shapes 1x24x16384x128,1x48x16384x64
                                              # the default against the paper's INT8 scores and cuDNN
    SAGE_DIFFUSERS_TRITON_AUTOTUNE=3 python eval/bench_sagebwd.py --compare
                                              # the kernel variants per pass, 4K and 16K (H200: < 4 min)
    SAGE_DIFFUSERS_TRITON_AUTOTUNE=3 python eval/bench_sagebwd.py --compare --passes fwd+bwd \
        --methods sagebwd_split,sagebwd_lean,sagebwd_fused,sagebwd_sm90,sdpa_cudnn --shapes 1x24x16384x128,1x48x16384x64
                                              # the backward kernel choices side by side
    python eval/bench_sagebwd.py --sass       # no GPU: per-tile SASS issue estimates for sm_90a
    python eval/bench_sagebwd.py --realistic  # gradients on the realistic inputs (sharp heads, tails, masks)
    python eval/bench_sagebwd.py --mask-cost  # a key-padding mask's cost against the kept keys alone

Writes eval/results/sagebwd_<gpu>.{json,md}, e.g. sagebwd_h100 (``--compare``: sagebwd_variants_<gpu>).

- Inputs: bf16 BHSD from ``bench/bench_utils.py``'s ``make_inputs`` (Q, V ~ N(0, 1),
  K = N(0, 1) + 4 N(0, 1) per channel), dO ~ N(0, 1).
- Methods: ``sagebwd`` (``sage_diffusers.sagebwd`` with the default kernels and precisions, the
  whole call: quantization pre-passes included); ``sagebwd_acc_alu``: the same with the backward's int32
  products and the forward's scores converted by ALU instructions instead of the conversion unit
  (``SAGE_DIFFUSERS_SAGEBWD_ACC=alu``); ``sagebwd_split``, ``sagebwd_lean``, ``sagebwd_fused``:
  ``sagebwd_sm90``: the backward kernel choices of ``SAGE_DIFFUSERS_SAGEBWD_BWD`` (``BwdKernels``: dK/dV
  and dQ kernels as before, the register-lean dK/dV kernel, dQ fused into it by atomic adds, Hopper's
  CUDA kernels with their image pre-pass where they apply);
  ``sagebwd_dov_int8`` (the dO.V^T INT8 ablation); ``sagebwd_scores_int8`` (``scores="int8"``:
  Q.K^T and P~.V in INT8 as well, the paper's SageBwd; the default computes them in 16 bits);
  ``sdpa_cudnn`` and ``sdpa_flash`` (``F.scaled_dot_product_attention`` under
  ``sdpa_kernel``). The environment of a method is set around each of its calls (the kernels
  read it at call time).
- Passes: ``fwd`` the forward alone (no autograd graph); ``bwd`` ``torch.autograd.grad`` for dQ,
  dK, dV of one saved forward (``retain_graph``); ``fwd+bwd`` both.
- Warm-up compiles and autotunes every kernel variant at the first shape of its head dim (not
  timed; each line printed carries the elapsed time; the autotuner's choices are recorded). ``SAGE_DIFFUSERS_TRITON_AUTOTUNE=N`` tunes over the first N configs of each
  list only (the lists put the likeliest Hopper winners first), which bounds the compile time.
- Timing: ``bench/bench_utils.py``'s ``interleaved``: rounds in which every method runs
  once, in rotating order, each the mean of back-to-back calls between CUDA events; min / median /
  max over the rounds. Speed-up = median cuDNN time / median time.
- TOPS: forward 4 B H S^2 D, backward 2.5 times that (five matmuls of which two are the
  recomputation), halved for causal.
- Accuracy (each head dim, at 4096 tokens): cos and relative L1 of O, dQ, dK, dV against float32
  SDPA (math backend) on the same inputs, for dO.V^T in 16 bits and INT8 (``--compare``: for
  each SageBwd method).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench/, eval/
import sage_diffusers as sd  # noqa: E402
from sage_diffusers import config  # noqa: E402
from bench import bench_utils  # noqa: E402
from eval import _cli  # noqa: E402
from eval.calibrate_auto import gpu_slug  # noqa: E402
from sage_diffusers.kernels._timing import spread  # noqa: E402
from sage_diffusers.reference import cosine, relative_l1  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ACC_TOKENS = 4096
SDPA_BACKENDS = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}
PASSES = ("fwd", "bwd", "fwd+bwd")
# The environment each SageBwd method runs under (read by the kernels at call time).
METHOD_ENV = {
    "sagebwd": {},
    "sagebwd_dov_int8": {},
    "sagebwd_scores_int8": {},  # an argument (sagebwd_options), not the environment
    "sagebwd_acc_alu": {"SAGE_DIFFUSERS_SAGEBWD_ACC": "alu"},
    "sagebwd_split": {"SAGE_DIFFUSERS_SAGEBWD_BWD": "split"},
    "sagebwd_lean": {"SAGE_DIFFUSERS_SAGEBWD_BWD": "lean"},
    "sagebwd_fused": {"SAGE_DIFFUSERS_SAGEBWD_BWD": "fused"},
    "sagebwd_sm90": {"SAGE_DIFFUSERS_SAGEBWD_BWD": "sm90"},
}
COMPARE_METHODS = "sagebwd,sagebwd_acc_alu,sagebwd_lean,sagebwd_fused,sdpa_cudnn"
COMPARE_SHAPES = [(1, 24, 16384, 128), (1, 48, 16384, 64), (1, 24, 4096, 128), (1, 48, 4096, 64)]


def make_inputs(b, h, s, d, seed=0):
    """[q, k, v, do]: the shared benchmark inputs and dO ~ N(0, 1), bf16 (b, h, s, d) on CUDA."""
    q, k, v = bench_utils.make_inputs(b, h, s, d, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    return [q, k, v, torch.randn(b, h, s, d, generator=g, device="cuda").to(torch.bfloat16)]


def sagebwd_options(method: str) -> dict:
    """The ``sd.sagebwd`` precision arguments of a SageBwd method: dov and scores (explicit, so a
    ``SAGE_DIFFUSERS_SAGEBWD_SCORES`` in the caller's environment changes no method; the package's
    default scores unless the method names INT8)."""
    return dict(dov="int8" if method == "sagebwd_dov_int8" else "fp16",
                scores="int8" if method == "sagebwd_scores_int8" else config.SAGEBWD_SCORES.default)


def attention_fn(method: str, causal: bool):
    if method.startswith("sagebwd"):
        opts = sagebwd_options(method)
        return lambda q, k, v: sd.sagebwd(q, k, v, is_causal=causal, **opts)

    def run(q, k, v):
        with sdpa_kernel(SDPA_BACKENDS[method]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def warm_up(fn) -> dict:
    """Run ``fn`` once (JIT, autotuning, cuDNN plans) and return the fallbacks it recorded,
    ``{reason: count}``: a SageBwd method whose call ran other kernels than it names (the sm90 backward
    refusing a causal or masked call, say) is labelled so in the tables instead of timed under its name."""
    with sd.recorded_fallbacks() as seen:
        fn()
        torch.cuda.synchronize()
    return dict(seen)


def fell_back_note(reasons: dict) -> str:
    """' (fell back: <reasons>)' for a table's method cell, '' when the method ran as named."""
    return f" (fell back: {'; '.join(sorted(reasons))})" if reasons else ""


@contextlib.contextmanager
def method_env(method: str):
    """The method's environment variables (METHOD_ENV) set for the duration, then restored."""
    env = METHOD_ENV.get(method, {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def step_fn(method: str, causal: bool, pass_: str, q, k, v, do):
    """A no-argument callable running one ``pass_`` of ``method`` under its environment."""
    fn = attention_fn(method, causal)
    if pass_ == "fwd":
        def step():
            with torch.no_grad(), method_env(method):
                fn(q, k, v)
        return step
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    if pass_ == "bwd":
        with method_env(method):
            out = fn(qg, kg, vg)

        def step():
            with method_env(method):
                torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)
        return step

    def step():
        with method_env(method):
            out = fn(qg, kg, vg)
            torch.autograd.grad(out, (qg, kg, vg), do)
    return step


def accuracy(q, k, v, do, causal: bool, variants: dict) -> dict:
    """{"<label>/<O|dQ|dK|dV>": {cos, rel_l1}} against float32 math SDPA, for each
    ``variants`` label -> method."""
    ref = [t.float().detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        out_ref = F.scaled_dot_product_attention(*ref, is_causal=causal)
    grads_ref = torch.autograd.grad(out_ref, ref, do.float())
    del ref
    res = {}
    for label, method in variants.items():
        x = [t.detach().requires_grad_() for t in (q, k, v)]
        try:
            with method_env(method):
                out = attention_fn(method, causal)(*x)
                grads = torch.autograd.grad(out, x, do)
        except Exception as exc:  # noqa: BLE001 - reported in the table, the timing still runs
            print(f"accuracy {label} FAILED: {type(exc).__name__}: {exc}"[:400], flush=True)
            continue
        for name, a, b in zip(("O", "dQ", "dK", "dV"), (out, *grads), (out_ref, *grads_ref)):
            res[f"{label}/{name}"] = dict(cos=cosine(a, b), rel_l1=relative_l1(a, b))
    return res


NAMES_OUT = ("O", "dQ", "dK", "dV")
REALISTIC_SHAPES = ((2, 4, 2, 1000, 1000, 128, False, torch.bfloat16), (1, 4, 4, 777, 1531, 64, True, torch.float16))
REALISTIC_METHODS = {"SageBwd (default)": "sagebwd", "dP int8 (ablation)": "sagebwd_dov_int8",
                     "INT8 scores (the paper's)": "sagebwd_scores_int8"}
REALISTIC_SDPA = "SDPA in the input dtype"  # the attainable: torch SDPA's gradients, cast as ours are


def realistic_accuracy(out: Path) -> None:
    """--realistic: O, dQ, dK, dV of SageBwd (REALISTIC_METHODS) and of torch SDPA in the input dtype
    against float32 attention on the realistic inputs (``sage_diffusers.realistic.CASES``), masked
    keys' NaN zeroed for the reference and SDPA; a gradient is "finite" where float32 attention's,
    cast to the input dtype, is."""
    from sage_diffusers import realistic

    t0 = time.time()
    rows = []
    for b, hq, hkv, sq, skv, d, causal, dtype in REALISTIC_SHAPES:
        for case in realistic.CASES:
            q, k, v, mask = realistic.case_inputs(case, b, hq, hkv, sq, skv, d, seed=5, dtype=dtype, device="cuda")
            do = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to("cuda", dtype)
            hidden = None if mask is None else ~mask[:, None, :, None]
            x = [t.detach().float().requires_grad_() for t in
                 (q, *((t if hidden is None else t.masked_fill(hidden, 0.0)) for t in (k, v)))]
            m = None if mask is None else mask[:, None, None, :]
            if causal:
                tri = torch.ones(sq, skv, dtype=torch.bool, device="cuda").tril()
                m = tri if m is None else m & tri
            with sdpa_kernel(SDPBackend.MATH):
                want_o = F.scaled_dot_product_attention(*x, attn_mask=m, enable_gqa=hq != hkv)
            want = [want_o.detach(), *torch.autograd.grad(want_o, x, do.float())]
            for label, method in [*REALISTIC_METHODS.items(), (REALISTIC_SDPA, None)]:
                if method is None:  # torch SDPA on the 16-bit inputs (masked keys zeroed: NaN there would spread)
                    xs = [t.detach().to(dtype).requires_grad_() for t in x]
                    o = F.scaled_dot_product_attention(*xs, attn_mask=m, enable_gqa=hq != hkv)
                    got = [o.detach(), *torch.autograd.grad(o, xs, do)]
                else:
                    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                    with method_env(method):
                        o = sd.sagebwd(*xs, is_causal=causal, key_mask=mask, **sagebwd_options(method))
                        got = [o.detach(), *torch.autograd.grad(o, xs, do)]
                row = dict(shape=f"{b}x{hq}/{hkv}x{sq}x{skv}x{d}", causal=causal, dtype=str(dtype).split(".")[-1],
                           case=case.name, method=label)
                for name, g, w in zip(NAMES_OUT, got, want):
                    row[name] = dict(cos=cosine(g, w), rel_l1=relative_l1(g, w),
                                     finite_ok=bool(torch.isfinite(g)[torch.isfinite(w.to(dtype))].all()))
                rows.append(row)
                print(f"[{time.time() - t0:5.1f}s] {row['shape']} {case.name:34s} {label:28s} " + " ".join(
                    f"{n} {row[n]['cos']:.5f}" for n in NAMES_OUT), flush=True)
    lines = [f"# SageBwd on realistic inputs ({torch.cuda.get_device_name()})", "",
             f"torch {torch.__version__}; `eval/bench_sagebwd.py --realistic` in {time.time() - t0:.0f} s. "
             "cos / rel-L1 against float32 attention (math SDPA; masked keys' NaN zeroed there) of the output and "
             "the gradients; `inf` marks a result that is not finite where float32 attention's, cast to the "
             f"input dtype, is. `{REALISTIC_SDPA}`: torch SDPA (its default backend) on the same 16-bit inputs "
             "(masked keys zeroed), what a 16-bit attention can attain.", "",
             "| shape | dtype | causal | case | method | O | dQ | dK | dV |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[n]['cos']:.5f} / {r[n]['rel_l1']:.4f}" + ("" if r[n]["finite_ok"] else " inf") for n in NAMES_OUT]
        lines.append(f"| {r['shape']} | {r['dtype']} | {int(r['causal'])} | {r['case']} | {r['method']} | "
                     + " | ".join(cells) + " |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))
    print("wrote", out.with_suffix(".md"))


def tuned_configs() -> dict:
    """{kernel: {autotune key: chosen config}} of the SageBwd Triton kernels run so far."""
    from sage_diffusers.kernels import sagebwd_triton as K

    out = {}
    for name in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_fused_kernel", "_bwd_dq_kernel"):
        cache = getattr(getattr(K, name, None), "cache", None)
        if cache:
            out[name] = {str(key): str(cfg) for key, cfg in cache.items()}
    return out


MASK_COST_SHAPES = [(1, 24, 16384, 128), (1, 48, 16384, 64), (1, 24, 4096, 128)]
# trailing padding keeping this share of the keys, or "text-first": 512 text tokens first, 77 kept
# (Flux's, QwenImage's, Chroma's joint layout: whole key tiles masked inside the attended extent)
MASK_COST_KEEP = (0.5, 0.75, 0.95, "text-first")
TEXT_FIRST = (512, 77)


def mask_cost(out: Path, methods: list, shapes: list, rounds: int, target_ms: float, note: str = "") -> None:
    """--mask-cost: forward + backward of each SageBwd method with a key-padding mask keeping a
    fraction of Skv = S keys, against the same method unmasked over only the kept keys (Skv = kept,
    same queries): the mask's own cost. Causal against unmasked at the same shape is in the main table."""
    t0 = time.time()
    rows = []
    torch.backends.cuda.matmul.allow_tf32 = False
    for b, h, s, d in shapes:
        q, k, v, do = make_inputs(b, h, s, d)
        for keep in MASK_COST_KEEP:
            mask = torch.zeros(b, s, dtype=torch.bool, device="cuda")
            if keep == "text-first":
                mask[:, :TEXT_FIRST[1]] = True
                mask[:, TEXT_FIRST[0]:] = True
            else:
                mask[:, :int(round(keep * s / 128)) * 128] = True  # whole 128-key tiles: the sm90 kernels' unit
            kept = int(mask[0].sum())
            steps = {}
            for m in methods:
                opts = sagebwd_options(m)
                qg = q.detach().requires_grad_()
                km, vm = (t.detach().requires_grad_() for t in (k, v))
                ku, vu = (t[:, :, mask[0]].detach().requires_grad_() for t in (k, v))

                def masked(m=m, opts=opts, qg=qg, km=km, vm=vm, do=do):
                    with method_env(m):
                        o = sd.sagebwd(qg, km, vm, key_mask=mask, **opts)
                        torch.autograd.grad(o, (qg, km, vm), do)

                def unmasked(m=m, opts=opts, qg=qg, ku=ku, vu=vu, do=do):
                    with method_env(m):
                        o = sd.sagebwd(qg, ku, vu, **opts)
                        torch.autograd.grad(o, (qg, ku, vu), do)

                steps[f"{m} masked"], steps[f"{m} kept only"] = masked, unmasked
            fell_back = {name: warm_up(fn) for name, fn in steps.items()}
            times = bench_utils.interleaved(steps, tuple, rounds, target_ms=target_ms)
            for m in methods:
                a, u = spread(times[f"{m} masked"]), spread(times[f"{m} kept only"])
                rows.append(dict(shape=f"{b}x{h}x{s}x{d}", keep=keep, kept=kept, method=m, masked=a, kept_only=u,
                                 cost=a["median"] / u["median"] - 1.0,
                                 fell_back={**fell_back[f"{m} masked"], **fell_back[f"{m} kept only"]}))
                print(f"[{time.time() - t0:6.1f}s] {b}x{h}x{s}x{d} keep {keep} {m:20s} masked {a['median']:.3f} ms, "
                      f"kept only {u['median']:.3f} ms: {100 * rows[-1]['cost']:+.1f} %", flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()
    lines = [f"# SageBwd key-padding mask cost ({torch.cuda.get_device_name()})", "",
             f"torch {torch.__version__}, triton {__import__('triton').__version__}; `eval/bench_sagebwd.py --mask-cost`, "
             f"{rounds} interleaved rounds of about {target_ms:.0f} ms per method, in {time.time() - t0:.0f} s; "
             "autotune " + os.environ.get("SAGE_DIFFUSERS_TRITON_AUTOTUNE", "1") + ". Forward + backward, bf16. "
             "Masked: Skv = S keys, the first `kept` attended (`key_mask`), or text-first: keys 77-511 masked. Kept only: the same call on the kept "
             "keys alone, unmasked. Cost = masked median / kept-only median - 1." + note, "",
             "| shape | keep | method | masked ms min / median / max | kept only ms | cost |", "|---|---|---|---|---|---|"]
    for r in rows:
        a, u = r["masked"], r["kept_only"]
        keep = r["keep"] if isinstance(r["keep"], str) else f"{r['keep']:.2f}"
        lines.append(f"| {r['shape']} | {keep} ({r['kept']}) | {r['method']}{fell_back_note(r['fell_back'])} | "
                     f"{a['min']:.3f} / {a['median']:.3f}"
                     f" / {a['max']:.3f} | {u['min']:.3f} / {u['median']:.3f} / {u['max']:.3f} | {100 * r['cost']:+.1f} % |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))
    print("wrote", out.with_suffix(".md"))


# Static analysis: every kernel compiled for sm_90a on any machine (Triton ships ptxas and
# cuobjdump), its innermost loops counted in SASS. Pointer arguments are int8 unless named here.
_SASS_FLOAT_PTRS = {"sq_ptr", "sk_ptr", "sv_ptr", "m_ptr", "lse_ptr", "delta_ptr", "sdo_ptr", "sdos_ptr", "dk_ptr",
                    "dv_ptr", "dq_ptr", "mb_ptr", "invl_ptr"}
_SASS_BF16_PTRS = {"vc_ptr", "do_ptr", "o_ptr", "qc_ptr", "kc_ptr"}
_XU_OPS = ("I2F", "I2FP", "F2I", "F2IP", "F2F", "MUFU", "FCHK")  # the 16-per-clock-per-SM pipe


def _sass_loops(kernel, consts: dict, num_warps: int, num_stages: int) -> dict:
    """Compile ``kernel`` (a jit function, or autotuned) for sm_90a; registers, stack bytes and,
    for its innermost loops, SASS instructions per warp per iteration and those on the XU pipe."""
    import collections
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    sig, attrs = {}, {}
    for i, a in enumerate(kernel.arg_names):
        if a in consts:
            sig[a] = "constexpr"
        elif a.endswith("_ptr"):
            sig[a] = ("*fp32" if a in _SASS_FLOAT_PTRS else "*bf16" if a in _SASS_BF16_PTRS
                      else "*i32" if a == "kext_ptr" else "*i8")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[a] = "fp32" if a.endswith("scale") else "i32"
            if a in ("SQ", "SKV", "SQT", "SKVT"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    ck = triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=num_warps, num_stages=num_stages))
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        sass = subprocess.run([tools / "cuobjdump", "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tools / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    lines = [(int(a, 16), ins) for a, ins in re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, re.M)]
    loops = []
    for addr, ins in lines:
        target = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?(0x[0-9a-f]+)", ins)
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    counts = []
    for lo, hi in inner:
        body = [re.sub(r"^@!?U?P\w+\s+", "", ins) for a, ins in lines if lo <= a <= hi]
        names = [ins.split()[0] for ins in body]
        ops = collections.Counter(n.split(".")[0] for n in names)
        counts.append(dict(instr=sum(ops.values()), xu=sum(ops[k] for k in _XU_OPS), spill=ops["LDL"] + ops["STL"],
                           gmma=ops["HGMMA"] + ops["IGMMA"], mma=ops["HMMA"] + ops["IMMA"],
                           # what serializes a step: CTA-wide barriers, and waits for every wgmma in flight
                           bar=sum(n.startswith("BAR.SYNC") for n in names),
                           wait0=sum(bool(re.match(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0\b", ins)) for ins in body)))
    return dict(regs=int(re.search(r"REG:(\d+)", res).group(1)), stack=int(re.search(r"STACK:(\d+)", res).group(1)),
                loops=counts)


def sass_report(out: Path) -> None:
    """--sass: each kernel's per-tile issue estimate at hd128 and hd64 from sm_90a SASS."""
    from sage_diffusers.kernels import sagebwd_triton as K

    t0 = time.time()
    rows = []
    for d in (128, 64):
        base = dict(D=d, HAS_MASK=False, IS_CAUSAL=False, DOT16_AS_F32=False, QK16=False)
        bwd = dict(base, DOV_INT8=False)
        cases = [  # (kernel, constexprs, launch configs)
            ("fwd", K._fwd_kernel, dict(base, BLOCK_N=64, BLOCK_Q=64, PV_INT8=True, ACC_XU=True), K._FWD_CONFIGS),
            ("dK/dV", K._bwd_dkdv_kernel, dict(bwd, SUB=64, ACC_XU=True, DW=d, FUSE_DQ=False, DV_LAST=False),
             K._DKDV_CONFIGS),
            ("dQ", K._bwd_dq_kernel, dict(bwd, SUB=64, ACC_XU=True), K._DQ_CONFIGS),
            ("dK/dV lean", K._bwd_dkdv_kernel,
             dict(bwd, SUB=64, ACC_XU=True, DW=min(d, K.LEAN_COLUMNS), FUSE_DQ=False, DV_LAST=True), K._DKDV_CONFIGS),
            ("fused", K._bwd_fused_kernel,
             dict(bwd, SUB=64, ACC_XU=True, DW=min(d, K.LEAN_COLUMNS), FUSE_DQ=True, DV_LAST=True), K._FUSED_CONFIGS),
        ]
        # scores="fp16": 16-bit Q.K^T (and P~.V in the forward), the default backward kernels of the head dim
        cases += [(f"{name} qk16", kernel, dict(consts, QK16=True, **({"PV_INT8": False} if name == "fwd" else {})),
                   configs) for name, kernel, consts, configs in cases if name in ("fwd", "dQ", "dK/dV lean", "fused")]
        # a key-padding mask on the 16-bit-score kernels: the per-key test every visited tile runs
        cases += [(f"{name} masked", kernel, dict(consts, HAS_MASK=True), configs)
                  for name, kernel, consts, configs in cases if name.endswith("qk16")]
        for name, kernel, consts, configs in cases:
            for cfg in configs[:3]:
                c = dict(consts, **cfg.kwargs)
                info = _sass_loops(kernel, c, cfg.num_warps, cfg.num_stages)
                tiles = max(cfg.kwargs.values(), default=64) // 64  # 64 x 64 tiles per loop iteration
                per_smsp = cfg.num_warps // 4  # warps of one CTA on each of the SM's 4 schedulers
                for i, lp in enumerate(info["loops"]):
                    # one instruction issued per cycle per scheduler; the XU pipe takes 8 cycles a warp
                    issue = lp["instr"] * per_smsp / tiles
                    xu = lp["xu"] * per_smsp * 8 / tiles
                    rows.append(dict(d=d, kernel=name, loop=i + 1,
                                     config=f"{cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}",
                                     regs=info["regs"], stack=info["stack"], **lp,
                                     issue_cycles_per_tile=issue, xu_cycles_per_tile=xu, bound=max(issue, xu)))
                    print(f"[{time.time() - t0:5.1f}s] hd{d} {name:5s} {rows[-1]['config']:28s} regs {info['regs']} "
                          f"stack {info['stack']} loop {lp['instr']} instr ({lp['xu']} XU, {lp['spill']} spill) "
                          f"-> {max(issue, xu):.0f} cycles/tile", flush=True)
    import triton

    lines = ["# SageBwd Triton kernels: SASS for sm_90a, per-tile issue estimate", "",
             f"triton {triton.__version__} (its ptxas), compiled without a GPU by `eval/bench_sagebwd.py --sass`; "
             "bf16, not causal, no mask except the `masked` rows (a key-padding mask); each config list's first "
             "three. Per innermost loop, numbered in code order (the kernels run one loop for tiles without bounds or causal tests and one for the "
             "others, which in this case only the last partial block would enter): SASS instructions per "
             "warp per iteration, of which on the XU pipe (conversions, exp2, division checks: 16 lanes per "
             "clock per SM), local-memory spill instructions, and tensor-core instructions (HGMMA/IGMMA = wgmma, "
             "HMMA/IMMA = mma.sync), CTA-wide barriers (BAR.SYNC) and waits for all of the warpgroup's wgmma groups (WARPGROUP.DEPBAR.LE gsb0, 0x0: none left in flight, so the product is serialized with what follows). Cycles per 64x64 tile = max(instructions x "
             "warps per scheduler, XU instructions x warps per scheduler x 8) / tiles per iteration: a lower "
             "bound from issue alone (no stalls, no memory), for comparing variants, not a measurement.", "",
             "| hd | kernel | config | loop | regs | stack B | instr/iter | XU | spill | wgmma / mma.sync | BAR.SYNC | wgmma waits | issue | XU cycles | cycles/tile |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['d']} | {r['kernel']} | {r['config']} | {r['loop']} | {r['regs']} | {r['stack']} | "
                     f"{r['instr']} | {r['xu']} | {r['spill']} | {r['gmma']} / {r['mma']} | {r['bar']} | {r['wait0']} | {r['issue_cycles_per_tile']:.0f} | "
                     f"{r['xu_cycles_per_tile']:.0f} | {r['bound']:.0f} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("wrote", out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compare", action="store_true",
                    help=f"kernel variants side by side: {COMPARE_METHODS} at {COMPARE_SHAPES}, passes {PASSES}")
    ap.add_argument("--causal", action="store_true", help="with --compare: also the 16K shapes causal")
    ap.add_argument("--rounds", type=_cli.positive_int, default=None,
                    help="default 7 (5 with --compare, 3 with --quick)")
    ap.add_argument("--target-ms", type=_cli.positive_float, default=40.0,
                    help="back-to-back time per method per round")
    ap.add_argument("--methods", type=lambda t: ",".join(_cli.choice_list((*METHOD_ENV, *SDPA_BACKENDS))(t)),
                    default=None)
    ap.add_argument("--passes", type=lambda t: ",".join(_cli.choice_list(PASSES)(t)), default=None,
                    help="default fwd,fwd+bwd (all three with --compare)")
    ap.add_argument("--shapes", type=_cli.shape_list, default=None,
                    help="BxHxSxD[,...]: only these shapes (default: the mode's list)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sass", action="store_true",
                    help="no GPU needed: compile the kernels for sm_90a and write per-tile SASS issue estimates")
    ap.add_argument("--realistic", action="store_true",
                    help="accuracy only: SageBwd's gradients on the realistic inputs")
    ap.add_argument("--mask-cost", action="store_true",
                    help="forward + backward with a key-padding mask against the kept keys alone (--methods: "
                         "SageBwd methods; default sagebwd,sagebwd_scores_int8)")
    ap.add_argument("--sm90-unchecked", action="store_true",
                    help="let sagebwd_sm90 take key masks, causality and GQA before their GPU tests have passed "
                         "(kernels.sagebwd_sm90.VISIBILITY_GPU_CHECKED; bench/device/sagebwd_session.sh passes it "
                         "only after tests/test_sagebwd_sm90.py passed in the same call); the tables say so")
    args = ap.parse_args(argv)
    if args.sm90_unchecked:
        from sage_diffusers.kernels import sagebwd_sm90

        sagebwd_sm90.VISIBILITY_GPU_CHECKED = True
    note = (" `--sm90-unchecked`: sagebwd_sm90 took key masks, causality and GQA, their gate lifted for this run "
            "(VISIBILITY_GPU_CHECKED; the run's test log says whether their GPU tests passed)." if args.sm90_unchecked else "")

    def needs_cuda():  # after the arguments' own checks, before the first CUDA call
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA device (--sass alone runs without one)")

    if args.mask_cost:
        methods = (args.methods or "sagebwd,sagebwd_scores_int8").split(",")
        if not all(m.startswith("sagebwd") for m in methods):
            ap.error("--mask-cost times SageBwd methods only")
        needs_cuda()
        mask_cost(Path(args.out or RESULTS / f"sagebwd_mask_cost_{gpu_slug(torch.cuda.get_device_name())}"), methods,
                  args.shapes or MASK_COST_SHAPES, args.rounds or 3, args.target_ms, note)
        return
    if args.realistic:
        needs_cuda()
        realistic_accuracy(Path(args.out or RESULTS / f"sagebwd_realistic_{gpu_slug(torch.cuda.get_device_name())}"))
        return
    if args.sass:
        sass_report(Path(args.out or RESULTS / "sagebwd_sass_sm90.md"))
        return
    needs_cuda()
    t0 = time.time()
    if args.compare:
        shapes, causal_shapes = COMPARE_SHAPES, ([s for s in COMPARE_SHAPES if s[2] == 16384] if args.causal else [])
        methods = (args.methods or COMPARE_METHODS).split(",")
        passes = (args.passes or ",".join(PASSES)).split(",")
        rounds = args.rounds or 5
        acc_variants = {m: m for m in methods if m.startswith("sagebwd")}
        out = Path(args.out or RESULTS / f"sagebwd_variants_{gpu_slug(torch.cuda.get_device_name())}")
    else:
        shapes = [(1, 24, s, 128) for s in (4096, 8192, 16384, 32768)] + [(1, 48, s, 64) for s in (4096, 8192, 16384, 32768)]
        causal_shapes = [(1, 24, 16384, 128), (1, 48, 16384, 64)]
        rounds = args.rounds or 7
        if args.quick:
            shapes, causal_shapes, rounds = [(1, 24, 16384, 128), (1, 48, 8192, 64)], [], args.rounds or 3
        methods = (args.methods or "sagebwd,sagebwd_scores_int8,sdpa_cudnn,sdpa_flash").split(",")
        passes = (args.passes or "fwd,fwd+bwd").split(",")
        # the default; dP = dO.V^T in INT8 (the paper's ablation); the paper's INT8 scores
        acc_variants = {"default": "sagebwd", "dP int8": "sagebwd_dov_int8", "scores int8": "sagebwd_scores_int8"}
        out = Path(args.out or RESULTS / f"sagebwd_{gpu_slug(torch.cuda.get_device_name())}")
    if args.shapes:
        shapes = args.shapes
        causal_shapes = [sh for sh in causal_shapes if sh in shapes]
    rows, acc, failures = [], {}, []
    torch.backends.cuda.matmul.allow_tf32 = False
    for shape, causal in [(s, False) for s in shapes] + [(s, True) for s in causal_shapes]:
        b, h, s, d = shape
        q, k, v, do = make_inputs(*shape)
        for pass_ in passes:
            steps, fell_back = {}, {}
            for m in methods:  # warm-up: JIT, autotuning, cuDNN plans; a method that fails is reported and left out
                try:
                    steps[m] = step_fn(m, causal, pass_, q, k, v, do)
                    fell_back[m] = warm_up(steps[m])
                except Exception as exc:  # noqa: BLE001 - one broken variant must not stop the others' timing
                    steps.pop(m, None)
                    failures.append(dict(shape=f"{b}x{h}x{s}x{d}", causal=causal, pass_=pass_, method=m,
                                         error=f"{type(exc).__name__}: {exc}"[:2000]))
                    print(f"[{time.time() - t0:6.1f}s] {m} {pass_} FAILED: {failures[-1]['error'][:400]}", flush=True)
            if not steps:
                continue
            times = bench_utils.interleaved(steps, tuple, rounds, target_ms=args.target_ms)
            flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0) * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[pass_]
            base = statistics.median(times["sdpa_cudnn"]) if "sdpa_cudnn" in times else None
            for m in steps:
                sp = spread(times[m])
                rows.append(dict(shape=f"{b}x{h}x{s}x{d}", causal=causal, pass_=pass_, method=m,
                                 ms_min=sp["min"], ms_median=sp["median"], ms_max=sp["max"],
                                 tops=flops / sp["median"] / 1e9,
                                 speedup_vs_cudnn=(base / sp["median"]) if base else None, fell_back=fell_back[m]))
                print(f"[{time.time() - t0:6.1f}s] {b}x{h}x{s}x{d} causal={int(causal)} {pass_:8s} {m:20s} "
                      f"{sp['min']:8.3f} / {sp['median']:8.3f} / {sp['max']:8.3f} ms "
                      f"({flops / sp['median'] / 1e9:6.1f} TOPS) x{(base / sp['median']) if base else float('nan'):.2f}",
                      flush=True)
            del steps
        del q, k, v, do
        torch.cuda.empty_cache()
    # Accuracy after the timings, so that the autotuner has chosen at the timed shapes (its key has
    # no sequence length); float32 math SDPA needs S^2 memory: 4K tokens.
    for b, h, _, d in shapes:
        if d not in {a[1] for a in acc.values()}:
            acc[f"{b}x{h}x{ACC_TOKENS}x{d}"] = (accuracy(*make_inputs(b, h, ACC_TOKENS, d), False, acc_variants), d)
            torch.cuda.empty_cache()
    configs = tuned_configs()
    for name, chosen in configs.items():
        print("autotuned", name, chosen, flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, rounds=rounds, target_ms=args.target_ms,
                autotune=os.environ.get("SAGE_DIFFUSERS_TRITON_AUTOTUNE", "1"), wall_s=round(time.time() - t0, 1),
                sm90_unchecked=args.sm90_unchecked,
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows, failures=failures, autotuned=configs,
                                                        accuracy={k: v[0] for k, v in acc.items()}), indent=1))
    title = "SageBwd variants" if args.compare else "SageBwd"
    lines = [f"# {title} on {meta['device']} (forward, backward vs torch SDPA)", "",
             f"torch {meta['torch']}, triton {meta['triton']}; {meta['rounds']} interleaved rounds of about "
             f"{meta['target_ms']:.0f} ms of back-to-back calls per method; autotune {meta['autotune']}; bf16 inputs; "
             f"produced by `eval/bench_sagebwd.py{' --compare' if args.compare else ''}` in {meta['wall_s']} s. "
             "Speed-up = median cuDNN time / median time." + note, "",
             "| shape | causal | pass | method | ms min / median / max | TOPS | vs cuDNN |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        sp = f"{r['speedup_vs_cudnn']:.2f}x" if r["speedup_vs_cudnn"] else "n/a"
        lines.append(f"| {r['shape']} | {int(r['causal'])} | {r['pass_']} | {r['method']}{fell_back_note(r['fell_back'])}"
                     f" | {r['ms_min']:.3f} / "
                     f"{r['ms_median']:.3f} / {r['ms_max']:.3f} | {r['tops']:.0f} | {sp} |")
    lines += ["", "## Accuracy against float32 SDPA (same inputs)", "",
              "| shape | variant | O cos / rel-L1 | dQ | dK | dV |", "|---|---|---|---|---|---|"]
    for shape, (res, _) in acc.items():
        for label in acc_variants:
            if f"{label}/O" not in res:
                continue
            cells = [f"{res[f'{label}/{n}']['cos']:.5f} / {res[f'{label}/{n}']['rel_l1']:.4f}" for n in ("O", "dQ", "dK", "dV")]
            lines.append(f"| {shape} | {label} | " + " | ".join(cells) + " |")
    if configs:
        lines += ["", "## Autotuned launch configs", ""] + [f"- `{n}`: {c}" for n, c in configs.items()]
    if failures:
        lines += ["", "## Failures (left out of the timing)", ""] + [
            f"- {f['shape']} causal={int(f['causal'])} {f['pass_']} {f['method']}: `{f['error'][:300]}`" for f in failures]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("wrote", out.with_suffix(".md"), f"after {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
