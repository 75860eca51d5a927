"""Scaled rules for the linear-algebra decompositions and solves of `jax.lax.linalg`.

The decompositions are homogeneous in their operand: for `A = d * s` (s > 0),

- cholesky: `L(A) = L(d) * sqrt(s)` (a power-of-two root, the leftover factor in d);
- qr: `Q(A) = Q(d)`, `R(A) = R(d) * s`; svd: `U, V` unchanged, `sigma * s`;
- eigh / schur / eig: eigen/Schur vectors unchanged, eigenvalues and `T` times s;
- lu: `L(A) = L(d)` (same pivots), `U(A) = U(d) * s`;
- hessenberg / tridiagonal: the reduced matrix times s, the Householder reflectors
  and their `taus` unchanged;
- triangular_solve / tridiagonal_solve: `x = solve(a_d, b_d)` at scale `s_b / s_a`;
- cholesky_update: homogeneous in `(R, w)` together (both at their larger scale);
  symmetric_product (`alpha A A^T + beta C`): degree 2 in A, 1 in C (both brought to one
  scale `t^2`).

So every rule factorises the *data* (in float32 for float16/bfloat16, which the CPU
kernels need), never the value, and puts s back into the output scales. Homogeneous
outputs get an extra power-of-two factor (`dynamic_scale_of`) so that their data's
largest magnitude is about 1 and cannot overflow a narrow data dtype.

Packed outputs: `lu` (L below the diagonal, U on and above it), `hessenberg` and
`tridiagonal` (reflectors and reduced matrix in one array), and the raw `cholesky`
primitive (L below, the input's upper triangle above; see its rule) hold two parts
with different scales in one array, which can carry a single scale t. The value is exact whatever t
(each part is stored as `part * (s_part / t)`, a power-of-two ratio); t is chosen
between the two parts' magnitudes (`packed_scale`): at their geometric mean, moved so
that the larger part's data stays below 2^9. In float32/bfloat16 data both parts then
stay in range for any scale the float32 scale can hold (|log2 s| up to ~100). In
float16 (range 2^-24 .. 2^16), the part of magnitude ~1 (L, the reflectors) and the
part of magnitude ~s (U, H) fit together only while `s` is within about 2^-16 .. 2^16
of 1: this is a limit of the single packed float16 array, not of the rule, and it
carries over to what is computed from the packed LU (jnp.linalg.solve, det, inv).

`eig` returns complex arrays, which a ScaledArray cannot hold: its outputs are plain
complex arrays (eigenvalues of the data times s, eigenvectors of the data). `schur`
with a `select_callable` (which sees the eigenvalues) and `householder_product`
(not homogeneous: its reflectors have an implicit unit element) are computed on the
float32 value, with a dynamic output scale.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import _compat, registry
from ..core.datatype import ScaledArray
from ..core.types import Array
from .base import choose_scale, compute_dtype, dynamic_scale_of, safe_div, scaled_output

__all__ = ["packed_scale"]

_P = _compat.primitives

# Largest data magnitude a packed output's larger part is allowed (see `packed_scale`).
_PACKED_HEADROOM = 2.0**8


def _scale32(x: ScaledArray) -> Array:
    return jnp.asarray(x.scale, jnp.float32)


def _data(x: ScaledArray, ratio: Any = None) -> Array:
    """The data (times `ratio`) in the compute dtype; zeros where the scale is 0.

    A zero scale represents a zero matrix: factorising zeros gives the plain results
    (pivots, identity Q...) rather than those of arbitrary data.
    """
    cdtype = compute_dtype(x.dtype)
    d = x.data.astype(cdtype)
    if ratio is not None:
        d = d * jnp.asarray(ratio).astype(cdtype)
    return jnp.where(_scale32(x) == 0, jnp.zeros_like(d), d)


def _invariant(y: Array, dtype: Any) -> ScaledArray:
    """A scale-invariant output (orthogonal factors, unit-lower L, taus): scale 1."""
    return ScaledArray(y.astype(dtype), np.asarray(1.0, np.float32))


def _homogeneous(y: Array, scale: Array, dtype: Any) -> ScaledArray:
    """Output `y * scale`, renormalised so that the data's largest magnitude is about 1."""
    extra = dynamic_scale_of(y)
    data = (y / extra.astype(y.dtype)).astype(dtype)
    return ScaledArray(data, jnp.asarray(scale, jnp.float32) * extra)


def _amax(y: Array, mask: Array) -> Array:
    if not y.size:
        return jnp.zeros((), jnp.float32)
    return jnp.max(jnp.where(mask, jnp.abs(y), 0)).astype(jnp.float32)


def packed_scale(mag_a: Array, mag_b: Array) -> Array:
    """The scale of an array packing two parts whose largest values are `mag_a` and `mag_b`.

    The power of two nearest their geometric mean (so both parts' data are about as
    far from 1), raised where needed so that the larger part's data is at most about
    2^9. A part that is all zeros does not count; 1 when both are.
    """
    mag_a = jnp.asarray(mag_a, jnp.float32)
    mag_b = jnp.asarray(mag_b, jnp.float32)
    mean = jnp.where(
        mag_a == 0, mag_b, jnp.where(mag_b == 0, mag_a, jnp.sqrt(mag_a) * jnp.sqrt(mag_b))
    )
    largest = jnp.maximum(mag_a, mag_b)
    scale = jnp.maximum(choose_scale(mean), choose_scale(largest / _PACKED_HEADROOM))
    return lax.stop_gradient(jnp.where(jnp.isfinite(scale) & (scale > 0), scale, 1.0))


def _pack(
    mask_a: Array,
    part_a: Array,
    scale_a: Array,
    part_b: Array,
    scale_b: Array,
    dtype: Any,
    favour_a: bool = False,
) -> ScaledArray:
    """One ScaledArray holding `part_a * scale_a` where `mask_a`, `part_b * scale_b` elsewhere.

    The scale is `packed_scale` of the two parts, or with `favour_a` the dynamic scale
    of part a alone (part b's data may then leave a narrow dtype's range).
    """
    scale_a = jnp.asarray(scale_a, jnp.float32)
    scale_b = jnp.asarray(scale_b, jnp.float32)
    mag_a = _amax(part_a, mask_a) * scale_a
    if favour_a:
        t = packed_scale(mag_a, jnp.zeros((), jnp.float32))
    else:
        t = packed_scale(mag_a, _amax(part_b, ~mask_a) * scale_b)
    ratio_a = (scale_a / t).astype(part_a.dtype)
    ratio_b = (scale_b / t).astype(part_b.dtype)
    data = jnp.where(mask_a, part_a * ratio_a, part_b * ratio_b)
    return ScaledArray(data.astype(dtype), t)


def _tri_mask(shape: tuple[int, ...], offset: int) -> Array:
    """Boolean mask over the last two dimensions: `row - col > offset`, broadcast to `shape`."""
    rows = lax.broadcasted_iota(jnp.int32, shape, len(shape) - 2)
    cols = lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
    return rows - cols > offset


def _sqrt_scale(scale: Array) -> tuple[Array, Array]:
    """A power-of-two square root of `scale` and the factor left for the data."""
    root = choose_scale(jnp.sqrt(jnp.asarray(scale, jnp.float32)))
    root = jnp.where(root > 0, root, 1.0)
    return root, safe_div(scale, root * root)


# --- Cholesky ---------------------------------------------------------------------------


@registry.register_scaled_op(
    _P.cholesky_p,
    family="linalg",
    remark="L(d * rest) at scale sqrt(s) (power of two); unread upper triangle at scale s",
)
def scaled_cholesky(a: ScaledArray, **params: Any) -> ScaledArray:
    """`s = root^2 * rest`: factorise `d * rest` (rest is 1 or 2), L at scale `root`.

    The raw primitive leaves its input in the strict upper triangle (value scale s),
    which the public functions (`lax.linalg.cholesky`, `jnp.linalg.cholesky`) mask
    out. The output's scale is chosen for L alone (its data's largest magnitude ~1),
    so L keeps full precision at any scale; the input copy rides along at
    `d * root * rest / t`, which can saturate to +-inf in float16 data for extreme
    scales (|log2 s| beyond ~30).
    """
    root, rest = _sqrt_scale(_scale32(a))
    d = _data(a, rest)
    out = _P.cholesky_p.bind(d, **params)
    lower = _tri_mask(out.shape, -1)  # row >= col
    return _pack(lower, out, root, out, root * root, a.dtype, favour_a=True)


# --- LU ---------------------------------------------------------------------------------


@registry.register_scaled_op(
    _P.lu_p,
    family="linalg",
    remark="lu(d): unit L (scale 1) and U (scale s) packed at a balanced scale; pivots plain",
)
def scaled_lu(a: ScaledArray, **params: Any) -> list[Any]:
    """Factorise the data: same pivots, `L(A) = L(d)`, `U(A) = U(d) * s`.

    The packed output holds L (strictly below the diagonal, magnitudes <= 1) and U:
    it is stored as `where(lower, L / t, U_d * s / t)` with scale t from
    `packed_scale`, exact (power-of-two ratios) and in range in float32/bfloat16
    data for any float32 scale; float16 data holds both parts only for s within
    about 2^+-16 (see the module docstring).
    """
    lu, pivots, perm = _P.lu_p.bind(_data(a), **params)
    lower = _tri_mask(lu.shape, 0)
    packed = _pack(lower, lu, np.float32(1.0), lu, _scale32(a), a.dtype)
    return [packed, pivots, perm]


# --- QR, SVD, eigh, eig, Schur ----------------------------------------------------------


@registry.register_scaled_op(
    _P.qr_p, family="linalg", remark="qr(d): Q scale 1, R scale s; column pivots plain"
)
def scaled_qr(a: ScaledArray, **params: Any) -> list[Any]:
    """Q of the data (orthonormal, scale 1) and its R times s; pivots are scale invariant."""
    q, r, *rest = _P.qr_p.bind(_data(a), **params)
    return [_invariant(q, a.dtype), _homogeneous(r, _scale32(a), a.dtype), *rest]


@registry.register_scaled_op(
    _P.svd_p, family="linalg", remark="svd(d): singular values scale s, U and V^H scale 1"
)
def scaled_svd(a: ScaledArray, **params: Any) -> list[Any]:
    """Singular values of the data times s; the singular vectors are unchanged."""
    outs = _P.svd_p.bind(_data(a), **params)
    s, *vectors = outs
    return [
        _homogeneous(s, _scale32(a), a.dtype),
        *[_invariant(v, a.dtype) for v in vectors],
    ]


@registry.register_scaled_op(
    _P.eigh_p, family="linalg", remark="eigh(d): eigenvalues scale s, eigenvectors scale 1"
)
def scaled_eigh(a: ScaledArray, **params: Any) -> list[Any]:
    """A positive scale keeps the eigenvectors and the order of the eigenvalues."""
    v, w = _P.eigh_p.bind(_data(a), **params)
    return [_invariant(v, a.dtype), _homogeneous(w, _scale32(a), a.dtype)]


@registry.register_scaled_op(
    _P.eig_p,
    family="linalg",
    remark="eig(d): complex outputs plain (eigenvalues times s, eigenvectors of d)",
)
def scaled_eig(a: ScaledArray, **params: Any) -> list[Any]:
    """Complex outputs cannot be ScaledArrays: eigenvalues are returned as `w(d) * s`.

    The eigenvectors (left and right) are normalised, so those of the data are those
    of the value.
    """
    w, *vectors = _P.eig_p.bind(_data(a), **params)
    w = w * _scale32(a).astype(w.dtype)
    return [w, *vectors]


@registry.register_scaled_op(
    _P.schur_p,
    family="linalg",
    remark="schur(d): T scale s, Schur vectors scale 1 (on the value with a select_callable)",
)
def scaled_schur(a: ScaledArray, **params: Any) -> list[Any]:
    """`T(A) = T(d) * s`, `Z(A) = Z(d)`.

    A `select_callable` sees the eigenvalues, which a scale changes: the
    decomposition is then computed on the float32 value (T with a dynamic scale).
    """
    if params.get("select_callable") is not None:
        value = _data(a) * _scale32(a).astype(compute_dtype(a.dtype))
        t, *rest = _P.schur_p.bind(value, **params)
        return [scaled_output(t, a.dtype, "dynamic"), *[_invariant(z, a.dtype) for z in rest]]
    t, *rest = _P.schur_p.bind(_data(a), **params)
    return [_homogeneous(t, _scale32(a), a.dtype), *[_invariant(z, a.dtype) for z in rest]]


# --- Hessenberg and tridiagonal reductions -----------------------------------------------


@registry.register_scaled_op(
    _P.hessenberg_p,
    family="linalg",
    remark="hessenberg(d): H (scale s) and reflectors (scale 1) packed; taus scale 1",
)
def scaled_hessenberg(a: ScaledArray, **params: Any) -> list[Any]:
    """H holds the upper Hessenberg part, the reflectors lie below the first subdiagonal."""
    h, taus = _P.hessenberg_p.bind(_data(a), **params)
    reflectors = _tri_mask(h.shape, 1)
    packed = _pack(reflectors, h, np.float32(1.0), h, _scale32(a), a.dtype)
    return [packed, _invariant(taus, a.dtype)]


@registry.register_scaled_op(
    _P.tridiagonal_p,
    family="linalg",
    remark="tridiagonal(d): packed array as hessenberg, d and e scale s, taus scale 1",
)
def scaled_tridiagonal(a: ScaledArray, **params: Any) -> list[Any]:
    """Reflectors beyond the first sub/superdiagonal (scale 1); the rest scales with s."""
    arr, diag, off, taus = _P.tridiagonal_p.bind(_data(a), **params)
    if params.get("lower", True):
        reflectors = _tri_mask(arr.shape, 1)  # row > col + 1
    else:
        reflectors = ~_tri_mask(arr.shape, -2)  # col > row + 1
    s = _scale32(a)
    packed = _pack(reflectors, arr, np.float32(1.0), arr, s, a.dtype)
    return [
        packed,
        _homogeneous(diag, s, a.dtype),
        _homogeneous(off, s, a.dtype),
        _invariant(taus, a.dtype),
    ]


@registry.register_scaled_op(
    _P.householder_product_p,
    family="linalg",
    remark="not homogeneous (implicit unit reflector element): on the value, dynamic scale",
)
def scaled_householder_product(a: ScaledArray, taus: ScaledArray, **params: Any) -> ScaledArray:
    """Computed on the float32 values of the reflectors and taus."""
    cdtype = compute_dtype(a.dtype)
    a_value = _data(a) * _scale32(a).astype(cdtype)
    taus_value = _data(taus) * _scale32(taus).astype(cdtype)
    q = _P.householder_product_p.bind(a_value, taus_value, **params)
    return scaled_output(q, a.dtype, "dynamic")


# --- Rank-1 Cholesky update, symmetric product ------------------------------------------


@registry.register_scaled_op(
    _P.cholesky_update_p,
    family="linalg",
    remark="R and w at their larger scale s: the update of their data, at scale s",
)
def scaled_cholesky_update(r: ScaledArray, w: ScaledArray, **params: Any) -> ScaledArray:
    """The update is homogeneous in `(R, w)` together: both are brought to the larger of
    their scales (the other's data shrinks by a power of two, in float32), and the update
    of that data is the result at that scale."""
    s_r, s_w = _scale32(r), _scale32(w)
    common = lax.stop_gradient(jnp.maximum(s_r, s_w))
    out = _P.cholesky_update_p.bind(
        _data(r, safe_div(s_r, common)), _data(w, safe_div(s_w, common)), **params
    )
    return _homogeneous(out, common, r.dtype)


@registry.register_scaled_op(
    _P.symmetric_product_p,
    family="linalg",
    remark="alpha a_d a_d^T + beta c_d at scale t^2, t the larger of s_a and sqrt(s_c)",
)
def scaled_symmetric_product(a: ScaledArray, c: ScaledArray, **params: Any) -> ScaledArray:
    """`alpha A A^T + beta C` with `A = a_d s_a`, `C = c_d s_c`: `t^2 (alpha a' a'^T + beta c')`
    for a power of two `t` at least `s_a` and `sqrt(s_c)`, where `a' = a_d s_a / t` and
    `c' = c_d s_c / t^2` (each at most its data, in float32). `alpha` and `beta` are
    forwarded."""
    s_a, s_c = _scale32(a), _scale32(c)
    root_c, _ = _sqrt_scale(s_c)
    t = lax.stop_gradient(jnp.maximum(s_a, root_c))
    out = _P.symmetric_product_p.bind(
        _data(a, safe_div(s_a, t)), _data(c, safe_div(s_c, t * t)), **params
    )
    return _homogeneous(out, t * t, c.dtype)


# --- Solves -----------------------------------------------------------------------------


@registry.register_scaled_op(
    _P.triangular_solve_p,
    family="linalg",
    remark="solve(a_d, b_d) at scale s_b / s_a (s_b, on a's value, with unit_diagonal)",
)
def scaled_triangular_solve(a: ScaledArray, b: ScaledArray, **params: Any) -> ScaledArray:
    """`x = solve(a_d, b_d) * s_b / s_a`, the data renormalised to a largest magnitude ~1.

    With `unit_diagonal` the implicit ones do not scale with a: a's strict triangle
    is then used at its float32 value (as it is, for example, the L of a packed LU)
    and x has scale s_b.
    """
    s_a, s_b = _scale32(a), _scale32(b)
    cdtype = compute_dtype(b.dtype)
    if params.get("unit_diagonal", False):
        a_arg = _data(a) * s_a.astype(cdtype)
        scale = s_b
    else:
        a_arg = _data(a)
        scale = s_b / s_a
    x = _P.triangular_solve_p.bind(a_arg.astype(cdtype), _data(b).astype(cdtype), **params)
    return _homogeneous(x, scale, b.dtype)


@registry.register_scaled_op(
    _P.tridiagonal_solve_p,
    family="linalg",
    remark="diagonals at their largest scale sd: solve on data, scale s_b / sd",
)
def scaled_tridiagonal_solve(
    dl: ScaledArray, d: ScaledArray, du: ScaledArray, b: ScaledArray, **params: Any
) -> ScaledArray:
    """The three diagonals are brought to their largest scale (in float32) and solved on."""
    scales = [_scale32(x) for x in (dl, d, du)]
    common = lax.stop_gradient(jnp.maximum(jnp.maximum(scales[0], scales[1]), scales[2]))
    diags = [_data(x, safe_div(s, common)) for x, s in zip((dl, d, du), scales)]
    cdtype = compute_dtype(b.dtype)
    x = _P.tridiagonal_solve_p.bind(
        *[v.astype(cdtype) for v in diags], _data(b).astype(cdtype), **params
    )
    return _homogeneous(x, _scale32(b) / common, b.dtype)
