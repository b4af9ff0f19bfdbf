"""Argument checks shared by every module: one place for clear, contract-naming errors.

The convention: a value of the wrong *kind* (``True`` or ``2.5`` where an integer is meant, the
string ``'0.5'`` where a number is meant, an integer tensor where a floating one is meant) raises
``TypeError``; a value of the right kind outside its contract (``0`` heads, ``p = 1.5``, NaN, two
tensors of different shapes) raises ``ValueError``. Every message names the argument, the value
and the contract, e.g. ``"H must be a positive int, got 0"``.

Scalars:
    :func:`is_int`, :func:`is_real` (predicates), :func:`check_int`, :func:`check_positive_int`,
    :func:`check_nonnegative_int`,
    :func:`check_real`, :func:`check_range`, :func:`check_unit_interval`, :func:`check_divisible`,
    :func:`check_choice`.
Tensors:
    :func:`as_tensor`, :func:`check_floating`, :func:`check_integer_tensor`, :func:`check_token_ids`,
    :func:`check_same_dtype`, :func:`check_dim`, :func:`check_axis`, :func:`check_nonempty`, :func:`check_finite`,
    :func:`check_same_shape`, :func:`check_shape`, :func:`check_broadcastable_to`, :func:`check_size`,
    :func:`check_same_last_dim`, :func:`check_probability`.
Modules:
    :func:`check_module_input` (the tensor an ``nn.Module``'s ``forward`` receives).
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import torch

__all__ = [
    "as_tensor",
    "check_axis",
    "check_broadcastable_to",
    "check_choice",
    "check_dim",
    "check_divisible",
    "check_finite",
    "check_floating",
    "check_int",
    "check_integer_tensor",
    "check_module_input",
    "check_nonempty",
    "check_nonnegative_int",
    "check_positive_int",
    "check_probability",
    "check_range",
    "check_real",
    "check_same_dtype",
    "check_same_last_dim",
    "check_same_shape",
    "check_shape",
    "check_size",
    "check_token_ids",
    "check_unit_interval",
    "is_int",
    "is_real",
]


# ----------------------------------------------------------------------------------------------
# scalars


def is_int(value) -> bool:
    """Whether ``value`` is an integer scalar: Python or numpy ints, not ``bool`` (nor numpy's ``bool_``).

    >>> is_int(3), is_int(True), is_int(3.0)
    (True, False, False)
    """
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """Whether ``value`` is a real scalar (int, float, numpy number), not ``bool``, str or a tensor.

    >>> is_real(0.5), is_real(2), is_real(False), is_real("0.5")
    (True, True, False, False)
    """
    return isinstance(value, Real) and not isinstance(value, bool)


def check_int(value, name: str, *, low: int | None = None, high: int | None = None, what: str | None = None) -> int:
    """Return ``value`` as a Python ``int`` if it is an integer in ``[low, high]``.

    ``bool``, floats (even ``2.0``) and strings raise ``TypeError``; numpy integers are accepted.
    An integer outside ``[low, high]`` raises ``ValueError``. ``what`` overrides the contract text.

    >>> check_int(3, "T"), check_int(5, "k", low=0, high=5)
    (3, 5)
    >>> check_int(2.5, "T")
    Traceback (most recent call last):
    TypeError: T must be an int, got 2.5 (float)
    >>> check_int(7, "k", low=0, high=5)
    Traceback (most recent call last):
    ValueError: k must be an int in [0, 5], got 7
    """
    if what is None:
        if low is None and high is None:
            what = "an int"
        elif high is None:
            what = "a positive int" if low == 1 else "a non-negative int" if low == 0 else f"an int >= {low}"
        elif low is None:
            what = f"an int <= {high}"
        else:
            what = f"an int in [{low}, {high}]"
    if not is_int(value):
        raise TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be {what}, got {value}")
    return value


def check_positive_int(value, name: str) -> int:
    """Return ``value`` as an ``int >= 1``: ``TypeError`` for a non-integer, ``ValueError`` below 1.

    >>> check_positive_int(4, "H")
    4
    >>> check_positive_int(True, "H")
    Traceback (most recent call last):
    TypeError: H must be a positive int, got True (bool)
    >>> check_positive_int(0, "H")
    Traceback (most recent call last):
    ValueError: H must be a positive int, got 0
    """
    return check_int(value, name, low=1)


def check_nonnegative_int(value, name: str) -> int:
    """Return ``value`` as an ``int >= 0``: ``TypeError`` for a non-integer, ``ValueError`` below 0.

    >>> check_nonnegative_int(0, "offset")
    0
    >>> check_nonnegative_int(-1, "offset")
    Traceback (most recent call last):
    ValueError: offset must be a non-negative int, got -1
    """
    return check_int(value, name, low=0)


def check_real(value, name: str, *, finite: bool = True) -> float:
    """Return ``value`` as a ``float`` if it is a real number (not NaN; not ±inf when ``finite``).

    ``bool``, strings, complex numbers and tensors raise ``TypeError``; NaN and (when ``finite``)
    infinities raise ``ValueError``. Numpy scalars are accepted.

    >>> check_real(2, "mu")
    2.0
    >>> check_real("0.5", "mu")
    Traceback (most recent call last):
    TypeError: mu must be a real number, got '0.5' (str)
    >>> check_real(float("inf"), "mu")
    Traceback (most recent call last):
    ValueError: mu must be a finite real number, got inf
    """
    if not is_real(value):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must be a real number, got nan")
    if finite and math.isinf(value):
        raise ValueError(f"{name} must be a finite real number, got {value}")
    return value


def check_range(value, name: str, low=-math.inf, high=math.inf, *, low_open=False, high_open=False,
                finite: bool = True):
    """Check ``low <(=) value <(=) high`` and name the interval in the error; return ``value``.

    ``value`` must be a real number (``TypeError`` otherwise: bool, str, tensor) and not NaN.
    With ``finite`` (the default) ±inf is rejected even where a bound is infinite: an unbounded
    interval means "no limit", not "infinity is a valid setting"; pass ``finite=False`` where
    infinity is meaningful.

    >>> check_range(0.5, "p", 0.0, 1.0)
    0.5
    >>> check_range(1.5, "p", 0.0, 1.0)
    Traceback (most recent call last):
    ValueError: p must lie in [0.0, 1.0], got 1.5
    >>> check_range(float("inf"), "eps", 0.0)
    Traceback (most recent call last):
    ValueError: eps must lie in [0.0, inf), got inf
    >>> check_range(True, "p", 0.0, 1.0)
    Traceback (most recent call last):
    TypeError: p must be a real number, got True (bool)
    """
    check_real(value, name, finite=False)
    if finite:
        low_open = low_open or low == -math.inf
        high_open = high_open or high == math.inf
    lo_ok = value > low if low_open else value >= low
    hi_ok = value < high if high_open else value <= high
    if not (lo_ok and hi_ok):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must lie in {interval}, got {value}")
    return value


def check_unit_interval(value, name: str, *, low_open: bool = False, high_open: bool = False):
    """A probability-like scalar: ``value`` in ``[0, 1]`` (ends open on request); returns ``value``.

    >>> check_unit_interval(1.0, "p")
    1.0
    >>> check_unit_interval(0.0, "top_p", low_open=True)
    Traceback (most recent call last):
    ValueError: top_p must lie in (0.0, 1.0], got 0.0
    """
    return check_range(value, name, 0.0, 1.0, low_open=low_open, high_open=high_open)


def check_divisible(a: int, b: int, name_a: str, name_b: str) -> None:
    """Raise ``ValueError`` unless ``b`` divides ``a``, naming both.

    >>> check_divisible(32, 4, "d_model", "n_heads")
    >>> check_divisible(30, 4, "d_model", "n_heads")
    Traceback (most recent call last):
    ValueError: d_model (30) must be divisible by n_heads (4)
    """
    if a % b:
        raise ValueError(f"{name_a} ({a}) must be divisible by {name_b} ({b})")


def check_choice(value, name: str, choices) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices`` (listed in the message).

    >>> check_choice("mean", "reduction", ("mean", "sum", "none"))
    >>> check_choice("avg", "reduction", ("mean", "sum", "none"))
    Traceback (most recent call last):
    ValueError: reduction must be one of 'mean', 'sum', 'none', got 'avg'
    """
    try:
        ok = value in choices
    except TypeError:  # an unhashable value against a set
        ok = False
    if not ok:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


# ----------------------------------------------------------------------------------------------
# tensors: conversion and dtype


def as_tensor(x, name: str, *, floating: bool = True) -> torch.Tensor:
    """Return ``x`` as a tensor (lists and numpy arrays are converted), or raise ``TypeError``.

    With ``floating``, an integer tensor is converted to the default float dtype, while a bool or
    complex one raises ``TypeError``.

    >>> as_tensor([1, 2], "x")
    tensor([1., 2.])
    >>> as_tensor("ab", "x")
    Traceback (most recent call last):
    TypeError: x must be a tensor or array-like, got str
    """
    if isinstance(x, torch.Tensor):
        t = x
    else:
        if isinstance(x, (str, bytes)):
            raise TypeError(f"{name} must be a tensor or array-like, got {type(x).__name__}")
        try:
            t = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"{name} must be a tensor or array-like, got {type(x).__name__}") from err
    if floating and not t.is_floating_point():
        if t.dtype == torch.bool or t.is_complex():
            raise TypeError(f"{name} must be a real floating-point tensor, got dtype {t.dtype}")
        t = t.to(torch.get_default_dtype())
    return t


def check_floating(x: torch.Tensor, name: str) -> None:
    """Raise ``TypeError`` unless ``x`` is a real floating-point tensor.

    >>> check_floating(torch.zeros(2, dtype=torch.int64), "x")
    Traceback (most recent call last):
    TypeError: x must be a real floating-point tensor, got dtype torch.int64
    """
    _require_tensor(x, name)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a real floating-point tensor, got dtype {x.dtype}")


def check_integer_tensor(x, name: str, what: str = "an integer tensor") -> torch.Tensor:
    """Return ``x`` as an integer tensor (ids, indices); ``TypeError`` for float, bool or complex.

    A bool tensor would index as a mask, silently; ``what`` overrides the contract text.

    >>> check_integer_tensor([0, 3], "ids")
    tensor([0, 3])
    >>> check_integer_tensor(torch.tensor([True, False]), "ids")
    Traceback (most recent call last):
    TypeError: ids must be an integer tensor, got dtype torch.bool
    """
    t = as_tensor(x, name, floating=False)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name} must be {what}, got dtype {t.dtype}")
    return t


def check_token_ids(ids, V: int, name: str = "ids") -> torch.Tensor:
    """Return ``ids`` as a ``long`` tensor after checking every id is an integer in ``[0, V)``.

    >>> check_token_ids([2, 0], 3)
    tensor([2, 0])
    >>> check_token_ids(torch.tensor([1, 3]), 3)
    Traceback (most recent call last):
    ValueError: ids must be token ids in [0, V) = [0, 3), got range [1, 3]
    """
    ids = check_integer_tensor(ids, name, "a tensor of integer token ids")
    if ids.numel() and (ids.min() < 0 or ids.max() >= V):
        raise ValueError(f"{name} must be token ids in [0, V) = [0, {V}), got range "
                         f"[{ids.min().item()}, {ids.max().item()}]")
    return ids.long()


def check_same_dtype(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    """Raise ``TypeError`` unless ``a`` and ``b`` share one dtype (no silent promotion).

    >>> check_same_dtype(torch.zeros(1), torch.zeros(1, dtype=torch.float64), "x", "W")
    Traceback (most recent call last):
    TypeError: x (torch.float32) and W (torch.float64) must share one dtype
    """
    if a.dtype != b.dtype:
        raise TypeError(f"{name_a} ({a.dtype}) and {name_b} ({b.dtype}) must share one dtype")


# ----------------------------------------------------------------------------------------------
# tensors: shapes and values


def _require_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")


def check_dim(x: torch.Tensor, name: str, contract: str, *, min_dim: int = 1, max_dim: int | None = None):
    """Raise ``ValueError`` if ``x.ndim`` is outside ``[min_dim, max_dim]``; ``contract`` names the shape.

    >>> check_dim(torch.zeros(3), "x", "(B, T, C)", min_dim=3)
    Traceback (most recent call last):
    ValueError: x must have shape (B, T, C), got (3,)
    """
    _require_tensor(x, name)
    if x.ndim < min_dim or (max_dim is not None and x.ndim > max_dim):
        raise ValueError(f"{name} must have shape {contract}, got {tuple(x.shape)}")


def check_axis(x: torch.Tensor, dim, name: str) -> int:
    """Return ``dim`` if it is an int naming an axis of ``x`` (``-x.ndim <= dim < x.ndim``), else raise.

    >>> check_axis(torch.zeros(2, 3), -1, "z")
    -1
    >>> check_axis(torch.zeros(2, 3), 5, "z")
    Traceback (most recent call last):
    ValueError: dim (5) must name an axis of z of shape (2, 3): an int in [-2, 1]
    """
    dim = check_int(dim, "dim")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim ({dim}) must name an axis of {name} of shape {tuple(x.shape)}: "
                         f"an int in [{-x.ndim}, {x.ndim - 1}]")
    return dim


def check_nonempty(x: torch.Tensor, name: str, dim: int = -1):
    """Raise ``ValueError`` if ``x`` is 0-d or empty along ``dim``.

    >>> check_nonempty(torch.zeros(2, 0), "z")
    Traceback (most recent call last):
    ValueError: z must not be empty along dim -1, got shape (2, 0)
    """
    _require_tensor(x, name)
    if x.ndim == 0 or x.shape[dim] == 0:
        raise ValueError(f"{name} must not be empty along dim {dim}, got shape {tuple(x.shape)}")


def check_finite(x: torch.Tensor, name: str, *, allow_neg_inf: bool = False):
    """Reject NaN (and +inf; -inf only where masking makes it meaningful).

    >>> check_finite(torch.tensor([0.0, float("nan")]), "z")
    Traceback (most recent call last):
    ValueError: z contains NaN
    """
    _require_tensor(x, name)
    if torch.isnan(x).any():
        raise ValueError(f"{name} contains NaN")
    bad = torch.isposinf(x) if allow_neg_inf else torch.isinf(x)
    if bad.any():
        what = "+inf" if allow_neg_inf else "inf"
        raise ValueError(f"{name} contains {what}")


def check_same_shape(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str):
    """Raise ``ValueError`` unless ``a`` and ``b`` have the same shape.

    >>> check_same_shape(torch.zeros(2, 3), torch.zeros(3, 2), "p", "q")
    Traceback (most recent call last):
    ValueError: p (2, 3) and q (3, 2) must have the same shape
    """
    if a.shape != b.shape:
        raise ValueError(f"{name_a} {tuple(a.shape)} and {name_b} {tuple(b.shape)} must have the same shape")


def check_shape(x, shape, name: str, why: str | None = None) -> torch.Tensor:
    """Raise unless ``x`` is a tensor of exactly ``shape``: ``TypeError`` for a non-tensor, else ``ValueError``.

    ``why`` says what fixes the shape (e.g. ``"the channel dim C of x"``). Returns ``x``.

    >>> check_shape(torch.zeros(4), (3,), "running_mean", "the channel dim C of x")
    Traceback (most recent call last):
    ValueError: running_mean must have shape (3,) to match the channel dim C of x, got (4,)
    """
    _require_tensor(x, name)
    shape = tuple(shape)
    if tuple(x.shape) != shape:
        reason = f" to match {why}" if why else ""
        raise ValueError(f"{name} must have shape {shape}{reason}, got {tuple(x.shape)}")
    return x


def check_batch_broadcast(a: torch.Tensor, b: torch.Tensor, core: int, name_a: str, name_b: str) -> None:
    """Raise ``ValueError`` unless the batch axes of ``a`` and ``b`` (all but their last ``core``) broadcast.

    >>> check_batch_broadcast(torch.zeros(2, 3, 4), torch.zeros(1, 5, 4), 2, "q", "k")
    >>> check_batch_broadcast(torch.zeros(2, 4), torch.zeros(3, 4), 1, "q", "k")
    Traceback (most recent call last):
    ValueError: the batch axes of q (2, 4) and k (3, 4) must be equal or broadcast (sizes 1 or equal)
    """
    try:
        torch.broadcast_shapes(a.shape[:a.ndim - core], b.shape[:b.ndim - core])
    except RuntimeError:
        raise ValueError(f"the batch axes of {name_a} {tuple(a.shape)} and {name_b} {tuple(b.shape)} "
                         f"must be equal or broadcast (sizes 1 or equal)") from None


def check_broadcastable_to(x: torch.Tensor, shape, name: str, target: str) -> None:
    """Raise ``ValueError`` unless ``x`` broadcasts *to* ``shape`` (not merely *with* it).

    ``(3, 1, 3, 3)`` broadcasts with ``(1, 2, 3, 3)`` but not to it: the result would grow.

    >>> check_broadcastable_to(torch.zeros(1, 3), (2, 3), "mask", "the scores")
    >>> check_broadcastable_to(torch.zeros(3, 1, 3, 3), (1, 2, 3, 3), "mask", "the scores")
    Traceback (most recent call last):
    ValueError: mask (3, 1, 3, 3) must broadcast to the scores (1, 2, 3, 3)
    """
    shape = tuple(shape)
    xs = tuple(x.shape)
    ok = len(xs) <= len(shape) and all(a in (1, b) for a, b in zip(reversed(xs), reversed(shape), strict=False))
    if not ok:
        raise ValueError(f"{name} {xs} must broadcast to {target} {shape}")


def check_size(x: torch.Tensor, dim: int, size: int, name: str, contract: str) -> None:
    """Raise ``ValueError`` unless ``x.shape[dim] == size``; ``contract`` names the expected shape.

    >>> check_size(torch.zeros(3, 4), -1, 5, "weight", "(C,) with C = 5")
    Traceback (most recent call last):
    ValueError: weight must have shape (C,) with C = 5, got (3, 4)
    """
    if x.ndim == 0 or x.shape[dim] != size:
        raise ValueError(f"{name} must have shape {contract}, got {tuple(x.shape)}")


def check_same_last_dim(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str, symbol: str = "the last axis"):
    """Raise ``ValueError`` unless ``a`` and ``b`` agree on their last axis (``symbol`` names it).

    >>> check_same_last_dim(torch.zeros(2, 4), torch.zeros(3, 5), "x", "W", "d_in")
    Traceback (most recent call last):
    ValueError: x (2, 4) and W (3, 5) disagree on d_in: 4 != 5
    """
    if a.ndim == 0 or b.ndim == 0 or a.shape[-1] != b.shape[-1]:
        got = f"{a.shape[-1] if a.ndim else '?'} != {b.shape[-1] if b.ndim else '?'}"
        raise ValueError(f"{name_a} {tuple(a.shape)} and {name_b} {tuple(b.shape)} disagree on {symbol}: {got}")


def check_probability(p: torch.Tensor, name: str, dim: int = -1, atol: float = 1e-4):
    """``p`` must be non-negative and sum to one along ``dim``, within ``atol`` or the dtype's rounding.

    The sum is taken in float64, and the tolerance is at least the machine epsilon of ``p``'s dtype:
    rounding each entry to bf16 moves the sum by up to half its epsilon (a bf16 softmax sums to
    0.996-1.004), so a distribution stored in half precision is accepted as such.

    >>> check_probability(torch.tensor([0.5, 0.6]), "p")
    Traceback (most recent call last):
    ValueError: p must sum to 1 along dim -1; sums range over [1.1, 1.1]
    """
    check_finite(p, name)
    if (p < 0).any():
        raise ValueError(f"{name} must be non-negative (a probability distribution)")
    s = p.to(torch.float64).sum(dim)
    if p.is_floating_point():
        atol = max(atol, torch.finfo(p.dtype).eps)
    if not torch.allclose(s, torch.ones_like(s), atol=atol):
        raise ValueError(f"{name} must sum to 1 along dim {dim}; sums range over "
                         f"[{s.min().item():.6g}, {s.max().item():.6g}]")


# ----------------------------------------------------------------------------------------------
# modules


def _module_dtype(module) -> torch.dtype | None:
    """The dtype of ``module``'s first floating parameter (else buffer); None when it holds neither."""
    for t in (*module.parameters(), *module.buffers()):
        if t.is_floating_point():
            return t.dtype
    return None


def flatten_leading(x: torch.Tensor, core: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x`` of shape ``(..., *core_axes)`` as ``(N, *core_axes)`` (all leading axes in one, 1 if there are none),
    and the leading shape to restore with ``y.reshape(*lead, ...)``.

    >>> y, lead = flatten_leading(torch.zeros(2, 3, 5, 4), 2)
    >>> tuple(y.shape), lead
    ((6, 5, 4), (2, 3))
    >>> tuple(flatten_leading(torch.zeros(5, 4), 2)[0].shape)
    (1, 5, 4)
    """
    lead = tuple(x.shape[:x.ndim - core])
    return x.reshape(math.prod(lead), *x.shape[x.ndim - core:]) if lead else x.unsqueeze(0), lead


def check_module_input(module, x, name: str = "x", *, d: int | None = None, symbol: str = "d_model",
                       ndim: int | None = None, contract: str | None = None) -> torch.Tensor:
    """The tensor a module's ``forward`` receives: check it before it reaches ``nn.Linear``; return it.

    ``x`` must be a tensor (``TypeError`` for a list: build the tensor, in the module's dtype) of a
    real floating dtype (``TypeError`` for an integer or bool tensor) equal to the dtype of the
    module's floating parameters (``TypeError``: ``nn.Linear`` does not promote; cast with
    ``module.to(x.dtype)`` or ``x.to(...)``). Under autocast the dtype equality is not required.
    With ``ndim`` the tensor must have exactly that many axes, with ``d`` its last axis must be
    ``d`` (``ValueError`` naming ``contract``, e.g. ``"(B, T, d_model)"``, and ``symbol``).

    >>> lin = torch.nn.Linear(4, 2)
    >>> check_module_input(lin, torch.zeros(3, 4), d=4, symbol="d_in").shape
    torch.Size([3, 4])
    >>> check_module_input(lin, torch.zeros(3, 4, dtype=torch.int64))
    Traceback (most recent call last):
    TypeError: x must be a real floating-point tensor, got dtype torch.int64
    >>> check_module_input(lin, torch.zeros(3, 4, dtype=torch.float64))
    Traceback (most recent call last):
    TypeError: x (torch.float64) must have the dtype of the Linear's parameters (torch.float32); cast one to the other
    >>> check_module_input(lin, torch.zeros(3, 5), d=4, symbol="d_in", contract="(..., d_in)")
    Traceback (most recent call last):
    ValueError: x must have shape (..., d_in) with d_in = 4, got (3, 5)
    """
    check_floating(x, name)
    dtype = _module_dtype(module)
    device = x.device.type
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    if dtype is not None and x.dtype != dtype and not autocast:
        raise TypeError(f"{name} ({x.dtype}) must have the dtype of the {type(module).__name__}'s parameters "
                        f"({dtype}); cast one to the other")
    if (ndim is not None and x.ndim != ndim) or (d is not None and (x.ndim == 0 or x.shape[-1] != d)):
        shape = contract or f"(..., {symbol})"
        what = f" with {symbol} = {d}" if d is not None else ""
        raise ValueError(f"{name} must have shape {shape}{what}, got {tuple(x.shape)}")
    return x
