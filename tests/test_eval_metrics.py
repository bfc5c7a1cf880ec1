"""eval.metrics: Frechet distance against the closed form, the real Inception's FID / sFID features."""
import numpy as np
import pytest
import torch

from eval import metrics


def test_frechet_distance_matches_closed_form_for_diagonal_gaussians():
    # For diagonal covariances, d^2 = |mu1 - mu2|^2 + sum (sqrt(s1) - sqrt(s2))^2.
    rng = np.random.default_rng(0)
    mu1, mu2 = rng.normal(size=5), rng.normal(size=5)
    s1, s2 = rng.uniform(0.5, 2.0, 5), rng.uniform(0.5, 2.0, 5)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(s1) - np.sqrt(s2)) ** 2)
    assert metrics.frechet_distance(mu1, np.diag(s1), mu2, np.diag(s2)) == pytest.approx(expected, rel=1e-9)


def test_frechet_distance_of_commuting_full_covariances():
    # sigma2 = A sigma1 A^T with A orthogonal-free scaling c: sqrt(sigma1 sigma2) = c sigma1.
    rng = np.random.default_rng(1)
    a = rng.normal(size=(6, 6))
    s1 = a @ a.T + 6 * np.eye(6)
    c = 2.5
    mu = rng.normal(size=6)
    expected = np.trace(s1) * (1 + c * c - 2 * c)
    assert metrics.frechet_distance(mu, s1, mu, c * c * s1) == pytest.approx(expected, rel=1e-8)
    assert metrics.frechet_distance(mu, s1, mu, s1) == pytest.approx(0.0, abs=1e-8)


def test_frechet_distance_from_samples_converges_to_the_gaussians_value():
    rng = np.random.default_rng(2)
    a = rng.normal(size=(200000, 3))
    b = rng.normal(size=(200000, 3)) * 2 + 1  # N(1, 4 I)
    expected = 3 * 1.0 + 3 * (1 - 2) ** 2
    assert metrics.fid_from_features(a, b) == pytest.approx(expected, rel=0.02)


def test_frechet_distance_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        metrics.frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))


@pytest.fixture(scope="module")
def images():
    g = torch.Generator().manual_seed(0)
    return torch.rand(4, 3, 299, 299, generator=g)


@pytest.fixture(scope="module")
def features(images):
    return metrics.inception_all(images, device="cpu")


def test_inception_features_shapes_and_fid_of_a_set_with_itself(features):
    f = features
    assert f.pool.shape == (4, metrics.FID_DIM) and f.spatial.shape == (4, metrics.SFID_DIM)
    assert np.isfinite(f.pool).all() and (f.pool >= 0).all()  # pool3 follows a ReLU
    assert metrics.fid_from_features(f.pool, f.pool) == pytest.approx(0.0, abs=1e-3)
    assert metrics.fid_from_features(f.spatial, f.spatial) == pytest.approx(0.0, abs=1e-3)


def test_fid_separates_different_image_sets(images, features):
    dark = metrics.inception_all(images[:2] * 0.2, device="cpu")
    assert metrics.fid_from_features(features.pool, dark.pool) > 1.0
    assert metrics.fid_from_features(features.spatial, dark.spatial) > 1.0
    assert metrics.inception_features(images[:1]).shape == (1, 2048)


def test_sfid_tap_is_mixed_6_conv_first_seven_channels(images, features):
    layers = metrics._inception("cpu").net.layers
    x = metrics._prepare(images[:1])
    with torch.no_grad():
        for name in metrics._LAYERS_BEFORE_TAP:
            x = getattr(layers, name)(x)
        tap = layers.mixed_6.conv(x)
    assert tap.shape[-2:] == (17, 17)
    np.testing.assert_allclose(features.spatial[:1], tap[:, :7].flatten(1).double().numpy(), rtol=1e-5, atol=1e-5)


def test_psnr():
    x = torch.zeros(2, 3, 4, 4)
    assert metrics.psnr(x, x) == float("inf")
    assert metrics.psnr(x + 0.1, x) == pytest.approx(20.0)


def test_fid_from_features_equals_the_sqrtm_formula():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(60, 7)), rng.normal(size=(45, 7)) * 1.3 + 0.2
    direct = metrics.frechet_distance(*metrics.gaussian_stats(a), *metrics.gaussian_stats(b))
    assert metrics.fid_from_features(a, b) == pytest.approx(direct, rel=1e-9)
