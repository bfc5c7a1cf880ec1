"""bench/sass_diff.py compare (CPU, synthetic dumps): a BASE kernel must stay identical in its unit or
in another AFTER unit it moved to (the pre-pass modes moved from the shipped pre-pass unit to the
benchmark build's); kernels and units only in AFTER are additions."""
from __future__ import annotations

from pathlib import Path

from _util import load_bench_script


def _unit(folder: Path, name: str, kernels: dict[str, str]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.sass").write_text("".join(f"\tFunction : {k}\n{body}\n" for k, body in kernels.items()))
    (folder / f"{name}.log").write_text("".join(f"ptxas info    : Compiling entry function '{k}' for 'sm_90a'\n"
                                                f"ptxas info    : Used 40 registers\n" for k in kernels))


def test_compare_follows_moved_kernels_and_accepts_added_units(tmp_path, capsys):
    sd = load_bench_script("sass_diff")
    base, after = tmp_path / "base", tmp_path / "after"
    _unit(base, "i8_prepass", {"_Z5statsILi2EE": "MOV R1;", "_Z5statsILi0EE": "IADD R2;"})
    _unit(after, "i8_prepass", {"_Z5statsILi2EE": "MOV R1;"})
    _unit(after, "i8_prepass_modes", {"_Z5statsILi2EE": "MOV R1;", "_Z5statsILi0EE": "IADD R2;"})
    assert sd.compare(base, after) == 0
    out = capsys.readouterr().out
    assert "1 moved to i8_prepass_modes" in out and "ADDED" in out and "ALL IDENTICAL" in out
    # a moved kernel whose body changed is a difference, and so is one no AFTER unit holds
    _unit(after, "i8_prepass_modes", {"_Z5statsILi2EE": "MOV R1;", "_Z5statsILi0EE": "IADD R3;"})
    assert sd.compare(base, after) == 1
    (after / "i8_prepass_modes.sass").unlink()
    (after / "i8_prepass_modes.log").unlink()
    assert sd.compare(base, after) == 1


def test_compare_ignores_the_column_padding(tmp_path):
    """cuobjdump pads each line to the longest instruction of the file: a unit with fewer kernels has
    narrower columns, the same code."""
    sd = load_bench_script("sass_diff")
    _unit(tmp_path / "base", "u", {"k": "        /*0000*/   MOV R1, R2 ;        /* 0x1 */"})
    _unit(tmp_path / "after", "u", {"k": "        /*0000*/ MOV R1, R2 ; /* 0x1 */"})
    assert sd.compare(tmp_path / "base", tmp_path / "after") == 0
    _unit(tmp_path / "after", "u", {"k": "        /*0000*/ MOV R1, R3 ; /* 0x1 */"})
    assert sd.compare(tmp_path / "base", tmp_path / "after") == 1
