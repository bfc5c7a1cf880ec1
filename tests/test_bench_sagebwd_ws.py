"""bench/sagebwd_ws.py (an experiment of the kernel lab): its warp-specialized dK/dV kernel, run by
Triton's CPU interpreter, against the torch model of its per-key-row dS quantization, and its dV
bit-equal to the shipped kernel's (the script's ``--check``)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_sagebwd_triton import INTERPRETER_SKIP

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(INTERPRETER_SKIP is not None, reason=INTERPRETER_SKIP or "")
def test_ws_kernel_matches_its_model_under_interpreter():
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "sagebwd_ws.py"), "--check"],
                         env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "PASS" in res.stdout and "shipped kernel's: True" in res.stdout
