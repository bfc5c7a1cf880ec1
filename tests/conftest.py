"""Shared fixtures and the per-file test count that CI checks.

Set ``SAGE_TEST_COUNTS=path.json`` and the session writes, per test file, how many tests ran (passed
or failed) and how many were skipped; ``.ci/run`` prints the table and fails when a file that must run
on the CPU ran none (a module-level skip or an import that silently skips everything).
"""
import collections
import json
import os

import pytest
import torch

_COUNTS: "collections.defaultdict[str, collections.Counter]" = collections.defaultdict(collections.Counter)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long CPU cases; CI runs them, deselect locally with -m 'not slow'")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_capabilities(monkeypatch):
    """Tests fake the GPU's capability: the API's per-process memo of it starts empty in each."""
    from sage_diffusers import _dispatch

    monkeypatch.setattr(_dispatch, "_CAPABILITIES", {})


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    if report.when == "call":
        _COUNTS[path]["ran"] += 1
    elif report.skipped:  # skipped in setup (skipif, importorskip inside a fixture, pytest.skip)
        _COUNTS[path]["skipped"] += 1
    elif report.failed:  # an error in setup or teardown still counts as a test that ran and failed
        _COUNTS[path]["ran"] += report.when == "setup"


def pytest_collectreport(report):
    path = report.nodeid.split("::", 1)[0]
    if report.skipped:  # the whole module skipped at import time (pytest.skip(allow_module_level=True))
        _COUNTS[path]["skipped_module"] += 1
    elif report.failed:  # import error: pytest fails the run; the table shows where
        _COUNTS[path]["collect_error"] += 1


def pytest_sessionfinish(session):
    out = os.environ.get("SAGE_TEST_COUNTS")
    if out and not hasattr(session.config, "workerinput"):
        with open(out, "w") as f:
            json.dump({k: dict(v) for k, v in sorted(_COUNTS.items())}, f, indent=1)
