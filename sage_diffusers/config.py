"""Every environment variable sage_diffusers reads: its values, default, when it is read and why.

This module is the only place in the package that reads ``os.environ``. Each variable is a
:class:`Variable` in :data:`VARIABLES`, and each has an accessor here (:func:`cache`,
:func:`sagebwd_bwd`, ...) that reads the environment when called, never earlier, so a test
that sets a variable with ``monkeypatch.setenv`` sees its effect on the next call. Modules that
must fix a value once (a Triton decorator, a flag that torch.compile must not see looked up)
call the accessor at their own import and say so in :data:`VARIABLES`' ``read`` column.

Rules common to all variables:

- unset, empty or only spaces: the default;
- a value that is not accepted raises ``ValueError`` naming the variable, the value and what is
  accepted (values are never silently replaced by the default);
- flags accept ``1``, ``true``, ``yes``, ``on`` and ``0``, ``false``, ``no``, ``off`` in any
  case; choices are case-sensitive, as the enums they select.

``docs/configuration.md`` holds :func:`markdown_table`'s output (``python -m
sage_diffusers.config --write`` updates it; ``tests/test_config.py`` checks that it is current).
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from .kernels._fp4_variants import DEFAULT_KERNEL_OPT, KernelOpt
from .kernels._sm90_int8_variants import BENCH_VARIANTS as _SM90_BENCH_VARIANTS
from .kernels._sm90_int8_variants import COMPILED_EXP_POLY

__all__ = [
    "Variable", "VARIABLES", "markdown_table", "parse_fp4_opt", "fp4_opt_name",
    "cache", "csrc", "auto_calibrate", "sm90_bench", "exp_poly", "fp4_atom", "fp4_emu", "fp4_opt",
    "fp4_no_hw_e2m1", "triton_autotune", "sagebwd_acc", "sagebwd_bwd",
    "triton_interpret", "cutlass_include", "max_jobs", "xdg_cache_home",
]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
FLAG_VALUES = "`1` / `0` (also true/false, yes/no, on/off)"


@dataclasses.dataclass(frozen=True)
class Variable:
    """One environment variable and how it is parsed.

    Attributes
    ----------
    name : str
        The variable's name.
    parse : callable
        ``parse(text) -> value`` for a set, non-empty value; raises ValueError (any message) on a
        value that is not accepted.
    default : object
        The value when unset or empty (None where the reader decides, e.g. per device).
    accepted : str
        The accepted values, in words (the table's "Values" column and the ValueError's).
    default_doc : str
        The default, in words.
    read : str
        When the package reads it (at each call, or once at a module's import).
    use : str
        Who sets it: ``user``, ``benchmark``, ``debug``, ``external`` (another project's variable
        that the package reads too) or ``eval`` (read by ``eval/`` only, not by the package).
    why : str
        What it is for, in one line.
    strip : bool
        Strip surrounding spaces before parsing (False for paths).
    """

    name: str
    parse: Callable[[str], Any]
    default: Any
    accepted: str
    default_doc: str
    read: str
    use: str
    why: str
    strip: bool = True

    def raw(self) -> Optional[str]:
        """The value in the environment now, or None when it is unset, empty or only spaces."""
        value = os.environ.get(self.name)
        if value is None or not value.strip():
            return None
        return value.strip() if self.strip else value

    def get(self) -> Any:
        """The parsed value in the environment now (:attr:`default` when unset or empty).

        Raises
        ------
        ValueError
            The value is not accepted; the message names the variable, the value and
            :attr:`accepted`.
        """
        value = self.raw()
        if value is None:
            return self.default
        try:
            return self.parse(value)
        except ValueError as exc:
            detail = f" ({exc})" if str(exc) else ""
            raise ValueError(f"{self.name}={value!r} is not accepted{detail}; expected "
                             f"{_plain(self.accepted)}") from None


def _plain(markdown: str) -> str:
    """Table text as an error message shows it (no backticks)."""
    return markdown.replace("`", "")


def _flag(text: str) -> bool:
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError("")


def _choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in values:
            raise ValueError("")
        return text
    return parse


def _choices_doc(values) -> str:
    return " / ".join(f"`{v}`" for v in values)


def _int_at_least(minimum: int, allowed: Optional[frozenset] = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not re.fullmatch(r"[+-]?[0-9]+", text):  # ASCII digits: int() also takes "1_0" and other scripts
            raise ValueError("")
        value = int(text)
        if value < minimum or (allowed is not None and value not in allowed):
            raise ValueError("")
        return value
    return parse


def _path(text: str) -> Path:
    return Path(text)


# ---- FP4 option sets (KernelOpt from csrc/fp4/generate_options.py) ---------------------------------------
_FP4_OPT_LIMIT = 1 << len(KernelOpt)  # bits above the options' are refused
_FP4_OPT_NAMES = tuple(m.lower() for m in KernelOpt.__members__)


def fp4_opt_name(opt: int) -> str:
    """The name of an FP4 option set as ``SAGE_DIFFUSERS_FP4_OPT`` accepts it: the option names
    joined by "+" ("hoist_mask+tree_reduce"), "none" for no option."""
    return "+".join(o.name.lower() for o in KernelOpt if int(opt) & o) or "none"


def parse_fp4_opt(raw: str) -> KernelOpt:
    """An FP4 option set from its bits as an integer ("3") or its :func:`fp4_opt_name`
    ("hoist_mask+tree_reduce", "none"; names in any case and order).

    Raises
    ------
    ValueError
        Unknown names, or bits outside the options'.
    """
    text = raw.strip()
    if re.fullmatch(r"[0-9]+", text):  # ASCII digits only: int() also takes "1_0" and other scripts
        bits = int(text)
    else:
        parts = [n.strip().upper() for n in text.split("+")]
        names = parts if all(parts) else []  # "a++b", "+a", "a+": refused, not read as "a+b"
        if names == ["NONE"]:
            return KernelOpt(0)
        unknown = [n for n in names if n not in KernelOpt.__members__]
        if unknown or not names:
            raise ValueError(f"not an FP4 option set: {raw!r} (option names joined by '+': "
                             f"{', '.join(_FP4_OPT_NAMES)}; 'none'; or their bits as an integer)") from None
        bits = int(sum(KernelOpt[n] for n in set(names)))
    if not 0 <= bits < _FP4_OPT_LIMIT:
        raise ValueError(f"FP4 option bits must be in [0, {_FP4_OPT_LIMIT}), got {bits}")
    return KernelOpt(bits)


# exp2 polynomial shares some build compiles (regular per head dim, and the benchmark build's)
_EXP_POLY_SHARES = frozenset(s for shares in COMPILED_EXP_POLY.values() for s in shares) | frozenset(
    v[1] for v in _SM90_BENCH_VARIANTS)
_EXP_POLY_DOC = "; ".join(f"D = {d}: {', '.join(map(str, s))}" for d, s in sorted(COMPILED_EXP_POLY.items()))

# The values of the enums these select (sagebwd_triton.AccConvert / BwdKernels, fp4.Atom / EmuGemm;
# tests/test_config.py checks that they agree: the enums' modules import torch and Triton, this one
# must not).
SAGEBWD_ACC_VALUES = ("xu", "alu")
SAGEBWD_BWD_VALUES = ("split", "lean", "fused", "sm90")
SAGEBWD_SCORES_VALUES = ("int8", "fp16")  # reference.sagebwd.ScorePrecision
INT8_PRECISION_VALUES = ("fast", "accurate")  # options.Int8Precision
FP4_ATOM_VALUES = ("native", "emulated")
FP4_EMU_VALUES = ("auto", "mma", "wgmma")


# ---- the variables ---------------------------------------------------------------------------------------
CACHE = Variable(
    "SAGE_DIFFUSERS_CACHE", _path, None, "a folder",
    "`$XDG_CACHE_HOME/sage_diffusers` (`~/.cache/sage_diffusers`)",
    "at each use of the cache", "user",
    "Where compiled kernels, self-check verdicts and auto calibrations are kept (in `<folder>/jit`).",
    strip=False)
CSRC = Variable(
    "SAGE_DIFFUSERS_CSRC", _path, None, "a folder holding `fp4/`, `sm90_int8/`, `common/`",
    "`csrc/` of a checkout, else the wheel's `sage_diffusers/_csrc`",
    "at each kernel source lookup", "user",
    "Build the kernels from another copy of the CUDA sources.", strip=False)
AUTO_CALIBRATE = Variable(
    "SAGE_DIFFUSERS_AUTO_CALIBRATE", _flag, True, FLAG_VALUES, "`1`",
    "when `auto` first needs a table for a GPU", "user",
    "`0`: an sm_90 GPU without a measured table takes the conservative rule instead of a one-time "
    "calibration.")
SM90_BENCH = Variable(
    "SAGE_DIFFUSERS_SM90_BENCH", _flag, False, FLAG_VALUES, "`0`",
    "once, when `kernels.int8_sm90` is imported", "benchmark",
    "`1`: build the 8-bit kernel's benchmark variants (`bench/`, `eval/`) instead of the regular "
    "build.")
EXP_POLY = Variable(
    "SAGE_DIFFUSERS_EXP_POLY", _int_at_least(0, _EXP_POLY_SHARES), None,
    f"an integer the build compiles ({_EXP_POLY_DOC})", "per head dim, from the kernel's generator",
    "once, when `kernels.int8_sm90` is imported", "benchmark",
    "Share of the 8-bit kernel's exp2 computed by an FMA polynomial (every N-th element, `0`: "
    "none), at the head dims compiled with that share (the others keep their default).")
INT8_PRECISION = Variable(
    "SAGE_DIFFUSERS_INT8_PRECISION", _choice(*INT8_PRECISION_VALUES), "fast", _choices_doc(INT8_PRECISION_VALUES),
    "`fast`", "once, when `sage_diffusers` is imported (its dispatch module)", "user",
    "The 8-bit path's P~.V product where `sd.attention` gets no `int8_precision` (the diffusers and "
    "ComfyUI integrations where they are not given one): `fast` (FP8) or `accurate` (16-bit: about a third of the error, "
    "0-20 % more time per call on an H100).")
FP4_ATOM = Variable(
    "SAGE_DIFFUSERS_FP4_ATOM", _choice(*FP4_ATOM_VALUES), None, _choices_doc(FP4_ATOM_VALUES),
    "`native` on sm_120/121, `emulated` on sm_90", "at each FP4 build", "debug",
    "Which MMA atom the FP4 kernel is built with (`native` needs sm_120a/121a).")
FP4_EMU = Variable(
    "SAGE_DIFFUSERS_FP4_EMU", _choice(*FP4_EMU_VALUES), "auto", _choices_doc(FP4_EMU_VALUES),
    "`auto`", "at each FP4 call", "benchmark",
    "GEMM variant of the emulated FP4 atom (`auto`: `wgmma` where the build has it, else `mma`).")
FP4_OPT = Variable(
    "SAGE_DIFFUSERS_FP4_OPT", parse_fp4_opt, None,
    f"option names joined by `+` ({', '.join(f'`{n}`' for n in _FP4_OPT_NAMES)}), `none`, or their "
    f"bits as an integer in [0, {_FP4_OPT_LIMIT})",
    f"`{fp4_opt_name(DEFAULT_KERNEL_OPT)}`", "at each FP4 build and availability check", "benchmark",
    "The FP4 kernel's performance options (one build per option set).")
FP4_NO_HW_E2M1 = Variable(
    "SAGE_DIFFUSERS_FP4_NO_HW_E2M1", _flag, False, FLAG_VALUES, "`0`", "at each FP4 build", "debug",
    "`1`: the integer E2M1 encoder on sm_120 too, instead of `cvt.rn.satfinite.e2m1x2`.")
TRITON_AUTOTUNE = Variable(
    "SAGE_DIFFUSERS_TRITON_AUTOTUNE", _int_at_least(0), 1, "an integer >= 0", "`1`",
    "once, when `kernels.sagebwd_triton` is imported", "user",
    "Triton kernels' launch parameters: `0` the first config (no tuning), `1` tune over all, `N` "
    "over the first N.")
SAGEBWD_ACC = Variable(
    "SAGE_DIFFUSERS_SAGEBWD_ACC", _choice(*SAGEBWD_ACC_VALUES), "xu", _choices_doc(SAGEBWD_ACC_VALUES),
    "`xu`", "at each SageBwd Triton call", "benchmark",
    "Which int32 -> float32 conversions stay on the conversion pipe (same numerics, speed only).")
SAGEBWD_BWD = Variable(
    "SAGE_DIFFUSERS_SAGEBWD_BWD", _choice(*SAGEBWD_BWD_VALUES), None, _choices_doc(SAGEBWD_BWD_VALUES),
    "`lean` at D = 128; `fused` at D <= 64 unless torch's deterministic algorithms are on",
    "at each SageBwd backward", "user",
    "SageBwd's backward kernels (`split`, `lean`: deterministic, same bits; `fused`: dQ by atomics; `sm90`: "
    "Hopper's CUDA kernels where they apply (16-bit scores, no mask, not causal, no GQA, head dim 64 / 128, "
    "lengths multiples of 128), the default elsewhere).")
SAGEBWD_SCORES = Variable(
    "SAGE_DIFFUSERS_SAGEBWD_SCORES", _choice(*SAGEBWD_SCORES_VALUES), "fp16", _choices_doc(SAGEBWD_SCORES_VALUES),
    "`fp16`", "at each SageBwd forward", "user",
    "SageBwd's scores (`sd.attention(mode=\"int8\")` with gradients, `sd.sagebwd` without `scores=`): `fp16` "
    "(Q.K^T and P~.V in 16 bits) keeps sharp heads' gradients accurate at the same measured speed; `int8` is "
    "the paper's.")
TRITON_INTERPRET = Variable(
    "TRITON_INTERPRET", lambda text: text == "1", False, "`1` on, anything else off", "off",
    "once, when `kernels.sagebwd_triton` is imported", "external",
    "Triton's CPU interpreter: the SageBwd kernels run on the CPU (tests).")
CUTLASS_INCLUDE = Variable(
    "CUTLASS_INCLUDE", _path, None, "a CUTLASS `include/` folder",
    "the headers of the `nvidia-cutlass` package", "at each kernel build and availability check",
    "external", "CUTLASS/CuTe headers the CUDA kernels are compiled with.", strip=False)
MAX_JOBS = Variable(
    "MAX_JOBS", _int_at_least(0), None, "an integer >= 0", "the CPU count",
    "at each cold build (PyTorch's extension builder reads it too)", "external",
    "Parallel nvcc jobs; the package uses it for the first build's time estimate.")
XDG_CACHE_HOME = Variable(
    "XDG_CACHE_HOME", _path, None, "a folder", "`~/.cache`",
    "at each use of the cache, when `SAGE_DIFFUSERS_CACHE` is unset", "external",
    "The user's cache folder; the JIT cache is `<folder>/sage_diffusers/jit`.", strip=False)
COMMIT = Variable(
    "SAGE_DIFFUSERS_COMMIT", str, None, "a commit id", "`git rev-parse --short HEAD`",
    "by `eval/calibrate_auto.py` only", "eval",
    "The commit a calibration run records (a copied tree's `.git` can be stale).")

VARIABLES: dict[str, Variable] = {v.name: v for v in (
    CACHE, CSRC, AUTO_CALIBRATE, SM90_BENCH, EXP_POLY, INT8_PRECISION, FP4_ATOM, FP4_EMU, FP4_OPT, FP4_NO_HW_E2M1,
    TRITON_AUTOTUNE, SAGEBWD_ACC, SAGEBWD_BWD, SAGEBWD_SCORES, TRITON_INTERPRET, CUTLASS_INCLUDE, MAX_JOBS,
    XDG_CACHE_HOME, COMMIT,
)}


# ---- accessors: each reads the environment when called ---------------------------------------------------
def cache() -> Optional[Path]:
    """``SAGE_DIFFUSERS_CACHE``: the cache folder, or None for the default."""
    return CACHE.get()


def csrc() -> Optional[Path]:
    """``SAGE_DIFFUSERS_CSRC``: the kernel source folder, or None for the default."""
    return CSRC.get()


def auto_calibrate() -> bool:
    """``SAGE_DIFFUSERS_AUTO_CALIBRATE``: whether ``auto`` may calibrate a GPU on first use."""
    return AUTO_CALIBRATE.get()


def sm90_bench() -> bool:
    """``SAGE_DIFFUSERS_SM90_BENCH``: whether the 8-bit kernel is the benchmark build."""
    return SM90_BENCH.get()


def exp_poly() -> Optional[int]:
    """``SAGE_DIFFUSERS_EXP_POLY``: the exp2 polynomial share for every head dim, or None for the
    per-head-dim default."""
    return EXP_POLY.get()


def int8_precision() -> str:
    """``SAGE_DIFFUSERS_INT8_PRECISION``: the default of ``sd.attention``'s ``int8_precision``."""
    return INT8_PRECISION.get()


def fp4_atom() -> Optional[str]:
    """``SAGE_DIFFUSERS_FP4_ATOM``: "native" or "emulated", or None for the device's default."""
    return FP4_ATOM.get()


def fp4_emu() -> str:
    """``SAGE_DIFFUSERS_FP4_EMU``: "auto", "mma" or "wgmma"."""
    return FP4_EMU.get()


def fp4_opt() -> KernelOpt:
    """``SAGE_DIFFUSERS_FP4_OPT``: the FP4 option set (``DEFAULT_KERNEL_OPT`` when unset)."""
    opt = FP4_OPT.get()
    return DEFAULT_KERNEL_OPT if opt is None else opt


def fp4_no_hw_e2m1() -> bool:
    """``SAGE_DIFFUSERS_FP4_NO_HW_E2M1``: whether sm_120 builds use the integer E2M1 encoder."""
    return FP4_NO_HW_E2M1.get()


def triton_autotune() -> int:
    """``SAGE_DIFFUSERS_TRITON_AUTOTUNE``: 0 (first config), 1 (all configs) or N (the first N)."""
    return TRITON_AUTOTUNE.get()


def sagebwd_acc() -> str:
    """``SAGE_DIFFUSERS_SAGEBWD_ACC``: "xu" or "alu"."""
    return SAGEBWD_ACC.get()


def sagebwd_bwd() -> Optional[str]:
    """``SAGE_DIFFUSERS_SAGEBWD_BWD``: "split", "lean", "fused" or "sm90", or None for the per-head-dim default."""
    return SAGEBWD_BWD.get()


def sagebwd_scores() -> str:
    """``SAGE_DIFFUSERS_SAGEBWD_SCORES``: "int8" or "fp16"."""
    return SAGEBWD_SCORES.get()


def triton_interpret() -> bool:
    """``TRITON_INTERPRET``: whether Triton runs its CPU interpreter (the package's reading: "1")."""
    return TRITON_INTERPRET.get()


def cutlass_include() -> Optional[Path]:
    """``CUTLASS_INCLUDE``: a CUTLASS include folder, or None for the ``nvidia-cutlass`` package's."""
    return CUTLASS_INCLUDE.get()


def max_jobs() -> Optional[int]:
    """``MAX_JOBS``: parallel build jobs, or None for the CPU count."""
    return MAX_JOBS.get()


def xdg_cache_home() -> Optional[Path]:
    """``XDG_CACHE_HOME``: the user's cache folder, or None for ``~/.cache``."""
    return XDG_CACHE_HOME.get()


# ---- docs/configuration.md --------------------------------------------------------------------------------
DOC_PATH = Path("docs") / "configuration.md"  # relative to a checkout's root
BEGIN = "<!-- BEGIN generated by `python -m sage_diffusers.config --write`; do not edit by hand -->"
END = "<!-- END generated -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """The table of every variable, as ``docs/configuration.md`` holds it between its markers."""
    lines = ["| Variable | Values | Default | Read | Use | What for |",
             "| --- | --- | --- | --- | --- | --- |"]
    for v in VARIABLES.values():
        cells = (f"`{v.name}`", v.accepted, v.default_doc, v.read, v.use, v.why)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def render_doc(text: str) -> str:
    """``text`` (the doc's contents) with the part between its markers replaced by :func:`markdown_table`."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"{DOC_PATH}: the markers {BEGIN!r} and {END!r} are missing")
    return f"{head}{BEGIN}\n{markdown_table()}{END}{tail}"


def _main(argv: list[str]) -> int:
    """``python -m sage_diffusers.config [--write]``: print the table, or update the doc in a checkout."""
    if argv == ["--write"]:
        path = Path(__file__).resolve().parents[1] / DOC_PATH
        path.write_text(render_doc(path.read_text()))
        print(f"wrote {path}")
        return 0
    if argv:
        print("usage: python -m sage_diffusers.config [--write]", file=sys.stderr)
        return 2
    sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
