"""The Triton kernels behind quest.attention.fused: one per fused operator and direction, each beside its PyTorch
reference (quest.attention.fused_reference), against which tests/attention/test_fused_kernels.py checks values and
gradients on the CPU under ``TRITON_INTERPRET=1``.

Every kernel works on rows of the head dimension (d <= 256): row r is (b, h, n) = (r // (N H), (r // N) % H, r % N)
of a (B, H, N, d) tensor with strides (s_b, s_h, s_n, 1) (:func:`_coordinates`). Each kernel multiplies the strides
itself: a stride handed to a nested jit function loses Triton's specialisation on its divisibility, and the rows
then load scalars (measured offline: 4-byte accesses at d = 40 where the kernels below get 16). It reads its input
in its own dtype through the caller's strides (q and k are strided views of the qkv projection: no copy first),
computes in float32 and writes in the input's dtype: one pass over memory each way, where PyTorch's operators take
four to eight (a norm, a clamp, a reciprocal, a multiply, and under CUDA's autocast float32 copies besides).

Addresses are 64-bit where they can pass 2^31 elements (a qkv buffer of ViT-L/16 at 384 px from an eval batch of
about 1,200, ViT-H/14 at 518 px from about 400): a row's coordinates (b, h, n) stay 32-bit, where division is cheap
and each is below R (an i32 row count), and are widened before they multiply a stride; the per-program bases
(``pid * D``, ``bh * D``, a block's tokens times their stride) likewise; a tensor of 2^31 rows or more takes the
PyTorch path (quest.attention.fused.MAX_ROWS). ``D_ALIGN`` (a power of two dividing d and every row stride, which
the launcher passes: quest.attention.fused_launch.column_alignment) tells the compiler how the rows are aligned:
they then load and store in 16-byte vectors where d is not a multiple of 16 (40, 88), which Triton's own
specialisation (divisibility by 16) does not see. At 1, the default, the kernels give no hint and Triton's own
specialisation stands (a hint of 1 would override its divisibility by 16). tests/attention/test_kernel_compile.py compiles
every kernel offline for sm_80 and sm_90 and reads both facts from the compiled code.

Imported only when a fused operator runs its kernel (a CUDA tensor, or the interpreter in the tests).
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["l2_normalize_fwd", "l2_normalize_bwd", "layer_norm_fwd", "layer_norm_bwd", "elliptical_m"]

@triton.jit
def _coordinates(rows, H, N):
    """Rows r as (b, h, n): 32-bit divisions (each is below R, an i32 row count), widened to 64 bits before they
    multiply a stride."""
    return (rows // (N * H)).to(tl.int64), ((rows // N) % H).to(tl.int64), (rows % N).to(tl.int64)


@triton.jit
def _scale_factor(inv, SCALE, h, row_ok, SCALE_KIND: tl.constexpr):
    """inv times the scale: none (SCALE_KIND 0), one scalar (1) or the row's head's (2)."""
    factor = inv
    if SCALE_KIND == 1:
        factor = inv * tl.load(SCALE).to(tl.float32)
    elif SCALE_KIND == 2:
        factor = inv * tl.load(SCALE + h, mask=row_ok, other=0.0).to(tl.float32)
    return factor


@triton.jit
def l2_normalize_fwd(X, Y, INV, SCALE, R, H, N, D, xs_b, xs_h, xs_n, ys_b, ys_h, ys_n, eps,
                     SCALE_KIND: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                     D_ALIGN: tl.constexpr = 1):
    """y = x * s / max(||x||, eps) per row, s the scale (SCALE_KIND 0: none, 1: one scalar, 2: one per head);
    INV[row] = 1 / max(||x||, eps) in float32, for the backward."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    col_ok = cols < D
    if D_ALIGN > 1:  # the same, in runs of D_ALIGN columns the compiler can see (a hint of 1 would hide 16)
        col_ok = (cols // D_ALIGN) < (D // D_ALIGN)
    mask = row_ok[:, None] & col_ok[None, :]
    b, h, n = _coordinates(rows, H, N)
    x_off = b * xs_b + h * xs_h + n * xs_n
    if D_ALIGN > 1:
        x_off = tl.multiple_of(x_off, D_ALIGN)
    x = tl.load(X + x_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), eps)
    factor = _scale_factor(inv, SCALE, h, row_ok, SCALE_KIND)
    y_off = b * ys_b + h * ys_h + n * ys_n
    if D_ALIGN > 1:
        y_off = tl.multiple_of(y_off, D_ALIGN)
    tl.store(Y + y_off[:, None] + cols[None, :], (x * factor[:, None]).to(Y.dtype.element_ty), mask=mask)
    tl.store(INV + rows, inv, mask=row_ok)


@triton.jit
def l2_normalize_bwd(G, X, INV, SCALE, GX, DOT, R, H, N, D, gs_b, gs_h, gs_n, xs_b, xs_h, xs_n, os_b, os_h, os_n,
                     eps, SCALE_KIND: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                     D_ALIGN: tl.constexpr = 1):
    """With u = x * inv and y = s u: dx = s inv (g - u (g . u)) where ||x|| >= eps, s inv g below (there the norm
    is the constant eps); DOT[row] = g . u, which the caller sums into the scale's gradient."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    col_ok = cols < D
    if D_ALIGN > 1:  # the same, in runs of D_ALIGN columns the compiler can see (a hint of 1 would hide 16)
        col_ok = (cols // D_ALIGN) < (D // D_ALIGN)
    mask = row_ok[:, None] & col_ok[None, :]
    b, h, n = _coordinates(rows, H, N)
    g_off = b * gs_b + h * gs_h + n * gs_n
    if D_ALIGN > 1:
        g_off = tl.multiple_of(g_off, D_ALIGN)
    x_off = b * xs_b + h * xs_h + n * xs_n
    if D_ALIGN > 1:
        x_off = tl.multiple_of(x_off, D_ALIGN)
    g = tl.load(G + g_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + x_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = tl.load(INV + rows, mask=row_ok, other=0.0)
    u = x * inv[:, None]
    dot = tl.sum(g * u, axis=1)
    above = tl.sqrt(tl.sum(x * x, axis=1)) >= eps
    factor = _scale_factor(inv, SCALE, h, row_ok, SCALE_KIND)
    gx = (g - u * tl.where(above, dot, 0.0)[:, None]) * factor[:, None]
    o_off = b * os_b + h * os_h + n * os_n
    if D_ALIGN > 1:
        o_off = tl.multiple_of(o_off, D_ALIGN)
    tl.store(GX + o_off[:, None] + cols[None, :], gx.to(GX.dtype.element_ty), mask=mask)
    tl.store(DOT + rows, dot, mask=row_ok)


@triton.jit
def layer_norm_fwd(X, W, B, Y, MEAN, RSTD, R, H, N, D, xs_b, xs_h, xs_n, ys_b, ys_h, ys_n, eps,
                   ROWS: tl.constexpr, BLOCK_D: tl.constexpr, D_ALIGN: tl.constexpr = 1):
    """y = (x - mean) * rstd * w + b per row (LayerNorm over d, biased variance as torch's); mean and rstd kept in
    float32 for the backward."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    col_ok = cols < D
    if D_ALIGN > 1:  # the same, in runs of D_ALIGN columns the compiler can see (a hint of 1 would hide 16)
        col_ok = (cols // D_ALIGN) < (D // D_ALIGN)
    mask = row_ok[:, None] & col_ok[None, :]
    b, h, n = _coordinates(rows, H, N)
    x_off = b * xs_b + h * xs_h + n * xs_n
    if D_ALIGN > 1:
        x_off = tl.multiple_of(x_off, D_ALIGN)
    x = tl.load(X + x_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / D
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / D + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    bias = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = centred * rstd[:, None] * w[None, :] + bias[None, :]
    y_off = b * ys_b + h * ys_h + n * ys_n
    if D_ALIGN > 1:
        y_off = tl.multiple_of(y_off, D_ALIGN)
    tl.store(Y + y_off[:, None] + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def layer_norm_bwd(G, X, W, MEAN, RSTD, GX, GW, GB, R, H, N, D, gs_b, gs_h, gs_n, xs_b, xs_h, xs_n, os_b, os_h,
                   os_n, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, D_ALIGN: tl.constexpr = 1):
    """dx = rstd (g w - mean(g w) - xhat mean(g w xhat)) per row; this block's sums of g xhat and g into row
    ``program_id`` of GW and GB (float32), which the caller sums over blocks."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    col_ok = cols < D
    if D_ALIGN > 1:  # the same, in runs of D_ALIGN columns the compiler can see (a hint of 1 would hide 16)
        col_ok = (cols // D_ALIGN) < (D // D_ALIGN)
    mask = row_ok[:, None] & col_ok[None, :]
    b, h, n = _coordinates(rows, H, N)
    g_off = b * gs_b + h * gs_h + n * gs_n
    if D_ALIGN > 1:
        g_off = tl.multiple_of(g_off, D_ALIGN)
    x_off = b * xs_b + h * xs_h + n * xs_n
    if D_ALIGN > 1:
        x_off = tl.multiple_of(x_off, D_ALIGN)
    g = tl.load(G + g_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + x_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    gw = g * w[None, :]
    c1 = tl.sum(gw * xhat, axis=1) / D
    c2 = tl.sum(gw, axis=1) / D
    gx = (gw - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
    o_off = b * os_b + h * os_h + n * os_n
    if D_ALIGN > 1:
        o_off = tl.multiple_of(o_off, D_ALIGN)
    tl.store(GX + o_off[:, None] + cols[None, :], gx.to(GX.dtype.element_ty), mask=mask)
    block_off = pid.to(tl.int64) * D
    if D_ALIGN > 1:
        block_off = tl.multiple_of(block_off, D_ALIGN)
    tl.store(GW + block_off + cols, tl.sum(g * xhat, axis=0), mask=col_ok)
    tl.store(GB + block_off + cols, tl.sum(g, axis=0), mask=col_ok)


@triton.jit
def elliptical_m(V, P, M, H, N, D, vs_b, vs_h, vs_n, ps_b, ps_h, ps_n, eps, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, D_ALIGN: tl.constexpr = 1):
    """Elliptical attention's m for one (batch, head), program ``program_id``: mean over tokens of |v - v_prev| per
    dimension (float32), divided by its largest entry (floored at eps), written in M's dtype."""
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    v_base = b * vs_b + h * vs_h
    p_base = b * ps_b + h * ps_h
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    if D_ALIGN > 1:  # the same, in runs of D_ALIGN columns the compiler can see (a hint of 1 would hide 16)
        col_ok = (cols // D_ALIGN) < (D // D_ALIGN)
    total = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        mask = (tokens < N)[:, None] & col_ok[None, :]
        token = tokens.to(tl.int64)
        v_off = v_base + token * vs_n
        if D_ALIGN > 1:
            v_off = tl.multiple_of(v_off, D_ALIGN)
        p_off = p_base + token * ps_n
        if D_ALIGN > 1:
            p_off = tl.multiple_of(p_off, D_ALIGN)
        v = tl.load(V + v_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        p = tl.load(P + p_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        total += tl.sum(tl.abs(v - p), axis=0)
    m = total / N
    m = m / tl.maximum(tl.max(tl.where(col_ok, m, 0.0), axis=0), eps)
    m_off = bh.to(tl.int64) * D
    if D_ALIGN > 1:
        m_off = tl.multiple_of(m_off, D_ALIGN)
    tl.store(M + m_off + cols, m.to(M.dtype.element_ty), mask=col_ok)
