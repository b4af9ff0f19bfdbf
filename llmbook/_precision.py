"""Low-precision policy shared by every module: compute in float32, return in the caller's dtype.

fp16 tops out at 65504 and bf16 keeps 8 significant bits, so a sum of squares (a norm's variance),
a dot product (an attention score) or a ratio ``z / tau`` overflows or loses its digits long before
the result itself would. Like torch's own kernels, the functions of :mod:`llmbook` upcast fp16 and
bf16 inputs to float32 for the arithmetic and round once at the end. float32 and float64 inputs
pass through untouched (the very same tensor), so their results do not change by a single bit.
"""

from __future__ import annotations

import torch

__all__ = ["HALF", "compute_dtype", "upcast_half", "restore_half"]

#: The dtypes that are computed in float32.
HALF = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype arithmetic runs in: float32 for fp16 / bf16, ``dtype`` itself otherwise.

    >>> compute_dtype(torch.bfloat16), compute_dtype(torch.float64)
    (torch.float32, torch.float64)
    """
    return torch.float32 if dtype in HALF else dtype


def upcast_half(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 when it is fp16 / bf16, else ``x`` itself (no copy).

    >>> upcast_half(torch.ones(2, dtype=torch.float16)).dtype
    torch.float32
    """
    return x.to(torch.float32) if x.dtype in HALF else x


def restore_half(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``y`` rounded back to ``dtype`` when that is fp16 / bf16 (the inverse of :func:`upcast_half`), else ``y``.

    >>> restore_half(torch.ones(2), torch.bfloat16).dtype
    torch.bfloat16
    """
    return y.to(dtype) if dtype in HALF else y
