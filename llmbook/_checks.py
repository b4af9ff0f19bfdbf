"""Argument checks shared by every module: one place for clear, contract-naming errors."""

from __future__ import annotations

import math

import torch

__all__ = [
    "as_tensor",
    "check_dim",
    "check_finite",
    "check_nonempty",
    "check_probability",
    "check_range",
    "check_same_shape",
]


def as_tensor(x, name: str, *, floating: bool = True) -> torch.Tensor:
    """Return ``x`` as a tensor (lists and numpy arrays are converted), or raise ``TypeError``."""
    if isinstance(x, torch.Tensor):
        t = x
    else:
        try:
            t = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"{name} must be a tensor or array-like, got {type(x).__name__}") from err
    if floating and not t.is_floating_point():
        if t.dtype == torch.bool or t.is_complex():
            raise TypeError(f"{name} must be a real floating-point tensor, got dtype {t.dtype}")
        t = t.to(torch.get_default_dtype())
    return t


def check_dim(x: torch.Tensor, name: str, contract: str, *, min_dim: int = 1, max_dim: int | None = None):
    """Raise ``ValueError`` if ``x.ndim`` is outside ``[min_dim, max_dim]``; ``contract`` names the shape."""
    if x.ndim < min_dim or (max_dim is not None and x.ndim > max_dim):
        raise ValueError(f"{name} must have shape {contract}, got {tuple(x.shape)}")


def check_nonempty(x: torch.Tensor, name: str, dim: int = -1):
    if x.ndim == 0 or x.shape[dim] == 0:
        raise ValueError(f"{name} must not be empty along dim {dim}, got shape {tuple(x.shape)}")


def check_finite(x: torch.Tensor, name: str, *, allow_neg_inf: bool = False):
    """Reject NaN (and +inf; -inf only where masking makes it meaningful)."""
    if torch.isnan(x).any():
        raise ValueError(f"{name} contains NaN")
    bad = torch.isposinf(x) if allow_neg_inf else torch.isinf(x)
    if bad.any():
        what = "+inf" if allow_neg_inf else "inf"
        raise ValueError(f"{name} contains {what}")


def check_same_shape(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str):
    if a.shape != b.shape:
        raise ValueError(f"{name_a} {tuple(a.shape)} and {name_b} {tuple(b.shape)} must have the same shape")


def check_range(value, name: str, low=-math.inf, high=math.inf, *, low_open=False, high_open=False):
    """Check ``low <(=) value <(=) high`` and name the interval in the error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    lo_ok = value > low if low_open else value >= low
    hi_ok = value < high if high_open else value <= high
    if not (lo_ok and hi_ok):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must lie in {interval}, got {value}")


def check_probability(p: torch.Tensor, name: str, dim: int = -1, atol: float = 1e-4):
    """``p`` must be non-negative and sum to one along ``dim``."""
    check_finite(p, name)
    if (p < 0).any():
        raise ValueError(f"{name} must be non-negative (a probability distribution)")
    s = p.sum(dim)
    if not torch.allclose(s, torch.ones_like(s), atol=atol):
        raise ValueError(f"{name} must sum to 1 along dim {dim}; sums range over "
                         f"[{s.min().item():.6g}, {s.max().item():.6g}]")
