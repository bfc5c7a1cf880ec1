"""Argument types and file loaders shared by the eval command lines.

Two rules hold in every eval script:

- arguments are checked while the command line is parsed (the ``type=`` functions below) or in a
  validation step right after it, so a bad value is refused before any model is built or any sample
  generated;
- every file a script reads (captures, weights, prompt files, results of earlier runs) goes through a
  loader here or a schema check built on one, which raises :class:`InputError` naming the file and
  what was expected of it, instead of the error of whatever library first tripped over it.

Weights load with safetensors or ``torch.load(weights_only=True)`` only (:func:`load_state_dict`).
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Iterable

# safetensors dtype names of floating tensors (what attention inputs may be stored as)
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


class InputError(ValueError):
    """A file or argument given to an eval script is not what it expects; the message names it."""


# ---------------------------------------------------------------------------------------------
# argparse types (they raise ArgumentTypeError, whose message argparse prints after the option)

def _int_at_least(text: str, low: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """A count that must be at least 1 (samples, steps, rounds, repetitions)."""
    return _int_at_least(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    """A count that may be 0 (warm-up iterations, indices)."""
    return _int_at_least(text, 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """A finite number > 0 (learning rates, time budgets, target times)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def int_set(text: str) -> set[int]:
    """Comma separated integers >= 0, e.g. ``0,14,27``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        values = {int(p) for p in parts}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma separated integers >= 0 (e.g. 0,14,27), "
                                         f"got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma separated integers >= 0 (e.g. 0,14,27), got {text!r}")
    return values


def shape(text: str) -> tuple[int, int, int, int]:
    """An attention shape ``BxHxSxD`` of four positive integers, e.g. ``1x24x16384x128``."""
    parts = text.lower().split("x")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if len(dims) != 4 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected a shape BxHxSxD of four positive integers "
                                         f"(e.g. 1x24x16384x128), got {text!r}")
    return dims  # type: ignore[return-value]


def shape_list(text: str) -> list[tuple[int, int, int, int]]:
    """Comma separated shapes ``BxHxSxD[,...]``."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma separated shapes BxHxSxD, got {text!r}")
    return [shape(t) for t in items]


def choice_list(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """Type of a comma separated list whose items must be among ``choices``."""
    allowed = tuple(choices)

    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if not items or bad:
            what = f"unknown {', '.join(map(repr, bad))}; " if bad else ""
            raise argparse.ArgumentTypeError(f"{what}expected a comma separated subset of {', '.join(allowed)}")
        return items
    return parse


def existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file" if not path.exists() else f"{text}: not a file")
    return path


def existing_dir(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such folder" if not path.exists() else f"{text}: not a folder")
    return path


def existing_path(text: str) -> Path:
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or folder")
    return path


def output_file(text: str) -> Path:
    """A file the script writes at its end: refused now if that write would fail then."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a folder (expected a file path to write)")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: folder {path.parent} does not exist")
    return path


def output_dir(text: str) -> Path:
    """A folder the script creates or fills: created here, so that a file in the way or a place that
    cannot hold it is refused before any work, naming the folder."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: cannot create this folder ({exc.strerror or exc})") from None
    return path


def device_argument(text: str) -> str:
    """argparse type: a torch device string that exists on this machine (the package's rule)."""
    from sage_diffusers._cli import device_argument as check

    return check(text)


def name_equals_path(names: Iterable[str]) -> Callable[[str], tuple[str, Path]]:
    """Type of ``NAME=PATH`` options (e.g. ``--weights clip_l14=/models/clip``).

    NAME must be one of ``names`` and PATH an existing file or folder.
    """
    known = tuple(names)

    def parse(text: str) -> tuple[str, Path]:
        name, sep, path = text.partition("=")
        name, path = name.strip(), path.strip()
        form = f"expected NAME=PATH with NAME one of {', '.join(known)} and PATH a local file or folder"
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"{form}, got {text!r}")
        if name not in known:
            raise argparse.ArgumentTypeError(f"unknown NAME {name!r} in {text!r}; {form}")
        if not Path(path).exists():
            raise argparse.ArgumentTypeError(f"{text}: {path} does not exist ({form})")
        return name, Path(path)
    return parse


def unique_pairs(pairs: Iterable[tuple[str, Path]], option: str) -> dict[str, str]:
    """``NAME=PATH`` pairs as a dict; a NAME given twice is refused rather than silently overridden."""
    out: dict[str, str] = {}
    for name, path in pairs:
        if name in out and out[name] != str(path):
            raise InputError(f"{option} {name}= given twice ({out[name]} and {path})")
        out[name] = str(path)
    return out


# ---------------------------------------------------------------------------------------------
# file loaders

def read_text(path: "str | Path", what: str) -> str:
    """The UTF-8 text of ``path``; ``what`` says what the file is for (in the error)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{what} {path}: is a folder (expected a UTF-8 text file)") from None
    except OSError as e:
        raise InputError(f"{what} {path}: cannot be read ({e.strerror or e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise InputError(f"{what} {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}, "
                         f"line {line}); expected a UTF-8 text file") from None


def read_json(path: "str | Path", what: str, keys: Iterable[str] = ()) -> dict:
    """A JSON object from ``path`` that has at least ``keys``."""
    path = Path(path)
    text = read_text(path, what)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{what} {path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # an integer past Python's digit limit; nesting past the parser's
        raise InputError(f"{what} {path}: not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise InputError(f"{what} {path}: expected a JSON object, got {type(data).__name__}")
    missing = [k for k in keys if k not in data]
    if missing:
        raise InputError(f"{what} {path}: missing key(s) {', '.join(map(repr, missing))} "
                         f"(expected {', '.join(map(repr, keys))})")
    return data


def safetensors_header(path: "str | Path", what: str) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict]:
    """``{name: (dtype, shape)}`` and the string metadata of a safetensors file, without its data."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} {path}: no such file" if not path.exists() else f"{what} {path}: not a file")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = {n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape())) for n in f.keys()}
            meta = f.metadata() or {}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for every malformed header
        raise InputError(f"{what} {path}: not a readable safetensors file ({e})") from None
    return header, meta


def read_safetensors(path: "str | Path", what: str, device: str = "cpu") -> tuple[dict, dict]:
    """All tensors (``{name: tensor}``) and the metadata of a safetensors file."""
    from safetensors import safe_open

    safetensors_header(path, what)  # a malformed header is reported as such, before any data is read
    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            return {n: f.get_tensor(n) for n in f.keys()}, (f.metadata() or {})
    except Exception as e:  # noqa: BLE001 - truncated data surfaces here, as safetensors' own error
        raise InputError(f"{what} {path}: tensor data cannot be read ({e})") from None


def load_state_dict(path: "str | Path", what: str, nested: Iterable[str] = ("state_dict",)) -> dict:
    """A state dict (parameter name -> tensor) from ``.safetensors`` or a torch checkpoint.

    Torch checkpoints load with ``weights_only=True``: a file that needs arbitrary unpickling is
    refused. A checkpoint that wraps its state dict under one of ``nested`` is unwrapped.
    """
    import torch

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} {path}: no such file" if not path.exists() else f"{what} {path}: not a file")
    if path.suffix == ".safetensors":
        return read_safetensors(path, what)[0]
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - corrupt zips, truncated pickles and unsafe globals all land here
        raise InputError(f"{what} {path}: not a torch checkpoint that loads with weights_only=True "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    for key in nested:
        if isinstance(state, Mapping) and isinstance(state.get(key), Mapping):
            state = state[key]
            break
    if not isinstance(state, Mapping) or not state:
        raise InputError(f"{what} {path}: expected a state dict (parameter name -> tensor), "
                         f"got {type(state).__name__}{' (empty)' if isinstance(state, Mapping) else ''}")
    bad = [k for k, v in state.items() if not isinstance(k, str) or not torch.is_tensor(v)]
    if bad:
        raise InputError(f"{what} {path}: expected a state dict (parameter name -> tensor); "
                         f"{len(bad)} entries are not, e.g. {bad[0]!r}")
    return dict(state)


def check_state_dict_keys(path: "str | Path", what: str, missing: Iterable[str], unexpected: Iterable[str] = (),
                          ignore: Callable[[str], bool] = lambda k: False) -> None:
    """Refuse weights that leave parameters of the model unset (from ``load_state_dict(strict=False)``)."""
    missing = [k for k in missing if not ignore(k)]
    if missing:
        unexpected = list(unexpected)
        raise InputError(f"{what} {path}: {len(missing)} parameters of the model are missing, e.g. "
                         f"{missing[:3]}" + (f"; unexpected keys, e.g. {unexpected[:3]}" if unexpected else ""))
