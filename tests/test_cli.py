"""Command line: per-subcommand help, rejections that list the valid values, doctor on the CPU,
exit statuses, program names, closed output pipes."""
import argparse
import enum
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sage_diffusers import __main__ as cli
from sage_diffusers._cli import enum_argument, positive_int
from sage_diffusers.options import Mode

SUBCOMMANDS = ("demo", "selftest", "doctor", "build")
REPO = Path(__file__).resolve().parents[1]


def _run(argv, capsys):
    """(exit status, stdout, stderr) of ``python -m sage_diffusers <argv>``, in process."""
    try:
        status = cli.main(argv, prog=cli.MODULE_PROG)
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_its_own_help(command, capsys):
    status, out, _ = _run([command, "--help"], capsys)
    assert status == 0
    assert out.startswith(f"usage: python -m sage_diffusers {command} [-h]")


def test_help_through_the_real_entry_point():
    res = subprocess.run([sys.executable, "-m", "sage_diffusers", "demo", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "--tokens TOKENS" in res.stdout and "--dtype {bfloat16,float16,float32}" in res.stdout


@pytest.mark.parametrize("argv, message", [
    (["demo", "--tokens", "0"], "argument --tokens: expected a positive integer, got 0"),
    (["demo", "--tokens", "ten"], "argument --tokens: expected a positive integer, got 'ten'"),
    (["demo", "--repeats", "-2"], "argument --repeats: expected a positive integer, got -2"),
    (["demo", "--dtype", "float64"], "invalid choice: 'float64' (choose from"),
    (["demo", "--device", "tpu"], "argument --device: not a torch device: 'tpu'"),
    (["demotest"], "invalid choice: 'demotest' (choose from"),
    (["selftest", "--tokens", "5"], "unrecognized arguments: --tokens 5"),
    (["doctor", "--force"], "unrecognized arguments: --force"),
    ([], "the following arguments are required"),
])
def test_invalid_values_are_rejected_with_the_valid_ones(argv, message, capsys):
    status, _, err = _run(argv, capsys)
    assert status == 2
    assert message in err
    if "invalid choice" in message:
        assert ("bfloat16" in err) if "--dtype" in argv else all(c in err for c in SUBCOMMANDS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_device_rejected_without_cuda(capsys):
    status, _, err = _run(["demo", "--device", "cuda"], capsys)
    assert status == 2 and "CUDA is not available here (use cpu)" in err


def test_demo_runs_small(capsys, monkeypatch):
    from sage_diffusers import demo

    # Two small blocks instead of the real-size ones (their random weights alone take CPU seconds).
    monkeypatch.setattr(demo, "BLOCKS", (demo.BlockConfig("small hd64", 2, 64, 4096),
                                         demo.BlockConfig("small hd128", 2, 128, 4096)))
    status, out, _ = _run(["demo", "--tokens", "48", "--device", "cpu", "--repeats", "1"], capsys)
    assert status == 0
    rows = [line for line in out.splitlines() if "[48 tok" in line]
    assert len(rows) == 6 and {row.split()[-4] for row in rows} == {"sdpa", "int8", "fp4"}
    assert all(float(row.split()[-3]) > 0.95 for row in rows)  # cos vs fp32 SDPA


def test_demo_api_rejects_zero_tokens():
    from sage_diffusers import demo

    with pytest.raises(ValueError, match="tokens: expected a positive sequence length"):
        demo.run(tokens=0, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU report")
def test_doctor_on_cpu(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SAGE_DIFFUSERS_CACHE", str(tmp_path))
    status, out, _ = _run(["doctor"], capsys)
    assert status == 0
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line and not line.startswith(" "))
    assert torch.__version__ in fields["torch"]
    assert fields["GPU"].strip().startswith("none (")
    assert fields["kernel sources"].strip().endswith("(complete)")
    assert fields["JIT cache"].strip() == str(tmp_path / "jit")
    assert {"python", "nvcc", "CUTLASS headers", "sage_diffusers"} <= set(fields)
    assert "  int8  not for this device (no CUDA device)" in out
    assert "  fp4   not for this device (no CUDA device)" in out
    for d in (64, 128):
        assert f"  head dim {d}: SDPA (no CUDA device" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answers")
def test_selftest_and_build_on_cpu_agree(capsys):
    """Issue 40: without a GPU selftest exited 0 and build 1; nothing to do here is 0 for both."""
    status, out, _ = _run(["selftest"], capsys)
    assert status == 0 and "no CUDA device; nothing to check" in out
    status, out, _ = _run(["build"], capsys)
    assert status == 0 and "no CUDA device; nothing to build" in out


@pytest.mark.parametrize("command", ("selftest", "build"))
def test_exit_status_rule_in_help(command, capsys):
    """Issue 40: the exit status rule shared by selftest and build is in their --help and the top one."""
    _, out, _ = _run([command, "--help"], capsys)
    assert "Exit status 1 if" in out and "0 without a CUDA device" in " ".join(out.split())
    _, out, _ = _run(["--help"], capsys)
    assert "1 a self-check or build failed" in " ".join(out.split())


def _subprocess_env(unbuffered):
    """The environment for a child that imports this checkout, with stdout buffered or not."""
    paths = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    return env


# What the console script pip writes for [project.scripts] sage-diffusers does (its __name__ is
# "__main__", the module's is not).
_CONSOLE_SCRIPT = ("import sys; sys.argv[0] = 'sage-diffusers'; "
                   "from sage_diffusers.__main__ import main; sys.exit(main())")


@pytest.mark.parametrize("entry, prog", [
    (["-c", _CONSOLE_SCRIPT], "sage-diffusers"),
    (["-m", "sage_diffusers"], "python -m sage_diffusers"),
])
def test_usage_names_the_program_as_typed(entry, prog):
    """Issue 40: the console script's usage and errors said ``python -m sage_diffusers``."""
    env = _subprocess_env(unbuffered=False)
    res = subprocess.run([sys.executable, *entry, "build", "--help"], capture_output=True, text=True,
                         timeout=120, env=env, cwd=REPO)
    assert res.returncode == 0 and res.stdout.startswith(f"usage: {prog} build [-h]")
    res = subprocess.run([sys.executable, *entry, "bogus"], capture_output=True, text=True,
                         timeout=120, env=env, cwd=REPO)
    assert res.returncode == 2 and f"{prog}: error: argument" in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="doctor is quick without CUDA")
@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
def test_closed_pipe_exits_quietly(unbuffered):
    """Issue 40: ``sage-diffusers doctor | head`` ended in a BrokenPipeError traceback.

    The reader is gone before the first write; buffered, the error comes at the final flush,
    unbuffered at the first print. Either way: no traceback, status 141 (as a shell reports a
    process that SIGPIPE killed).
    """
    proc = subprocess.Popen([sys.executable, "-m", "sage_diffusers", "doctor"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_subprocess_env(unbuffered), cwd=REPO)
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert err.decode() == ""
    assert proc.returncode == cli.EXIT_BROKEN_PIPE == 141


def test_closed_pipe_in_process(monkeypatch, tmp_path):
    """Issue 40: a BrokenPipeError from the output (here --help's) becomes status 141, and stdout
    is pointed at devnull so the interpreter's exit flush stays quiet."""
    class ClosedPipe:
        def __init__(self, fd):
            self.fd = fd

        def write(self, text=None):
            raise BrokenPipeError(32, "Broken pipe")

        flush = write

        def fileno(self):
            return self.fd

    with open(tmp_path / "stdout", "wb") as target:
        monkeypatch.setattr(sys, "stdout", ClosedPipe(target.fileno()))
        assert cli.main(["doctor", "--help"]) == 141
        # fd now refers to devnull: writes succeed and land nowhere.
        assert os.write(target.fileno(), b"gone") == 4
    assert (tmp_path / "stdout").read_bytes() == b""


class Flavour(str, enum.Enum):  # a str enum, whose plain repr argparse would print as Flavour.SAGE3
    FIXED = "fixed"
    SAGE3 = "sage3"


@pytest.mark.parametrize("enum_cls, good, member", [(Mode, "INT8", Mode.INT8), (Flavour, "sage3", Flavour.SAGE3)])
def test_enum_argument_prints_and_parses_values(enum_cls, good, member, capsys):
    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--x", default=list(enum_cls)[0], **enum_argument(enum_cls))
    assert parser.parse_args(["--x", good]).x is member
    values = ",".join(m.value for m in enum_cls)
    assert "{" + values + "}" in parser.format_help()
    assert enum_cls.__name__ + "." not in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--x", "bogus"])
    err = capsys.readouterr().err
    assert f"argument --x: invalid choice 'bogus' (choose from {', '.join(m.value for m in enum_cls)})" in err


def test_positive_int():
    assert positive_int("3") == 3
    for bad in ("0", "-1", "1.5", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)


def _pretend_gpu(monkeypatch, capability):
    """Device queries answer as one GPU of ``capability`` would (nothing runs on it)."""
    from sage_diffusers import selftest

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Pretend GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(selftest, "_driver_cache", ["580.00"])


def test_doctor_on_an_unverified_arch_reports_build_and_self_check(capsys, monkeypatch, tmp_path):
    from sage_diffusers import doctor, selftest
    from sage_diffusers.kernels import fp4

    monkeypatch.setenv("SAGE_DIFFUSERS_CACHE", str(tmp_path))
    _pretend_gpu(monkeypatch, (12, 0))
    assert doctor.report() == 0
    out = capsys.readouterr().out
    assert "Pretend GPU (sm_120), 1 visible" in out and "580.00" in out
    fp4_line = next(line for line in out.splitlines() if line.startswith("  fp4 "))
    assert "fp4: not built yet (" in fp4_line and "not self-checked yet" in fp4_line
    assert "  head dim 128: the fp4 kernel (fp4: not built yet" in out
    assert not (tmp_path / "jit").exists(), "doctor must not build"

    key = selftest.CheckKey(Mode.FP4, "sm_120", "580.00", selftest.kernel_hash(fp4.attention_fp4))
    key.path().parent.mkdir(parents=True)
    key.path().write_text(json.dumps(selftest.Verdict(selftest.Status.FAILED, "cos 0.5 (needs >= 0.999)", 0.5).to_json()))
    doctor.report()
    assert "self-check FAILED: cos 0.5 (needs >= 0.999)" in capsys.readouterr().out
