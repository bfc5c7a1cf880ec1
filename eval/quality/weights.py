"""Where the quality networks' weights come from: a local path, or the hub cache, never the network."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class WeightSource:
    """A network's weights, and where a user gets them."""

    name: str  # key of --weights NAME=PATH and of the env variable SAGE_EVAL_<NAME>
    origin: str  # where the weights are published (for the error message)
    hub_id: Optional[str] = None  # Hugging Face repository looked up in the local hub cache
    files: tuple[str, ...] = ()  # files that must exist when the path is a folder


CLIP_B32 = WeightSource("clip_b32", "hub openai/clip-vit-base-patch32", "openai/clip-vit-base-patch32",
                        ("config.json",))
CLIP_L14 = WeightSource("clip_l14", "hub openai/clip-vit-large-patch14", "openai/clip-vit-large-patch14",
                        ("config.json",))
RAFT = WeightSource("raft", "torchvision Raft_Large_Weights.C_T_SKHT_V2 (raft_large_C_T_SKHT_V2-ff5fadd5.pth)")
DOVER = WeightSource("dover", "the DOVER release (VQAssessment/DOVER, pretrained_weights/DOVER.pth)")
IMAGE_REWARD = WeightSource("image_reward", "hub THUDM/ImageReward (ImageReward.pt, med_config.json)",
                            "THUDM/ImageReward", ("ImageReward.pt", "med_config.json"))


def resolve(source: WeightSource, given: Optional[str] = None) -> Path:
    """Local path of ``source``: ``given``, else env SAGE_EVAL_<NAME>, else the hub cache.

    Raises
    ------
    FileNotFoundError naming the missing file and where to get it.
    """
    env = f"SAGE_EVAL_{source.name.upper()}"
    candidate = given or os.environ.get(env)
    if candidate is None and source.hub_id is not None:
        try:  # the hub cache only: never a download
            from huggingface_hub import snapshot_download

            candidate = snapshot_download(source.hub_id, local_files_only=True)
        except Exception:  # noqa: BLE001 - any failure here means "not in the cache"
            candidate = None
    if candidate is None:
        raise FileNotFoundError(f"weights '{source.name}' not found: pass --weights {source.name}=PATH or set "
                                f"{env} (from {source.origin})")
    path = Path(candidate)
    missing = [f for f in source.files if not (path / f).exists()] if path.is_dir() else []
    if not path.exists() or missing:
        what = path / missing[0] if missing else path
        raise FileNotFoundError(f"weights '{source.name}': {what} is missing (from {source.origin})")
    return path
