"""Environment variables: one module reads them (``sage_diffusers/config.py``), one table documents
them (``docs/configuration.md``), and every value is parsed at the time of the call."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sage_diffusers import config
from sage_diffusers.kernels import _jit, fp4
from sage_diffusers.options import Int8Precision
from sage_diffusers.reference.sagebwd import ScorePrecision

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sage_diffusers"
# Where the repository names variables: code, scripts and docs (results included: they quote the
# commands that produced them).
SCANNED = ("sage_diffusers", "tests", "bench", "eval", "csrc", "comfyui_node", "docs", "workflows")
SCANNED_SUFFIXES = {".py", ".sh", ".md", ".cu", ".cuh", ".h", ".cpp", ".inc", ".toml", ".txt", ".json"}
NAME = re.compile(r"\bSAGE_DIFFUSERS_[A-Z0-9_]*[A-Z0-9]\b")

# One value per variable that must be refused (None: the variable accepts any text).
BAD = {
    "SAGE_DIFFUSERS_CACHE": None,
    "SAGE_DIFFUSERS_CSRC": None,
    "SAGE_DIFFUSERS_AUTO_CALIBRATE": "maybe",
    "SAGE_DIFFUSERS_SM90_BENCH": "2",
    "SAGE_DIFFUSERS_EXP_POLY": "3",
    "SAGE_DIFFUSERS_INT8_PRECISION": "Accurate",
    "SAGE_DIFFUSERS_FP4_ATOM": "Native",
    "SAGE_DIFFUSERS_FP4_EMU": "WGMMA",
    "SAGE_DIFFUSERS_FP4_OPT": "hoist_mask+bogus",
    "SAGE_DIFFUSERS_FP4_NO_HW_E2M1": "yes please",
    "SAGE_DIFFUSERS_TRITON_AUTOTUNE": "fast",
    "SAGE_DIFFUSERS_SAGEBWD_ACC": "fpu",
    "SAGE_DIFFUSERS_SAGEBWD_BWD": "Lean",
    "SAGE_DIFFUSERS_SAGEBWD_SCORES": "bf16",
    "TRITON_INTERPRET": None,
    "CUTLASS_INCLUDE": None,
    "MAX_JOBS": "-1",
    "XDG_CACHE_HOME": None,
    "SAGE_DIFFUSERS_COMMIT": None,
}


def _files(*folders: str):
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in SCANNED_SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                yield path


def test_the_doc_holds_the_current_table():
    """docs/configuration.md is config.py's table; regenerate with ``python -m sage_diffusers.config --write``."""
    doc = ROOT / config.DOC_PATH
    text = doc.read_text()
    assert config.render_doc(text) == text, \
        f"{config.DOC_PATH} is out of date: run `python -m sage_diffusers.config --write`"
    for name in config.VARIABLES:
        assert f"| `{name}` |" in text


def test_every_variable_the_repository_names_is_in_the_table():
    names = {}
    for path in [*_files(*SCANNED), ROOT / "README.md"]:
        for name in NAME.findall(path.read_text(errors="replace")):
            names.setdefault(name, str(path.relative_to(ROOT)))
    unknown = {n: where for n, where in names.items() if n not in config.VARIABLES}
    assert not unknown, f"variables missing from sage_diffusers/config.py (first seen in): {unknown}"
    assert set(BAD) == set(config.VARIABLES)  # this file's examples cover every variable


def _environment_reads(tree: ast.AST) -> list[int]:
    """Lines that touch os.environ / os.getenv / os.putenv (also through ``from os import ...``)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv") for a in node.names):
            lines.append(node.lineno)
    return lines


def test_only_config_reads_the_environment():
    readers = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "config.py" and path.parent == PACKAGE:
            continue
        lines = _environment_reads(ast.parse(path.read_text()))
        if lines:
            readers[str(path.relative_to(ROOT))] = lines
    assert not readers, f"read the environment through sage_diffusers.config instead: {readers}"


@pytest.mark.parametrize("name", sorted(n for n, bad in BAD.items() if bad is not None))
def test_a_value_that_is_not_accepted_raises_naming_variable_value_and_choices(monkeypatch, name):
    var = config.VARIABLES[name]
    monkeypatch.setenv(name, BAD[name])
    with pytest.raises(ValueError) as err:
        var.get()
    message = str(err.value)
    assert name in message and repr(BAD[name]) in message and "expected" in message


@pytest.mark.parametrize("name", sorted(config.VARIABLES))
def test_unset_empty_and_blank_give_the_default(monkeypatch, name):
    var = config.VARIABLES[name]
    monkeypatch.delenv(name, raising=False)
    assert var.get() == var.default
    for blank in ("", "  "):
        monkeypatch.setenv(name, blank)
        assert var.get() == var.default


def test_values_are_read_at_each_call(monkeypatch):
    monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_BWD", "split")
    assert config.sagebwd_bwd() == "split"
    monkeypatch.setenv("SAGE_DIFFUSERS_SAGEBWD_BWD", "fused")
    assert config.sagebwd_bwd() == "fused"
    monkeypatch.delenv("SAGE_DIFFUSERS_SAGEBWD_BWD")
    assert config.sagebwd_bwd() is None


@pytest.mark.parametrize("text, value", [("1", True), ("true", True), ("ON", True), (" yes ", True),
                                         ("0", False), ("False", False), ("off", False), ("NO", False)])
def test_flags(monkeypatch, text, value):
    monkeypatch.setenv("SAGE_DIFFUSERS_SM90_BENCH", text)
    monkeypatch.setenv("SAGE_DIFFUSERS_AUTO_CALIBRATE", text)
    assert config.sm90_bench() is value and config.auto_calibrate() is value


def test_integers(monkeypatch):
    for text, value in (("0", 0), ("1", 1), ("3", 3), (" 12 ", 12)):
        monkeypatch.setenv("SAGE_DIFFUSERS_TRITON_AUTOTUNE", text)
        assert config.triton_autotune() == value
    for bad in ("-1", "1.5", "all", "0x3"):
        monkeypatch.setenv("SAGE_DIFFUSERS_TRITON_AUTOTUNE", bad)
        with pytest.raises(ValueError, match="SAGE_DIFFUSERS_TRITON_AUTOTUNE"):
            config.triton_autotune()
    monkeypatch.setenv("SAGE_DIFFUSERS_EXP_POLY", "8")
    assert config.exp_poly() == 8
    monkeypatch.setenv("MAX_JOBS", "4")
    assert config.max_jobs() == 4
    # Bug: int() read "1_0" as 10 and Arabic-Indic digits as numbers
    for name, bad, read in (("SAGE_DIFFUSERS_TRITON_AUTOTUNE", "1_0", config.triton_autotune),
                            ("MAX_JOBS", "\u0663", config.max_jobs),
                            ("SAGE_DIFFUSERS_FP4_OPT", "1_0", config.fp4_opt),
                            ("SAGE_DIFFUSERS_FP4_OPT", "hoist_mask++", config.fp4_opt)):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            read()


def test_exp_poly_applies_where_its_share_is_compiled(monkeypatch):
    """Bug: SAGE_DIFFUSERS_EXP_POLY=8 (compiled at head dim 64 only) was asked of head dim 128 too,
    where no kernel has that share; it applies at the head dims that have it."""
    from sage_diffusers.kernels import int8_sm90

    monkeypatch.setattr(int8_sm90, "_exp_poly_override", 8)
    assert int8_sm90.default_exp_poly_every(64) == 8
    assert int8_sm90.default_exp_poly_every(128) == int8_sm90._DEFAULT_EXP_POLY[128]


def test_paths_keep_their_spaces(monkeypatch, tmp_path):
    folder = tmp_path / " cache "
    monkeypatch.setenv("SAGE_DIFFUSERS_CACHE", str(folder))
    assert config.cache() == folder and _jit.cache_root() == folder / "jit"


def test_cache_root_falls_back_to_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("SAGE_DIFFUSERS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _jit.cache_root() == tmp_path / "sage_diffusers" / "jit"
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty is unset (XDG's rule), not the current folder
    assert _jit.cache_root() == Path.home() / ".cache" / "sage_diffusers" / "jit"


def test_choices_are_the_values_of_the_enums_they_select():
    """config.py cannot import the kernel modules (torch, Triton): their enums are repeated there."""
    sagebwd_triton = pytest.importorskip("sage_diffusers.kernels.sagebwd_triton")
    assert config.SAGEBWD_ACC_VALUES == tuple(m.value for m in sagebwd_triton.AccConvert)
    assert config.SAGEBWD_BWD_VALUES == tuple(m.value for m in sagebwd_triton.BwdKernels)
    assert config.SAGEBWD_SCORES_VALUES == tuple(m.value for m in ScorePrecision)
    assert config.SAGEBWD_SCORES.default == ScorePrecision.FP16.value
    assert config.INT8_PRECISION_VALUES == tuple(m.value for m in Int8Precision)
    assert config.INT8_PRECISION.default == Int8Precision.FAST.value
    assert config.FP4_ATOM_VALUES == (fp4.Atom.NATIVE, fp4.Atom.EMULATED)
    assert set(config.FP4_EMU_VALUES) == set(fp4.EmuGemm.CODE)
    assert config.SAGEBWD_ACC.default == sagebwd_triton.AccConvert.XU.value


def test_fp4_option_sets(monkeypatch):
    monkeypatch.setenv("SAGE_DIFFUSERS_FP4_OPT", "TREE_REDUCE + hoist_mask")
    assert config.fp4_opt() == fp4.KernelOpt.HOIST_MASK | fp4.KernelOpt.TREE_REDUCE
    monkeypatch.setenv("SAGE_DIFFUSERS_FP4_OPT", "16")
    with pytest.raises(ValueError, match=r"SAGE_DIFFUSERS_FP4_OPT='16'.*\[0, 16\)"):
        config.fp4_opt()
    monkeypatch.delenv("SAGE_DIFFUSERS_FP4_OPT")
    assert config.fp4_opt() == fp4.DEFAULT_KERNEL_OPT
    assert fp4.parse_opt is config.parse_fp4_opt and fp4.opt_name is config.fp4_opt_name


def test_a_value_read_at_import_is_checked_there():
    """SAGE_DIFFUSERS_TRITON_AUTOTUNE is read when sagebwd_triton is imported (its decorators): a bad
    value stops that import with the variable's message."""
    env = dict(os.environ, SAGE_DIFFUSERS_TRITON_AUTOTUNE="fast")
    proc = subprocess.run([sys.executable, "-c", "import sage_diffusers.kernels.sagebwd_triton"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "SAGE_DIFFUSERS_TRITON_AUTOTUNE='fast' is not accepted" in proc.stderr


def test_config_imports_no_heavy_module():
    """config is imported by every kernel module: the standard library and the generated variant
    tables only (no torch, Triton or kernel module)."""
    tree = ast.parse((PACKAGE / "config.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "dataclasses", "os", "re", "sys", "pathlib", "typing",
                        "kernels._fp4_variants", "kernels._sm90_int8_variants"}, imported
