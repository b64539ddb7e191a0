"""Offline compilation of quest's Triton kernels (quest/attention/triton_kernels.py) for NVIDIA targets, without a
GPU: Triton's own compiler and the ``ptxas`` inside the triton package, for the launches quest makes (every kernel x
float32 / bfloat16 / float16 x the head widths of quest's models and a few more x sm_80 / sm_90, q and k as strided
views of the qkv projection and as contiguous tensors). For each distinct program it records what the compiled code
shows: ptxas's registers, stack and spills, whether any address is a 32-bit product (:func:`narrow_address_products`,
on the TTGIR) and the widths of the global loads and stores (PTX).

Run as ``python -m tests.kernel_compile --json OUT`` (tests/attention/test_kernel_compile.py does): Triton decides at import
whether it compiles or interprets, and the test suite imports it to interpret (tests/conftest.py), so the
compilation needs an interpreter of its own, started without ``TRITON_INTERPRET``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from quest.attention.fused_launch import column_alignment

KERNELS_FILE = Path(__file__).resolve().parent.parent / "quest" / "attention" / "triton_kernels.py"
ARCHS = (80, 90)  # A100 and H100/H200: the GPUs quest's runs use (sm_90 compiles as sm_90a)
DTYPES = ("fp32", "bf16", "fp16")
#: head width -> (heads, tokens) of the model that has it (configs/model/*.yaml; tests/attention/test_kernel_compile.py checks
#: the widths against the models): vit_pico 64/4 at 16 px / 4, vit_nano 128/4 at 32 px / 4, ViT-Ti/S/B/L and
#: DeiT-III-S/B/L 64 (ViT-B/16's 12 heads at 224 px), ViT-H/14 and DeiT-III-H 1280/16 at 224 px / 14
MODEL_WIDTHS = {16: (4, 17), 32: (4, 65), 64: (12, 197), 80: (16, 257)}
#: widths of no configured model, for other ViTs (a head width not a multiple of 16: 40, 88); ViT-L/16's geometry
OTHER_WIDTHS = {40: (16, 197), 88: (16, 197), 128: (16, 197), 256: (16, 197)}
BATCH = 64
LAYOUTS = ("qkv", "contiguous")
#: the kernels' pointer parameters by role: the rows (in the case's dtype), parameters (float32, as under autocast),
#: per-row and per-block statistics (float32, as quest.attention.fused allocates them)
ROWS_POINTERS = {"X", "Y", "G", "GX", "V", "P", "M"}
PARAM_POINTERS = {"W", "B", "SCALE"}
STAT_POINTERS = {"INV", "DOT", "MEAN", "RSTD", "GW", "GB"}
#: constexprs as quest.attention.fused passes them (SCALE_KIND 2, one scale per head: the most code)
CONSTEXPRS = {"SCALE_KIND": 2, "ROWS": 16, "BLOCK_N": 32}
_VECTOR_BYTES = 16  # the widest global access of one thread (ld.global.v4.b32)


@dataclass(frozen=True)
class Case:
    """One launch quest makes: a kernel on (B, H, N, d) rows of one dtype and layout, compiled for one arch;
    ``d_align``: with the launcher's D_ALIGN (:func:`column_alignment` of d and the strides), else the default."""

    kernel: str
    dtype: str
    width: int
    layout: str
    arch: int
    d_align: bool = True


RESULTS_NAME = "kernel_compile.json"  # in the test run's base folder


def compiled_once(out: Path) -> dict:
    """The compiled cases, compiled at most once per test run into ``out`` (a JSON file every pytest process of the
    run can see): whoever holds ``out``'s lock first compiles in an interpreter of its own (the tests' own interprets
    Triton: tests/conftest.py), the others wait on the lock and read what it wrote. An error is raised, not written:
    the next to take the lock tries again and fails with it."""
    import subprocess

    from filelock import FileLock  # torch's own dependency

    with FileLock(f"{out}.lock"):
        if not out.is_file():
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            run = subprocess.run([sys.executable, "-m", "tests.kernel_compile", "--json", str(out)],
                                 cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True)
            if run.returncode != 0:
                raise RuntimeError(f"tests.kernel_compile failed:\n{run.stderr[-4000:]}")
    return json.loads(out.read_text())


def head_widths() -> dict[int, tuple[int, int]]:
    return {**MODEL_WIDTHS, **OTHER_WIDTHS}


def block_d(width: int) -> int:
    """BLOCK_D as quest.attention.fused chooses it: the next power of two, at least 16."""
    return max(16, 1 << (width - 1).bit_length())


def strides(layout: str, heads: int, tokens: int, width: int) -> tuple[int, int, int]:
    """(s_b, s_h, s_n) of a (B, H, N, d) tensor: ``qkv`` a view of the (B, N, 3, H, d) projection, ``contiguous``
    (B, H, N, d) itself, ``rows`` the fused operators' outputs (laid out as (B, N, H, d))."""
    if layout == "qkv":
        return tokens * 3 * heads * width, width, 3 * heads * width
    if layout == "contiguous":
        return heads * tokens * width, tokens * width, width
    return tokens * heads * width, width, heads * width


# --- what the compiled code shows ----------------------------------------------------------------------------------
_DEF = re.compile(r"^\s*(%[\w.$-]+)(?::\d+)? = ([\w.]+)\b(.*)$")
_I32 = re.compile(r"(?:\b|\dx)i32\b")  # an i32 scalar or a tensor of them (tensor<16x64xi32, ...>)
_ADDPTR = re.compile(r"\btt\.addptr (%[\w.$-]+), (%[\w.$-]+)")
#: operations through which a value's size reaches an address unchanged or grown (a division or a remainder
#: bounds it, a truncation is its own mistake): an i32 product behind any chain of these is a 32-bit address
_CARRIES = {"arith.addi", "arith.subi", "arith.muli", "arith.extsi", "arith.extui", "tt.broadcast", "tt.expand_dims",
            "tt.splat", "ttg.convert_layout", "tt.reshape", "arith.select", "tt.trans"}


def narrow_address_products(ir: str) -> list[str]:
    """The 32-bit multiplies of two runtime values (neither a constant) that reach a pointer offset (``tt.addptr``)
    in Triton IR (TTIR or TTGIR), directly or through additions, widenings and broadcasts: each can wrap past 2^31
    elements, whether or not it is widened afterwards. A multiply by a constant (``program_id * ROWS``: a row index,
    below the i32 row count) is not one. Empty: every address product is 64-bit."""
    defs: dict[str, tuple[str, str]] = {}
    for line in ir.splitlines():
        match = _DEF.match(line)
        if match:
            defs[match.group(1)] = (match.group(2), match.group(3))
    found: list[str] = []
    seen: set[str] = set()
    pending = [offset for line in ir.splitlines() for _, offset in _ADDPTR.findall(line)]
    while pending:
        name = pending.pop()
        if name in seen or name not in defs:
            continue  # a kernel argument or a loop variable: a leaf
        seen.add(name)
        op, rest = defs[name]
        if op not in _CARRIES:
            continue
        operands = re.findall(r"%[\w.$-]+", rest.split(" : ")[0])
        result_type = rest.rsplit(" : ", 1)[-1]
        if op == "arith.muli" and _I32.search(result_type) and not any(
                defs.get(o, ("",))[0] == "arith.constant" for o in operands):
            found.append(f"{name} = {op}{rest.split(' loc(')[0]}")
        pending.extend(operands)
    return found


def access_widths(ptx: str) -> dict[str, list[int]]:
    """The widths in bytes of the global loads and stores in PTX (``ld.global.v4.b32``: 16)."""
    widths: dict[str, set[int]] = {"ld": set(), "st": set()}
    for kind, modifiers in re.findall(r"\b(ld|st)\.global((?:\.[\w:]+)+)", ptx):
        parts = modifiers.split(".")
        vector = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        bits = next((int(p[1:]) for p in reversed(parts) if re.fullmatch(r"[bfsu]\d+", p)), 0)
        widths[kind].add(vector * bits // 8)
    return {kind: sorted(sizes) for kind, sizes in widths.items()}


def ptxas_figures(log: str) -> dict[str, int]:
    """Registers, stack frame and spills from ``ptxas -v`` (which Triton runs; its log when TRITON_DUMP_PTXAS_LOG)."""
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    registers = re.search(r"Used (\d+) registers", log)
    if not (frame and registers):
        raise ValueError(f"no register and spill figures in ptxas's log: {log!r}")
    return {"registers": int(registers.group(1)), "stack": int(frame.group(1)),
            "spill_stores": int(frame.group(2)), "spill_loads": int(frame.group(3))}


# --- compiling ----------------------------------------------------------------------------------------------------
def load_kernels(path: Path) -> ModuleType:
    """The kernels module at ``path`` as compilable JIT functions (Triton must not be interpreting)."""
    from triton import knobs

    if knobs.runtime.interpret:
        raise RuntimeError("TRITON_INTERPRET is set: Triton interprets in this process and cannot compile")
    spec = importlib.util.spec_from_file_location(f"_offline_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch_arguments(module: ModuleType, case: Case) -> tuple[list[Any], dict[str, int]]:
    """The positional arguments and constexprs of ``case``'s launch, built from the kernel's parameter list: one
    tiny tensor per pointer (its dtype and 16-byte alignment are what Triton specialises on), the sizes and strides
    of the case's geometry as ints, eps as a float."""
    import torch

    fn = getattr(module, case.kernel)
    heads, tokens = head_widths()[case.width]
    rows_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    layout_of = {"x": case.layout, "v": case.layout, "p": case.layout, "g": "rows", "y": "rows", "o": "rows"}
    ints = {"R": BATCH * heads * tokens, "H": heads, "N": tokens, "D": case.width}
    positional: list[Any] = []
    row_strides: list[int] = []
    for param in fn.params:
        name = param.name
        if param.is_constexpr:
            continue
        if name in ROWS_POINTERS | PARAM_POINTERS | STAT_POINTERS:
            positional.append(torch.empty(1, dtype=rows_dtype if name in ROWS_POINTERS else torch.float32))
        elif name in ints:
            positional.append(ints[name])
        elif re.fullmatch(r"[a-z]s_[bhn]", name):
            stride = dict(zip("bhn", strides(layout_of[name[0]], heads, tokens, case.width)))[name[-1]]
            positional.append(stride)
            row_strides.append(stride)
        elif name == "eps":
            positional.append(1e-6)
        else:
            raise ValueError(f"{case.kernel}: parameter {name!r} has no role in tests/kernel_compile.py")
    constexprs = {p.name: CONSTEXPRS[p.name] for p in fn.params if p.is_constexpr and p.name in CONSTEXPRS}
    constexprs["BLOCK_D"] = block_d(case.width)
    if "D_ALIGN" in fn.arg_names and case.d_align:
        constexprs["D_ALIGN"] = column_alignment(case.width, *row_strides)
    return positional, constexprs


def specialise(module: ModuleType, case: Case) -> tuple[Any, dict, dict, dict, Any]:
    """Triton's own specialisation of ``case``'s launch (what ``kernel[grid](...)`` would compile): signature,
    constexprs (ints equal to 1 among them), divisibility attributes (ints and pointers divisible by 16), options."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = getattr(module, case.kernel)
    backend = make_backend(GPUTarget("cuda", case.arch, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    positional, constexprs = launch_arguments(module, case)
    bound, specialization, options = binder(*positional, **constexprs)
    options, signature, constants, attrs = fn._pack_args(backend, {}, bound, specialization, options)
    return fn, signature, constants, attrs, options


def compile_case(module: ModuleType, case: Case) -> dict[str, Any]:
    """Compile ``case`` for its arch and read the compiled code (figures of :func:`ptxas_figures`,
    :func:`narrow_address_products`, :func:`access_widths`)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, signature, constants, attrs, options = specialise(module, case)
    log = io.StringIO()
    started = time.perf_counter()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        kernel = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", case.arch, 32),
                                options=options.__dict__)
    return {"seconds": round(time.perf_counter() - started, 3), **ptxas_figures(log.getvalue()),
            "shared": kernel.metadata.shared, "narrow_products": narrow_address_products(kernel.asm["ttgir"]),
            "widths": access_widths(kernel.asm["ptx"])}


def program_key(module: ModuleType, case: Case) -> str:
    """What makes two cases one compiled program: kernel, arch and Triton's specialisation of the launch."""
    _, signature, constants, attrs, _ = specialise(module, case)
    return repr((case.kernel, case.arch, sorted(signature.items()), sorted(constants.items()), sorted(attrs.items())))


#: launches without D_ALIGN (a launcher that leaves it out): widths that are multiples of 16 must keep the vectors
#: Triton's own specialisation gives them (a hint of 1 in the kernel would hide it)
DEFAULT_ALIGN_CASES = {"dtype": "bf16", "widths": (64, 80), "layout": "qkv", "arch": 90}


def all_cases(kernels: list[str]) -> list[Case]:
    """Every kernel x dtype x head width x layout x arch with the launcher's D_ALIGN, and the few without it."""
    default = DEFAULT_ALIGN_CASES
    return ([Case(k, dtype, width, layout, arch) for k in kernels for dtype in DTYPES for width in head_widths()
             for layout in LAYOUTS for arch in ARCHS]
            + [Case(k, default["dtype"], width, default["layout"], default["arch"], d_align=False)
               for k in kernels for width in default["widths"]])


def run(path: Path, archs: tuple[int, ...] = ARCHS) -> dict[str, Any]:
    """Compile one representative of every distinct program among :func:`all_cases` and list every case with the
    program that serves it; ``skipped`` (and nothing else) where Triton or its ptxas cannot run here."""
    try:
        import triton
        from triton import knobs
        ptxas = knobs.nvidia.ptxas.path
    except Exception as error:  # noqa: BLE001 (any failure to find the toolchain is the reason to report)
        return {"skipped": f"Triton's compiler or its ptxas is unavailable: {type(error).__name__}: {error}"}
    if not os.access(ptxas, os.X_OK):
        return {"skipped": f"Triton's ptxas at {ptxas} is not executable"}
    started = time.perf_counter()
    module = load_kernels(path)
    kernels = [name for name in module.__all__ if hasattr(getattr(module, name), "params")]  # the jit functions
    cases = [case for case in all_cases(kernels) if case.arch in archs]
    programs: dict[str, dict[str, Any]] = {}
    listed = []
    with tempfile.TemporaryDirectory() as cache, knobs.cache.scope():
        knobs.cache.dir = cache  # a fresh cache: every program goes through ptxas, whose log is read
        for case in cases:
            key = program_key(module, case)
            if key not in programs:
                programs[key] = {"id": len(programs), "kernel": case.kernel, "arch": case.arch, "dtype": case.dtype,
                                 "width": case.width, "layout": case.layout, **compile_case(module, case)}
            listed.append({**case.__dict__, "program": programs[key]["id"]})
    return {"triton": triton.__version__, "ptxas": ptxas, "seconds": round(time.perf_counter() - started, 1),
            "programs": list(programs.values()), "cases": listed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--kernels", type=Path, default=KERNELS_FILE, help="the kernels' source file")
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), help="compute capabilities")
    args = parser.parse_args(argv)
    if not args.kernels.is_file():
        parser.error(f"--kernels: no file {args.kernels}")
    partial = args.json.with_name(args.json.name + ".partial")  # whole or absent: readers wait on the lock only
    partial.write_text(json.dumps(run(args.kernels, tuple(args.arch)), indent=1))
    os.replace(partial, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
