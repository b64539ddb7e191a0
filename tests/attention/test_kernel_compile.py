"""quest's Triton kernels compiled offline for sm_80 and sm_90 (tests/kernel_compile.py: Triton's compiler and its
own ptxas, no GPU): every kernel x dtype x head width x layout compiles, spills nothing, computes every address
product in 64 bits (a qkv buffer past 2^31 elements is addressed right) and moves its rows in the widest vectors
its tile allows, head widths that are not multiples of 16 (40, 88) included. The readers of the compiled code are
checked here on known IR and PTX, so that each can fail; the kernels' ``D_ALIGN`` path is checked against the
references in Triton's interpreter."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from quest.attention import fused, fused_check, fused_launch
from tests import kernel_compile as kc

ROOT = Path(__file__).resolve().parents[2]


# --- the readers of the compiled code, on known text ---------------------------------------------------------------
#: the old kernels' row offset, as Triton's TTGIR has it: (rows % N) * xs_n in i32, then the address
_TTGIR_32 = """
    %c16_i32 = arith.constant 16 : i32 loc(#loc1)
    %pid = tt.get_program_id x : i32 loc(#loc2)
    %rows = arith.muli %pid, %c16_i32 : i32 loc(#loc3)
    %n = arith.remsi %rows_2, %N_splat : tensor<16xi32, #blocked> loc(#loc4)
    %s = tt.splat %xs_n : i32 -> tensor<16xi32, #blocked> loc(#loc5)
    %x_off = arith.muli %n, %s : tensor<16xi32, #blocked> loc(#loc6)
    %e = tt.expand_dims %x_off {axis = 1 : i32} : tensor<16xi32, #blocked> -> tensor<16x1xi32, #blocked2> loc(#loc7)
    %p = tt.splat %X : !tt.ptr<bf16> -> tensor<16x1x!tt.ptr<bf16>, #blocked2> loc(#loc8)
    %a = tt.addptr %p, %e : tensor<16x1x!tt.ptr<bf16>, #blocked2>, tensor<16x1xi32, #blocked2> loc(#loc9)
"""


def test_the_address_reader_flags_a_32_bit_product_of_an_index_and_a_stride():
    assert kc.narrow_address_products(_TTGIR_32) == ["%x_off = arith.muli %n, %s : tensor<16xi32, #blocked>"]


def test_the_address_reader_flags_a_product_widened_after_the_multiply():
    widened_late = _TTGIR_32.replace(
        "%e = tt.expand_dims %x_off {axis = 1 : i32} : tensor<16xi32",
        "%w = arith.extsi %x_off : tensor<16xi32, #blocked> to tensor<16xi64, #blocked> loc(#loc6)\n"
        "    %e = tt.expand_dims %w {axis = 1 : i32} : tensor<16xi64")
    assert "%w = arith.extsi" in widened_late
    assert [found.split(" = ")[0] for found in kc.narrow_address_products(widened_late)] == ["%x_off"]


def test_the_address_reader_passes_64_bit_products_and_a_multiply_by_a_constant():
    wide = """
    %c16_i32 = arith.constant 16 : i32 loc(#loc1)
    %rows = arith.muli %pid, %c16_i32 : i32 loc(#loc3)
    %r = tt.splat %rows : i32 -> tensor<16xi32, #blocked> loc(#loc3)
    %n = arith.remsi %r, %N_splat : tensor<16xi32, #blocked> loc(#loc4)
    %n64 = arith.extsi %n : tensor<16xi32, #blocked> to tensor<16xi64, #blocked> loc(#loc5)
    %s = arith.extsi %xs_n : i32 to i64 loc(#loc5)
    %s64 = tt.splat %s : i64 -> tensor<16xi64, #blocked> loc(#loc5)
    %x_off = arith.muli %n64, %s64 : tensor<16xi64, #blocked> loc(#loc6)
    %a = tt.addptr %p, %x_off : tensor<16x!tt.ptr<bf16>, #blocked>, tensor<16xi64, #blocked> loc(#loc9)
    %b = tt.addptr %q, %r : tensor<16x!tt.ptr<f32>, #blocked>, tensor<16xi32, #blocked> loc(#loc10)
"""
    assert kc.narrow_address_products(wide) == []


def test_the_ptx_and_ptxas_readers():
    ptx = """
	@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
	ld.global.L1::evict_last.b16 { %rs1 }, [ %rd2 + 0 ];
	@%p2 st.global.v2.b32 [ %rd3 + 0 ], { %r5, %r6 };
	mul.wide.s32 	%rd4, %r7, %r8;
"""
    assert kc.access_widths(ptx) == {"ld": [2, 16], "st": [8]}
    log = ("ptxas info    : Function properties for k\n    8 bytes stack frame, 4 bytes spill stores, 12 bytes "
           "spill loads\nptxas info    : Used 255 registers, used 1 barriers")
    assert kc.ptxas_figures(log) == {"registers": 255, "stack": 8, "spill_stores": 4, "spill_loads": 12}
    with pytest.raises(ValueError, match="no register and spill figures"):
        kc.ptxas_figures("ptxas info    : 0 bytes gmem")


def test_column_alignment_is_the_largest_power_of_two_dividing_d_and_every_stride():
    column_alignment = _column_alignment
    assert column_alignment(64, 64, 3 * 12 * 64, 197 * 3 * 12 * 64) == 16  # capped: one 16-byte vector
    assert column_alignment(40, 40, 3 * 16 * 40) == 8
    assert column_alignment(88, 88 * 197) == 8
    assert column_alignment(40, 41) == 1
    assert column_alignment(12, 8) == 4


def test_the_compiled_widths_are_those_of_the_configured_models():
    import timm

    import quest.models  # noqa: F401 (registers the CPU presets with timm)

    found = {}
    for config in sorted((ROOT / "configs" / "model").glob("*.yaml")):
        name = yaml.safe_load(config.read_text())["name"]
        with torch.device("meta"):
            model = timm.create_model(name, depth=1)  # one block shows the heads; meta: no weights
        attention = model.blocks[0].attn
        found.setdefault(attention.head_dim, set()).add((attention.num_heads, model.patch_embed.num_patches + 1))
    assert set(found) == set(kc.MODEL_WIDTHS), found
    for width, geometry in kc.MODEL_WIDTHS.items():
        assert geometry in found[width], (width, geometry, found[width])


# --- the kernels' D_ALIGN path, in Triton's interpreter ------------------------------------------------------------
class _Aligned:
    """A kernel launched as quest.attention.fused_launch launches it, with D_ALIGN from its d and row strides
    (``column_alignment``) where the launch leaves it out; records the D_ALIGN of every launch."""

    def __init__(self, kernel) -> None:  # noqa: ANN001 (a Triton kernel)
        self.kernel = kernel
        self.aligns: list[int] = []

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def launch(*args, **constexprs):  # noqa: ANN002, ANN003, ANN202
            named = dict(zip(self.kernel.arg_names, args))
            sizes = [v for k, v in named.items() if k == "D" or (len(k) == 4 and k[1:3] == "s_")]
            # a launcher that passes D_ALIGN itself keeps its own, which the test then checks
            self.aligns.append(constexprs.setdefault("D_ALIGN", _column_alignment(*sizes)))
            return self.kernel[grid](*args, **constexprs)
        return launch


def _column_alignment(*sizes: int) -> int:
    return fused_launch.column_alignment(*sizes)


@pytest.mark.kernels
@pytest.mark.skipif(not fused_launch.triton_runs(torch.empty(0)), reason="TRITON_INTERPRET is not 1 (tests/conftest.py)")
@pytest.mark.parametrize("width", [24, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_with_d_align_equal_their_references(width, dtype, monkeypatch):
    from quest.attention import triton_kernels as tk

    launched = {name: _Aligned(getattr(tk, name)) for name in tk.__all__}
    for name, kernel in launched.items():
        monkeypatch.setattr(tk, name, kernel)
    tol = {torch.float32: 2e-6, torch.bfloat16: 2e-2}[dtype]
    qkv = torch.randn(2, 9, 3, 2, width, dtype=torch.float64).to(dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # strided views of the projection, as the model has them
    scale = torch.rand(2, 1, 1, dtype=torch.float64).add(0.5).to(dtype)
    norm = torch.nn.LayerNorm(width, dtype=dtype)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    for fn, reference in ((lambda x: fused.l2_normalize_fused(x, 1e-6, scale),
                           lambda x: fused.l2_normalize_reference(x, 1e-6, scale)[0]),
                          (lambda x: fused.layer_norm_fused(x, norm),
                           lambda x: fused.layer_norm_reference(x, norm.weight, norm.bias, norm.eps)[0])):
        x = q.detach().requires_grad_(True)
        x_ref = q.detach().requires_grad_(True)
        out, want = fn(x), reference(x_ref)
        torch.testing.assert_close(out, want, atol=tol, rtol=tol)
        g = torch.randn(out.shape, dtype=torch.float64).to(dtype)
        out.backward(g)
        want.backward(g)
        torch.testing.assert_close(x.grad, x_ref.grad, atol=tol * 10, rtol=tol)
    too_old = fused_check.triton_too_old("elliptical_m")
    if too_old:  # l2 and LayerNorm passed above; quest does not use elliptical's kernel under this Triton
        pytest.skip(f"{too_old}: its d_align launch is not tested here (l2 and LayerNorm's passed)")
    m = fused.elliptical_m_fused(v, k, 1e-6)
    work = (v.double() - k.double()).abs().mean(dim=-2, keepdim=True)
    torch.testing.assert_close(m, (work / work.amax(dim=-1, keepdim=True)).to(dtype), atol=tol, rtol=tol)
    assert {name: set(kernel.aligns) for name, kernel in launched.items()} == {name: {8} for name in launched}


# --- the compiled programs -----------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def compiled(tmp_path_factory, worker_id) -> dict:
    """Every case compiled once per test run (tests.kernel_compile.compiled_once), into the run's base folder, which
    xdist's workers share (the parent of each worker's own). Under xdist the controller starts the compile as soon as
    a worker has collected these tests (tests/conftest.py), so no worker sits waiting on it. The group mark alone
    does not keep the group's tests on one worker: pytest-xdist 3.8 tags grouped tests through a node attribute
    pytest 9 no longer reads."""
    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent  # this run's folder, above the workers'
    results = kc.compiled_once(shared / kc.RESULTS_NAME)
    if "skipped" in results:
        pytest.skip(results["skipped"])
    return results


def _programs(compiled: dict) -> dict[int, dict]:
    return {program["id"]: program for program in compiled["programs"]}


@pytest.mark.process
@pytest.mark.xdist_group("kernel_compile")
def test_every_kernel_dtype_head_width_layout_and_arch_compiles(compiled):
    kernels = {"l2_normalize_fwd", "l2_normalize_bwd", "layer_norm_fwd", "layer_norm_bwd", "elliptical_m"}
    want = {(k, d, w, layout, arch) for k in kernels for d in kc.DTYPES for w in (16, 32, 40, 64, 80, 88, 128, 256)
            for layout in kc.LAYOUTS for arch in (80, 90)}
    programs = _programs(compiled)
    got = {(c["kernel"], c["dtype"], c["width"], c["layout"], c["arch"]) for c in compiled["cases"]
           if c["program"] in programs and c["d_align"]}
    assert got == want
    without = {(c["kernel"], c["width"]) for c in compiled["cases"] if not c["d_align"]}
    assert without == {(k, w) for k in kernels for w in kc.DEFAULT_ALIGN_CASES["widths"]}
    # each program compiled once, for the cases Triton's specialisation makes one (80 and 128 share BLOCK_D 128)
    assert len(programs) < len(compiled["cases"])


@pytest.mark.process
@pytest.mark.xdist_group("kernel_compile")
def test_no_compiled_kernel_spills_or_uses_a_stack(compiled):
    spilling = [(p["kernel"], p["arch"], p["dtype"], p["width"], p["registers"], p["stack"], p["spill_stores"],
                 p["spill_loads"]) for p in compiled["programs"]
                if p["stack"] or p["spill_stores"] or p["spill_loads"]]
    assert not spilling, "(kernel, arch, dtype, width, registers, stack, spill stores, spill loads)"
    assert all(0 < p["registers"] <= 255 for p in compiled["programs"])


@pytest.mark.process
@pytest.mark.xdist_group("kernel_compile")
def test_every_address_product_is_64_bit(compiled):
    narrow = {(p["kernel"], p["arch"], p["dtype"], p["width"]): p["narrow_products"] for p in compiled["programs"]
              if p["narrow_products"]}
    assert not narrow


def _widest_row_access(kernel: str, dtype: str, width: int, layout: str) -> int:
    """Bytes per thread of a row tile's access: its elements per thread (a (16, BLOCK_D) tile, (32, BLOCK_D) for
    elliptical_m, over 4 warps of 32 threads), at most D_ALIGN of them (the rows' alignment) and 16 bytes."""
    heads, tokens = kc.head_widths()[width]
    row_strides = kc.strides(layout, heads, tokens, width) + kc.strides("rows", heads, tokens, width)
    tile_rows = 32 if kernel == "elliptical_m" else 16
    per_thread = tile_rows * kc.block_d(width) // 128
    itemsize = {"fp32": 4, "bf16": 2, "fp16": 2}[dtype]
    return min(16, per_thread * itemsize, _column_alignment(width, *row_strides) * itemsize)


@pytest.mark.process
@pytest.mark.xdist_group("kernel_compile")
def test_rows_move_in_the_widest_vectors_their_tile_allows(compiled):
    programs = _programs(compiled)
    narrow = []
    for case in compiled["cases"]:
        program = programs[case["program"]]
        want = _widest_row_access(case["kernel"], case["dtype"], case["width"], case["layout"])
        # the row tile is elliptical_m's only load and the other kernels' widest store
        got = max(program["widths"]["ld"] if case["kernel"] == "elliptical_m" else program["widths"]["st"])
        if got != want:
            narrow.append((case["kernel"], case["arch"], case["dtype"], case["width"], case["layout"], got, want))
    assert not narrow, "(kernel, arch, dtype, width, layout, widest bytes, expected)"
    # 40 and 88 (not multiples of 16) in 16-byte vectors like 64 and 128
    assert {_widest_row_access("l2_normalize_fwd", "bf16", w, "qkv") for w in (40, 64, 88, 128)} == {16}
