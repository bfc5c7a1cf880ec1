"""Packaging: a wheel carries the kernel sources where the JIT looks, one top-level package and the
run-time requirements only; the JIT lock and build messages.

The wheel test builds from this checkout exactly as ``pip install <repo>`` does, installs the
wheel into a folder outside the checkout and asks the installed copy's own lookup
(``_jit.csrc_dir``) where its kernels are.
"""
import io
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

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
    # the 8-bit benchmark build's variants and table are the lab's (bench/sm90_int8/instantiations/)
    assert not [n for n in kernel if Path(n).name.startswith("bench_") or Path(n).name == "variants_bench.inc"]


def _requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(meta).decode()
    return [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines() if line.startswith("Requires-Dist:")]


LINUX = {"platform_system": "Linux", "sys_platform": "linux", "python_version": "3.12"}


def _extras(req: Requirement) -> set[str]:
    """The extras whose installs pull ``req`` on Linux."""
    return {e for e in ("diffusers", "test", "eval", "mutation")
            if req.marker is not None and req.marker.evaluate({**LINUX, "extra": e})}


def test_wheel_requires_only_what_runs_and_keeps_an_installed_torch(wheel):
    reqs = _requirements(wheel)
    always = {r.name for r in reqs if r.marker is None or r.marker.evaluate({**LINUX, "extra": ""})}
    assert always == {"torch", "nvidia-cutlass", "ninja", "filelock"}, always  # no diffusers, no test tooling
    (torch_req,) = [r for r in reqs if r.name == "torch"]
    assert all(spec.operator == ">=" for spec in torch_req.specifier), torch_req  # a lower bound: torch stays
    extras = {r.name: _extras(r) for r in reqs if _extras(r)}
    assert extras["diffusers"] == {"diffusers"}
    assert {"diffusers", "transformers", "accelerate"} <= {r.name for r in reqs if "diffusers" in _extras(r)}
    for extra in ("test", "eval"):  # both run the integration
        assert any(r.name == "sage-diffusers" and r.extras == {"diffusers"} and extra in _extras(r) for r in reqs)
    assert {"pytest", "triton"} <= {r.name for r in reqs if _extras(r) == {"test"}}
    # torch pins its own triton on Linux (2.14: ~=3.8): any bound here would make pip swap torch
    (triton_req,) = [r for r in reqs if r.name == "triton"]
    assert not triton_req.specifier, triton_req
    assert not triton_req.marker.evaluate({"extra": "test", "platform_system": "Windows"})


def test_wheel_installs_sage_diffusers_only(wheel):
    """No top-level ``comfyui_node``: a generic name other projects' wheels could also install. ComfyUI
    loads the node from the checkout's folder (comfyui_node/README.md)."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")] or [None]
        tops = z.read(top_level).decode().split() if top_level else None
    assert {n.split("/", 1)[0] for n in names} == {"sage_diffusers", "sage_diffusers-0.1.0.dist-info"}
    assert tops in (None, ["sage_diffusers"]), tops
    assert not any("comfyui" in n for n in names)


def test_core_import_needs_no_diffusers_and_the_integration_names_the_extra(tmp_path):
    """``pip install sage-diffusers`` (no extra): the API runs; the diffusers integration says what to install."""
    probe = textwrap.dedent("""
        import sys
        sys.modules["diffusers"] = None  # as if it were not installed
        import torch
        import sage_diffusers as sd
        q = torch.randn(1, 2, 16, 64)
        assert sd.attention(q, q, q, mode="sdpa").shape == q.shape
        assert "diffusers" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
        for get in (lambda: sd.enable, lambda: sd.enable_context_parallel):
            try:
                get()
            except ModuleNotFoundError as e:
                print(e)
            else:
                raise AssertionError("diffusers imported")
    """)
    res = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 2 and all("pip install 'sage-diffusers[diffusers]'" in line for line in lines), lines


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed into a folder of its own (put it on PYTHONPATH to use it)."""
    target = tmp_path_factory.mktemp("installed") / "site"
    res = _pip("install", "--no-deps", "-q", "--target", str(target), str(wheel), cwd=target.parent)
    assert res.returncode == 0, res.stdout + res.stderr
    return target


def _run_installed(probe: str, target: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``probe`` in a child that imports the installed wheel, not this checkout (nor its editable install)."""
    env = {k: v for k, v in os.environ.items() if k != "SAGE_DIFFUSERS_CSRC"}
    env["PYTHONPATH"] = str(target)
    # A fresh environment has no editable install of a checkout (an older one also mapped comfyui_node).
    head = "import sys\nsys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]\n"
    return subprocess.run([sys.executable, "-c", head + probe, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_comfyui_node_folder_runs_on_the_installed_wheel(installed, tmp_path):
    """ComfyUI loads ``custom_nodes/<folder>`` under the folder's name; the folder (a copy of comfyui_node/)
    then registers itself as ``comfyui_node`` and uses the installed sage_diffusers."""
    node = tmp_path / "custom_nodes" / "sage_diffusers_node"
    shutil.copytree(ROOT / "comfyui_node", node, ignore=shutil.ignore_patterns("__pycache__"))
    probe = textwrap.dedent("""
        import importlib.util, os, sys
        node = sys.argv[1]
        spec = importlib.util.spec_from_file_location("sage_diffusers_node", os.path.join(node, "__init__.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["sage_diffusers_node"] = module  # what ComfyUI's load_custom_node does
        spec.loader.exec_module(module)
        import sage_diffusers
        print(sage_diffusers.__file__)
        print(sys.modules["comfyui_node"].__file__)
        print(sorted(module.NODE_CLASS_MAPPINGS), module.attention_stats is sys.modules["comfyui_node"].attention_stats)
    """)
    res = _run_installed(probe, installed, tmp_path, str(node))
    assert res.returncode == 0, res.stderr
    sage_file, node_file, mappings = res.stdout.strip().splitlines()[-3:]
    assert Path(sage_file).is_relative_to(installed)
    assert Path(node_file) == node / "__init__.py"
    assert mappings == "['SageDiffusersAttention'] True"


def test_installed_wheel_finds_its_kernel_sources(installed, tmp_path):
    target = installed
    probe = textwrap.dedent("""
        import sage_diffusers
        from sage_diffusers.kernels import _jit, fp4, int8_sm90
        print(sage_diffusers.__file__)
        print(_jit.csrc_dir())
        print(_jit.missing_kernel_sources())
        print(fp4.source_dir().is_dir(), int8_sm90.source_dir().is_dir(),
              all(p.is_file() for p in int8_sm90._sources()))
    """)
    res = _run_installed(probe, target, tmp_path)
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
    assert {"setup.py", "MANIFEST.in", "pyproject.toml", "comfyui_node/__init__.py", "comfyui_node/README.md"} <= names
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


def test_cache_key_covers_the_include_paths_and_their_shared_layer(tmp_path, monkeypatch):
    """A build whose sources sit elsewhere (the 8-bit benchmark build: bench/sm90_int8/) rebuilds when a
    header of its include path (csrc/sm90_int8/) or of that path's ../common/ changes."""
    monkeypatch.setenv("SAGE_DIFFUSERS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "lab").mkdir()
    (tmp_path / "csrc" / "kernel").mkdir(parents=True)
    (tmp_path / "csrc" / "common").mkdir()
    src = tmp_path / "lab" / "k.cu"
    src.write_text('#include "kernel.cuh"\n')

    def key():
        return _jit.build_info(lambda: _jit.load_extension("sage_inc", [src],
                                                             extra_include_paths=[tmp_path / "csrc" / "kernel"])).key

    before = key()
    for header in (tmp_path / "csrc" / "kernel" / "kernel.cuh", tmp_path / "csrc" / "common" / "shared.cuh"):
        header.write_text("// edited\n")
        assert key() != before, header
        before = key()
