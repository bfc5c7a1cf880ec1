#!/usr/bin/env python3
"""SASS of every shipped kernel instantiation and benchmark variant, and a per-kernel comparison of
two such dumps: the proof that a refactor of csrc/ leaves the generated code as it was (no GPU).

    python csrc/sass_diff.py dump OUT [--root CSRC] [--only REGEX]   # OUT/<unit>.sass + ptxas logs
    python csrc/sass_diff.py compare BASE AFTER           # exit 1 on any difference

Each unit is compiled device-only (nvcc -cubin) with the flags of its JIT build
(sage_diffusers/kernels/{int8_sm90,fp4}.py, plus torch's half-operator defines), so the SASS is
what the extension holds. Units are named by kernel, arch and file (FP4 also by SAGE_FP4_OPT);
``compare`` matches kernels by mangled name and, for units whose names changed (a renamed
template argument, an anonymous namespace's per-file hash), by identical body and ptxas
register / spill line. Needs nvcc and cuobjdump (CUDA 12.8+ for sm_120a; triton's bundled
cuobjdump works).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TORCH_DEFS = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
              "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]
INT8_UNDEFS = [d.replace("-D", "-U", 1) for d in TORCH_DEFS]  # int8_sm90.py undoes them
FP4_OPTS_SM90 = (0, 1, 3, 4, 7)    # variants_bench.sh's variants (7 = the default)
FP4_WGMMA_EXTRA = (15,)            # 7 without the warpgroup ping-pong
FP4_OPTS_SM120 = (3, 7)


def units(root: Path) -> list[tuple[str, Path, str, list[str]]]:
    """(name, source, arch, extra flags) of every unit to compile."""
    i8, f4 = root / "sm90_int8", root / "fp4"
    out = [("i8_prepass", i8 / "prepass.cu", "90a", INT8_UNDEFS + [f"-I{i8}"]),
           ("i8_dispatch", i8 / "dispatch.cu", "90a", INT8_UNDEFS + [f"-I{i8}"]),
           ("i8_dispatch_bench", i8 / "dispatch.cu", "90a", INT8_UNDEFS + [f"-I{i8}", "-DSAGE_SM90_BENCH=1"])]
    for src in sorted((i8 / "instantiations").glob("*.cu")):
        bench = ["-DSAGE_SM90_BENCH=1"] if src.name.startswith("bench_") else []
        out.append((f"i8_{src.stem}", src, "90a", INT8_UNDEFS + [f"-I{i8}"] + bench))
    fp4 = [f"-I{f4}"]
    out += [("fp4_prepass_sm90", f4 / "quant_prepass.cu", "90a", fp4 + ["-DSAGE_FP4_NATIVE=0"]),
            ("fp4_prepass_sm120", f4 / "quant_prepass.cu", "120a", fp4 + ["-DSAGE_FP4_NATIVE=1"])]
    for o in FP4_OPTS_SM120:
        out.append((f"fp4_native_sm120_opt{o}", f4 / "attention_fwd_native.cu", "120a",
                    fp4 + ["-DSAGE_FP4_NATIVE=1", f"-DSAGE_FP4_OPT={o}"]))
    for o in FP4_OPTS_SM90:
        out.append((f"fp4_emulated_sm90_opt{o}", f4 / "attention_fwd_emulated.cu", "90a",
                    fp4 + ["-DSAGE_FP4_NATIVE=0", f"-DSAGE_FP4_OPT={o}"]))
    for o in FP4_OPTS_SM90 + FP4_WGMMA_EXTRA:
        out.append((f"fp4_wgmma_sm90_opt{o}", f4 / "attention_fwd_emulated_wgmma.cu", "90a",
                    fp4 + ["-DSAGE_FP4_NATIVE=0", f"-DSAGE_FP4_OPT={o}"]))
    return out


def cutlass_include() -> str:
    env = os.environ.get("CUTLASS_INCLUDE")
    if env:
        return env
    import cutlass_library

    return str(Path(cutlass_library.__file__).parent / "source" / "include")


def dump(out: Path, root: Path, only: str = "") -> int:
    out.mkdir(parents=True, exist_ok=True)
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None:
        try:
            import triton

            cuobjdump = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
        except ImportError:
            sys.exit("cuobjdump not found (install the CUDA toolkit's or triton's)")
    status = 0
    for name, src, arch, extra in units(root):
        if only and not re.search(only, name):
            continue
        cubin, log = out / f"{name}.cubin", out / f"{name}.log"
        cmd = [os.environ.get("NVCC", "nvcc"), "-std=c++20", "-O3", *TORCH_DEFS, "--expt-relaxed-constexpr",
               "-DNDEBUG", "-lineinfo", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v",
               f"-I{cutlass_include()}", *extra, "-cubin", str(src), "-o", str(cubin)]
        with open(log, "w") as f:
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
        if rc != 0:
            print(f"FAIL {name}: {log}")
            status = 1
            continue
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
        (out / f"{name}.sass").write_text(sass)
        cubin.unlink()
        print(f"ok   {name}", flush=True)
    return status


def kernels(sass: Path) -> dict[str, str]:
    """Mangled kernel name -> SASS body."""
    res, cur, body = {}, None, []
    for line in sass.read_text().splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if cur:
                res[cur] = "\n".join(body)
            cur, body = m.group(1), []
        elif cur is not None:
            body.append(line)
    if cur:
        res[cur] = "\n".join(body)
    return res


def resources(log: Path) -> dict[str, tuple[int, int]]:
    """Mangled kernel name -> (registers, spill-store bytes) from a ptxas -v log."""
    res, fn, spill = {}, None, 0
    for line in log.read_text().splitlines():
        if m := re.search(r"Compiling entry function '(\S+)'", line):
            fn = m.group(1)
        if m := re.search(r"(\d+) bytes spill stores", line):
            spill = int(m.group(1))
        if (m := re.search(r"Used (\d+) registers", line)) and fn:
            res[fn] = (int(m.group(1)), spill)
    return res


def compare(base: Path, after: Path) -> int:
    names = sorted({p.stem for p in base.glob("*.sass")} | {p.stem for p in after.glob("*.sass")})
    status = 0
    for n in names:
        b, a = base / f"{n}.sass", after / f"{n}.sass"
        if not (b.exists() and a.exists()):
            print(f"ONLY IN {'BASE' if b.exists() else 'AFTER'} {n}")
            status = 1
            continue
        kb, ka = kernels(b), kernels(a)
        rb, ra = resources(base / f"{n}.log"), resources(after / f"{n}.log")
        if set(kb) == set(ka):
            diff = sorted(k for k in kb if kb[k] != ka[k] or rb.get(k) != ra.get(k))
            print(f"{'IDENTICAL' if not diff else 'DIFF':10s} {n}: {len(kb)} kernels")
            for k in diff:
                print(f"    differs: {k} regs/spill {rb.get(k)} -> {ra.get(k)}")
        else:  # renamed kernels: the same bodies with the same resources, one to one
            pb = collections.Counter((kb[k], rb.get(k)) for k in kb)
            pa = collections.Counter((ka[k], ra.get(k)) for k in ka)
            diff = pb != pa
            print(f"{'DIFF' if diff else 'IDENTICAL*':10s} {n}: {len(kb)} kernels, renamed"
                  + ("" if diff else " (bodies and registers match one to one)"))
        status |= bool(diff)
    print("ALL IDENTICAL" if status == 0 else "DIFFERENCES FOUND")
    return status


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    d.add_argument("--root", type=Path, default=HERE, help="a csrc/ folder (default: this one)")
    d.add_argument("--only", default="", help="units whose name matches this regex")
    c = sub.add_parser("compare")
    c.add_argument("base", type=Path)
    c.add_argument("after", type=Path)
    args = ap.parse_args()
    sys.exit(dump(args.out, args.root.resolve(), args.only) if args.cmd == "dump" else compare(args.base, args.after))


if __name__ == "__main__":
    main()
