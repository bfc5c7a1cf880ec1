"""The backend registry (``sage_diffusers.backends``): what the dispatcher, the self-check, the
doctor and the docs read about each backend, stated once."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from sage_diffusers import _dispatch, backends, selftest
from sage_diffusers.backends import Route
from sage_diffusers.options import Mode

ROOT = Path(__file__).resolve().parents[1]


def test_the_doc_holds_the_current_table():
    """docs/kernels.md shows the registry; after changing it, paste ``backends.markdown_table()``
    between the markers."""
    text = (ROOT / "docs" / "kernels.md").read_text()
    _, begin, rest = text.partition(backends.DOC_BEGIN)
    table, end, _ = rest.partition(backends.DOC_END)
    assert begin and end, "docs/kernels.md: the generated table's markers are missing"
    assert table == "\n" + backends.markdown_table(), "docs/kernels.md: the backends table is out of date"


@pytest.mark.parametrize("cap, int8, fp4, auto", [
    (80, "int8_triton", None, None), (89, "int8_triton", None, None), (90, "int8_sm90", "fp4", Mode.INT8),
    (100, None, None, None), (120, None, "fp4", Mode.FP4), (121, None, "fp4", Mode.FP4),
])
def test_each_arch_is_served_by_the_kernels_the_registry_names(cap, int8, fp4, auto):
    for mode, name in ((Mode.INT8, int8), (Mode.FP4, fp4)):
        spec = backends.kernel_for(mode, cap)
        assert (spec.name if spec is not None else None) == name
    assert backends.auto_algorithm(cap) is auto


def test_an_arch_without_a_kernel_is_named_with_the_archs_that_have_one():
    backend, why = backends.backend_for.__wrapped__(Mode.INT8, (10, 0))
    assert backend is None and why == "int8 kernels: int8_triton on sm_80 to sm_89, int8_sm90 on sm_90"


def test_the_self_check_and_the_dispatcher_read_the_registry():
    assert selftest.VERIFIED_ON_HARDWARE == {(Mode.INT8, "sm_90"), (Mode.FP4, "sm_90")}
    assert set(selftest.REFERENCES) == {Mode.INT8, Mode.FP4}
    assert _dispatch.SUPPORTED_HEAD_DIMS == (64, 128)
    assert _dispatch.ACCEPTED_DTYPES == (torch.float16, torch.bfloat16, torch.float32)
    assert backends.trainable_for(Mode.INT8) is not None and backends.trainable_for(Mode.FP4) is None
    assert backends.auto_table_kernel() is backends.INT8_SM90


def test_two_kernels_claiming_one_arch_are_refused(monkeypatch):
    clash = backends.BackendSpec("other", Route.KERNEL, Mode.INT8, lambda: None, "f", archs=frozenset({90}))
    monkeypatch.setattr(backends, "BACKENDS", backends.BACKENDS + (clash,))
    with pytest.raises(ValueError, match="two int8 kernels for sm_90"):
        backends._index()


def test_auto_on_an_arch_the_backend_does_not_serve_is_refused(monkeypatch):
    wrong = backends.BackendSpec("wrong", Route.KERNEL, Mode.FP4, lambda: None, "f", archs=frozenset({100}),
                                 auto_on=frozenset({120}))
    monkeypatch.setattr(backends, "BACKENDS", (wrong,))
    with pytest.raises(ValueError, match="auto_on / verified_on must be archs it serves"):
        backends._index()


def test_the_references_follow_the_contract():
    q = torch.randn(1, 2, 5, 64)
    for mode in (Mode.INT8, Mode.FP4):
        out, lse = backends.reference_for(mode)(q, q, q, key_mask=None, is_causal=False, scale=0.125,
                                                return_lse=False)
        assert out.shape == q.shape and lse is None


def test_a_kernel_is_checked_and_built_on_a_device_of_the_arch_it_is_asked_for(monkeypatch):
    """Bug: backend_for (cached per arch) asked the module about the current device: on a machine with
    an sm_120 GPU current and an sm_90 GPU holding the model, the sm_90 answer was the sm_120 one
    ("needs compute capability 9.0"), an SDPA fallback kept for the whole process."""
    caps = {0: (12, 0), 1: (9, 0)}
    current = [0]

    class OnDevice:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            self.prev, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.prev

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: caps[current[0] if i is None else i])
    monkeypatch.setattr(torch.cuda, "device", OnDevice)
    seen = []

    class Module:
        @staticmethod
        def is_available():
            seen.append(("available", caps[current[0]]))
            return True, ""

        @staticmethod
        def build():
            seen.append(("build", caps[current[0]]))

        kernel = object()

    spec = dataclasses.replace(backends.kernel_for(Mode.INT8, 90), module=lambda: Module, function="kernel")
    monkeypatch.setattr(backends, "kernel_for", lambda mode, cap: spec)
    backend, why = backends.backend_for.__wrapped__(Mode.INT8, (9, 0))
    assert (backend, why) == (Module.kernel, "")
    assert seen == [("available", (9, 0)), ("build", (9, 0))] and current[0] == 0
