"""Find the matrix instruction in the SASS of the kernel that ran (docs/design.md §5 item 4).

``cuobjdump --dump-sass`` on the cubin Triton compiled for a launch prints, per function,
lines such as::

            Function : _qk_int8_native_kernel
            /*1a40*/                   IGMMA.64x128x32.S8.S8 R24, gdesc[UR4], RZ, !UPT ;

:func:`parse_sass` turns that text into per-function opcode counts; :func:`classify`
sorts the matrix instructions by operand type:

==========  ===========================================  =========
opcode      instruction                                  class
==========  ===========================================  =========
IGMMA       wgmma, s8/u8 operands (Hopper)               INT8
IMMA        mma.sync, s8/u8 operands                     INT8
QGMMA       wgmma, e4m3/e5m2 operands (Hopper)           FP8
QMMA        mma.sync, fp8 operands                       FP8
HGMMA       wgmma, f16/bf16 operands (``.BF16`` -> BF16)  BF16/FP16
HMMA        mma.sync, f16/bf16/tf32 operands             BF16/FP16/TF32
DMMA        mma.sync, f64                                FP64
==========  ===========================================  =========

It also counts conversion instructions (I2F*, F2I*, F2F*, I2FP*, F2FP*): a route that
converts INT8 to BF16 in the hot loop shows them by the dozen.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter

MMA_OPCODES = ("IGMMA", "IMMA", "QGMMA", "QMMA", "HGMMA", "HMMA", "DMMA", "BMMA", "UTCIMMA", "UTCQMMA", "UTCHMMA")
CONVERT_PREFIXES = ("I2F", "F2I", "F2F", "I2FP", "F2FP", "I2I")

_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
# /*0a50*/   @!P0 IGMMA.64x128x32.S8.S8 R24, ... ;
_INSTR = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)")


def parse_sass(text: str) -> dict[str, Counter]:
    """Per-function counts of full opcodes (``IGMMA.64x128x32.S8.S8``, ``FMUL``, ...)."""
    functions: dict[str, Counter] = {}
    current = None
    for line in text.splitlines():
        fm = _FUNCTION.match(line)
        if fm:
            current = fm.group(1)
            functions.setdefault(current, Counter())
            continue
        im = _INSTR.match(line)
        if im and current is not None:
            functions[current][im.group(2)] += 1
    return functions


_OPERANDS = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)([^;]*)")
_TARGET = re.compile(r"0x([0-9a-fA-F]+)")


def instructions(text: str) -> dict[str, list[tuple[int, str, str]]]:
    """Per function, ``(address, full opcode, operands)`` of every instruction in file order."""
    functions: dict[str, list[tuple[int, str, str]]] = {}
    current = None
    for line in text.splitlines():
        fm = _FUNCTION.match(line)
        if fm:
            current = functions.setdefault(fm.group(1), [])
            continue
        im = _OPERANDS.match(line)
        if im and current is not None:
            current.append((int(im.group(1), 16), im.group(2), im.group(3)))
    return functions


def loops(text: str, function: str | None = None) -> list[list[str]]:
    """Opcodes of every loop body -- the instructions from a backward branch's target up to
    the branch itself -- ordered by where the loop starts (per function, in file order;
    ``function`` keeps one). Nested loops appear once each, the outer one containing the inner."""
    found = []
    per_function = instructions(text)
    for name, ins in per_function.items():
        if function is not None and name != function:
            continue
        for addr, op, rest in ins:
            target = _TARGET.search(rest) if op.split(".")[0] == "BRA" else None
            if target and int(target.group(1), 16) < addr:
                lo = int(target.group(1), 16)
                found.append((name, lo, [o for a, o, _ in ins if lo <= a <= addr]))
    order = {name: i for i, name in enumerate(per_function)}
    return [body for _, _, body in sorted(found, key=lambda x: (order[x[0]], x[1]))]


def mma_class(opcode: str) -> str | None:
    """Operand class of a matrix opcode (see module table), None for anything else."""
    base, _, mods = opcode.partition(".")
    mods_up = "." + mods.upper()
    if base in ("IGMMA", "IMMA", "UTCIMMA"):
        return "INT8" if (".S8" in mods_up or ".U8" in mods_up or base != "IMMA" or not mods) else "INT4"
    if base in ("QGMMA", "QMMA", "UTCQMMA"):
        return "FP8"
    if base in ("HGMMA", "HMMA", "UTCHMMA"):
        if ".BF16" in mods_up:
            return "BF16"
        if ".TF32" in mods_up:
            return "TF32"
        return "FP16"
    if base == "DMMA":
        return "FP64"
    if base == "BMMA":
        return "B1"
    return None


def classify(counts: Counter) -> dict:
    """Matrix instructions, their classes and the conversion instructions of one function."""
    mma = {op: n for op, n in counts.items() if op.split(".")[0] in MMA_OPCODES}
    classes: Counter = Counter()
    for op, n in mma.items():
        cls = mma_class(op)
        if cls:
            classes[cls] += n
    convert = {op: n for op, n in counts.items() if op.split(".")[0].startswith(CONVERT_PREFIXES)}
    return {"mma": dict(sorted(mma.items())), "classes": dict(classes), "convert": dict(sorted(convert.items()))}


def summarize(text: str, function: str | None = None) -> dict:
    """:func:`classify` for ``function`` (default: all functions of the dump together)."""
    functions = parse_sass(text)
    if function is not None:
        if function not in functions:
            raise KeyError(f"function {function!r} not in the SASS (has {sorted(functions)})")
        counts = functions[function]
    else:
        counts = sum(functions.values(), Counter())
    out = classify(counts)
    out["functions"] = sorted(functions)
    out["instructions"] = sum(counts.values())
    return out


def has_class(summary: dict, expected: str) -> bool:
    return summary.get("classes", {}).get(expected, 0) > 0


# --------------------------------------------------------------------------- cubin -> text
def find_cuobjdump() -> str | None:
    """cuobjdump from PATH, CUDA_HOME, or the copy Triton ships with its NVIDIA backend."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    candidates = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(os.path.join(os.environ[env], "bin", "cuobjdump"))
    candidates.append("/usr/local/cuda/bin/cuobjdump")
    try:
        import triton

        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except ImportError:  # pragma: no cover - triton is a dependency
        pass
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def dump_sass(cubin: bytes, cuobjdump: str | None = None, timeout: float = 60.0) -> str:
    """``cuobjdump --dump-sass`` of a cubin image."""
    tool = cuobjdump or find_cuobjdump()
    if tool is None:
        raise FileNotFoundError("cuobjdump not found (PATH, CUDA_HOME or Triton's NVIDIA backend)")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        proc = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"cuobjdump failed ({proc.returncode}): {proc.stderr.strip()[:400]}")
    return proc.stdout


def compiled_name(compiled) -> str:
    name = getattr(compiled, "name", None)
    if not name:
        name = getattr(getattr(compiled, "metadata", None), "name", None)
    return str(name)


def sass_of_compiled(compiled) -> str:
    """SASS text of a Triton ``CompiledKernel`` (what ``kernel[grid](...)`` returns)."""
    asm = getattr(compiled, "asm", None)
    if not asm or "cubin" not in asm:
        raise ValueError("this compiled kernel carries no cubin (not an NVIDIA build?)")
    return dump_sass(asm["cubin"])


# --------------------------------------------------------------------------- library kernels
_NAME_HINTS = (
    ("FP8", re.compile(r"e4m3|e5m2|fp8|f8f8|qgmma", re.I)),
    ("INT8", re.compile(r"s8s8|i8i8|int8|imma|igmma|_s8_|u8u8", re.I)),
    ("BF16", re.compile(r"bf16|bf16bf16|hgmma", re.I)),
    ("FP16", re.compile(r"f16f16|h1688|h16816|fp16|hmma", re.I)),
)


def infer_class_from_name(kernel_name: str) -> str | None:
    """Best-effort operand class of a closed-source library kernel from its name
    (``sm90_xmma_gemm_bf16bf16_...`` -> BF16). None when the name does not say."""
    for cls, pattern in _NAME_HINTS:
        if pattern.search(kernel_name):
            return cls
    return None


def excerpt(text: str, max_lines: int = 120, context: int = 2, max_convert: int = 12) -> str:
    """A small, still-parseable slice of a SASS dump (verbatim lines): the headers, every
    matrix instruction with ``context`` instruction lines around it, then up to
    ``max_convert`` conversion instructions, at most ``max_lines`` lines in file order."""
    lines = text.splitlines()
    instr = [i for i, line in enumerate(lines) if _INSTR.match(line)]
    pos = {i: n for n, i in enumerate(instr)}
    headers = [i for i, line in enumerate(lines)
               if _FUNCTION.match(line) or "code for sm_" in line or line.strip().startswith(".headerflags")]
    mma, convert = set(), []
    for i in instr:
        base = _INSTR.match(lines[i]).group(2).split(".")[0]
        if base in MMA_OPCODES:
            n = pos[i]
            mma.update(instr[max(0, n - context): n + context + 1])
        elif base.startswith(CONVERT_PREFIXES):
            convert.append(i)
    keep = set(headers) | mma
    # one line of each distinct conversion opcode first, then more in file order
    first_seen = {}
    for i in convert:
        first_seen.setdefault(_INSTR.match(lines[i]).group(2), i)
    convert = sorted(first_seen.values()) + [i for i in convert if i not in set(first_seen.values())]
    for i in convert:
        if len(keep) >= max_lines or max_convert <= 0:
            break
        if i not in keep:
            keep.add(i)
            max_convert -= 1
    out = [lines[i] for i in sorted(keep)][:max_lines]
    return "\n".join(out) + "\n"
