"""Packaging: a wheel carries the kernel sources where the JIT looks; the JIT lock and build messages.

The wheel test builds from this checkout exactly as ``pip install <repo>`` does, installs the
wheel into a folder outside the checkout and asks the installed copy's own lookup
(``_jit.csrc_dir``) where its kernels are.
"""
import io
import os
import subprocess
import sys
import tarfile
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

from sage_diffusers.kernels import _jit

ROOT = Path(__file__).resolve().parents[1]


def _out_of_tree_env(tmp: Path) -> dict:
    """Environment whose setuptools writes build/ and *.egg-info under ``tmp``, not into the checkout."""
    cfg = tmp / "setuptools-extra.cfg"
    cfg.write_text(f"[build]\nbuild_base = {tmp / 'build'}\n[egg_info]\negg_base = {tmp}\n")
    return dict(os.environ, DIST_EXTRA_CONFIG=str(cfg))


def _pip(*args, cwd=ROOT, env=None):
    return subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=180)


def _kernel_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and p.suffix in _jit.HASHED_SUFFIXES}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    res = _pip("wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), env=_out_of_tree_env(out))
    assert res.returncode == 0, res.stdout + res.stderr
    (whl,) = out.glob("sage_diffusers-*.whl")
    return whl


def test_wheel_metadata_uses_spdx_license(wheel):
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(meta).decode()
    assert "License-Expression: Apache-2.0" in text
    assert "Requires-Dist: filelock" in text


def test_wheel_carries_the_kernel_sources_and_no_lab(wheel):
    """The wheel holds the package and what the JIT compiles: no bench/ or eval/, no tool of csrc/."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert not [n for n in names if n.split("/", 1)[0] in ("bench", "eval", "tests", "csrc")]
    kernel = [n for n in names if n.startswith("sage_diffusers/_csrc/")]
    assert kernel and all(Path(n).suffix in _jit.HASHED_SUFFIXES for n in kernel), \
        sorted(n for n in kernel if Path(n).suffix not in _jit.HASHED_SUFFIXES)


def test_installed_wheel_finds_its_kernel_sources(wheel, tmp_path):
    target = tmp_path / "site"
    res = _pip("install", "--no-deps", "-q", "--target", str(target), str(wheel), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    probe = textwrap.dedent("""
        import sage_diffusers
        from sage_diffusers.kernels import _jit, fp4, int8_sm90
        print(sage_diffusers.__file__)
        print(_jit.csrc_dir())
        print(_jit.missing_kernel_sources())
        print(fp4.source_dir().is_dir(), int8_sm90.source_dir().is_dir(),
              all(p.is_file() for p in int8_sm90._sources()))
    """)
    env = {k: v for k, v in os.environ.items() if k != "SAGE_DIFFUSERS_CSRC"}
    env["PYTHONPATH"] = str(target)
    res = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    module_file, csrc, missing, dirs = res.stdout.strip().splitlines()[-4:]
    assert Path(module_file).is_relative_to(target), "the probe imported the checkout, not the wheel"
    assert Path(csrc) == target / "sage_diffusers" / "_csrc"
    assert missing == "[]"
    assert dirs == "True True True"
    assert _kernel_files(Path(csrc)) == _kernel_files(ROOT / "csrc"), "wheel's kernel sources differ from csrc/"


def test_sdist_manifest_carries_csrc_and_the_build_hook(tmp_path):
    res = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=ROOT,
                         env=_out_of_tree_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    (sdist,) = tmp_path.glob("sage_diffusers-*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"setup.py", "MANIFEST.in", "pyproject.toml"} <= names
    want = {f"csrc/{rel}" for rel in _kernel_files(ROOT / "csrc")}
    assert want and want <= names, sorted(want - names)[:5]
    assert not any(n.endswith((".so", ".o")) for n in names)


def test_checkout_uses_in_repo_csrc(monkeypatch):
    monkeypatch.delenv("SAGE_DIFFUSERS_CSRC", raising=False)
    assert _jit.csrc_dir() == ROOT / "csrc"
    assert _jit.missing_kernel_sources() == []
    monkeypatch.setenv("SAGE_DIFFUSERS_CSRC", "/nonexistent-sage-csrc")
    assert _jit.missing_kernel_sources() == list(_jit.KERNEL_FOLDERS)


_RACER = textwrap.dedent("""
    import pathlib, sys, time
    from torch.utils import cpp_extension
    from sage_diffusers.kernels import _jit

    log, who, src = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]

    def note(line):
        with open(log, "a") as f:
            f.write(line + "\\n")

    def fake_load(name, sources, build_directory, **kwargs):  # stands in for nvcc + ninja
        lib = pathlib.Path(build_directory) / (name + cpp_extension.LIB_EXT)
        note(f"start {who} built={lib.is_file()}")
        if not lib.is_file():  # hold the lock until the other process is about to ask for it
            ready = log.with_name("B.ready")
            while not ready.exists():
                time.sleep(0.02)
            time.sleep(1.0)
            lib.write_bytes(b"")
        note(f"end {who}")
        return "module"

    cpp_extension.load = fake_load
    if who == "B":
        log.with_name("B.ready").write_text("")
    _jit.load_extension("sage_lock_probe", [src])
""")


def test_lock_serializes_two_processes_and_the_second_only_loads(tmp_path):
    src = tmp_path / "src" / "probe.cu"
    src.parent.mkdir()
    src.write_text("// probe\n")
    log = tmp_path / "log"
    env = dict(os.environ, SAGE_DIFFUSERS_CACHE=str(tmp_path / "cache"), CUTLASS_INCLUDE=str(tmp_path))

    def start(who):
        return subprocess.Popen([sys.executable, "-c", _RACER, str(log), who, str(src)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first = start("A")
    deadline = time.monotonic() + 60
    while not (log.exists() and "start A" in log.read_text()):  # A holds the lock from here on
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline, "first process never started building"
        time.sleep(0.05)
    second = start("B")
    _, err_a = first.communicate(timeout=60)
    _, err_b = second.communicate(timeout=60)
    assert first.returncode == 0 and second.returncode == 0, err_a + err_b
    assert log.read_text().splitlines() == ["start A built=False", "end A", "start B built=True", "end B"]
    assert "first use: compiling sage_lock_probe (1 CUDA files" in err_a
    assert "waiting for another process that is building sage_lock_probe" in err_b
    assert "compiling" not in err_b  # it found the finished build


def test_build_progress_says_what_how_long_and_keeps_talking(monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "4")
    out = io.StringIO()
    with _jit.build_progress("ext_x", 9, Path("/cache/ext_x-0"), stream=out, heartbeat_s=0.05):
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("sage_diffusers: first use: compiling ext_x (9 CUDA files, about ")
    assert "with 4 parallel jobs" in lines[0]
    assert any("still compiling ext_x" in line for line in lines[1:-1])
    assert lines[-1].startswith("sage_diffusers: built ext_x in ")

    out = io.StringIO()
    with pytest.raises(RuntimeError), _jit.build_progress("ext_y", 1, Path("/c"), stream=out, heartbeat_s=10):
        raise RuntimeError("nvcc failed")
    assert "build FAILED ext_y" in out.getvalue()


def test_dry_run_reports_the_cache_entry_without_building(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGE_DIFFUSERS_CACHE", str(tmp_path))
    src = tmp_path / "k.cu"
    src.write_text("// k\n")
    with _jit.dry_run():
        info = _jit.load_extension("sage_dry", [src], extra_cuda_cflags=["-DX=1"])
    assert isinstance(info, _jit.BuildInfo) and not info.built and info.cuda_files == 1
    assert info.build_dir.parent == _jit.cache_root() and not info.build_dir.exists()
    src.write_text("// k changed\n")
    assert _jit.build_info(lambda: _jit.load_extension("sage_dry", [src], extra_cuda_cflags=["-DX=1"])).key != info.key
