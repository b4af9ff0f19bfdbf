"""The Triton runtime shared by every kernel: availability, interpreter mode and the errors raised.

Triton is an optional dependency, imported on first use only (``import llmbook`` never imports it).
Its CPU interpreter is chosen by the environment variable ``TRITON_INTERPRET`` when ``triton`` is
first imported: ``triton.jit`` decorates Triton's own library at that moment, so a later change of
the variable cannot take effect. :func:`interpret_requested` is the one parse of that variable here
(Triton's own: ``1``, ``true``, ``yes``, ``on`` or ``y``, in any case), and :func:`interpreting`
reports the mode Triton was imported in, raising :class:`TritonModeError` when the two disagree.

The same failure raises the same exception in every kernel:

=========================================================  =============================
failure                                                    exception
=========================================================  =============================
triton is not installed                                    :class:`TritonUnavailableError` (an ``ImportError``)
``TRITON_INTERPRET`` changed after triton was imported     :class:`TritonModeError` (a ``RuntimeError``)
a CPU tensor without the interpreter                       ``ValueError``
a dtype the kernel does not support                        ``TypeError``
bfloat16 in the interpreter (its ``tl.dot`` is wrong)      ``TypeError``
a block size that is not a power of two >= 16              ``ValueError``
=========================================================  =============================

:func:`unsupported` returns that exception instead of raising it, so that a dispatcher can fall back
to PyTorch (``backend="auto"``) where an explicit ``backend="triton"`` raises it.

The modules that define ``@triton.jit`` kernels (``*_kernels.py``) get ``triton`` and ``tl`` from
:func:`triton_for_kernels` and are imported by :func:`load_kernels` on first use. Where triton is not
installed they still import (the registry imports every module), with decorators that do nothing.
"""

from __future__ import annotations

import importlib
import os

import torch

__all__ = [
    "TritonUnavailableError",
    "TritonModeError",
    "interpret_requested",
    "triton_available",
    "import_triton",
    "interpreting",
    "unsupported",
    "require",
    "check_block",
    "load_kernels",
    "triton_for_kernels",
]

INTERPRET_ENV = "TRITON_INTERPRET"
_TRUE = frozenset({"1", "true", "yes", "on", "y"})  # what triton.knobs accepts as true (no stripping)


class TritonUnavailableError(ImportError):
    """A Triton backend was asked for, but ``import triton`` fails."""


class TritonModeError(RuntimeError):
    """``TRITON_INTERPRET`` no longer matches the mode Triton was imported in."""


def interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter, parsed as Triton parses it.

    >>> import os
    >>> interpret_requested() == (os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on", "y"))
    True
    """
    return os.environ.get(INTERPRET_ENV, "").lower() in _TRUE


def triton_available() -> bool:
    """True if ``import triton`` works (it is an optional dependency: only the GPU backends need it).

    >>> isinstance(triton_available(), bool)
    True
    """
    try:
        import_triton("")
    except TritonUnavailableError:
        return False
    return True


def import_triton(op: str = "this kernel"):
    """Import ``triton`` (lazily, once) and return it; :class:`TritonUnavailableError` if it is missing."""
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError as err:
        raise TritonUnavailableError(
            f"the Triton backend of {op} needs the optional dependency triton (pip install triton); "
            "backend='torch' runs the PyTorch version instead") from err
    return triton


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter: the mode fixed when ``triton`` was first imported.

    Raises :class:`TritonModeError` when ``TRITON_INTERPRET`` asks for the other mode, since a change
    after the import cannot take effect and would otherwise fail deep inside a kernel.
    """
    import_triton()
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    imported = isinstance(tl.zeros, InterpretedFunction)  # triton.jit decorated its library in this mode
    if imported != interpret_requested():
        raise TritonModeError(
            f"{INTERPRET_ENV} changed after triton was imported (triton runs {'in' if imported else 'without'} "
            f"its interpreter, {INTERPRET_ENV}={os.environ.get(INTERPRET_ENV, '')!r}): set it, or unset it, before "
            "the first import of triton in this process, e.g. at the top of a script or in conftest.py")
    return imported


def unsupported(op: str, x: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> Exception | None:
    """Why the Triton kernel ``op`` cannot run on tensors like ``x`` (the exception to raise), or None.

    Checks, in order: triton is installed; its mode matches ``TRITON_INTERPRET`` (this one raises
    :class:`TritonModeError` at once: it is a set-up error, not a limit of the input); ``x`` is on
    CUDA or the interpreter runs; ``x.dtype`` is in ``dtypes``; no bfloat16 in the interpreter.

    >>> unsupported("op", torch.zeros(2, dtype=torch.float64), (torch.float32,)) is not None
    True
    """
    try:
        import_triton(op)
    except TritonUnavailableError as err:
        return err
    interpreted = interpreting()
    if not interpreted and not x.is_cuda:
        return ValueError(
            f"the Triton backend of {op} needs CUDA tensors, got device {x.device}; use backend='torch', or set "
            f"{INTERPRET_ENV}=1 before triton is first imported to run the kernel in Triton's CPU interpreter")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        return TypeError(f"the Triton backend of {op} supports {names}, got {x.dtype}")
    if interpreted and x.dtype == torch.bfloat16:
        return TypeError(
            f"the Triton backend of {op} refuses {x.dtype} in Triton's CPU interpreter: the interpreter's tl.dot "
            "on bfloat16 gives wrong results (values around 1e9); use float16 or float32 there, or a CUDA GPU")
    return None


def require(op: str, x: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> bool:
    """Raise what :func:`unsupported` finds; else return whether the kernel runs in the interpreter."""
    err = unsupported(op, x, dtypes)
    if err is not None:
        raise err
    return interpreting()


def check_block(value, name: str) -> int:
    """A tile size: a power of two >= 16 (``tl.dot`` needs at least 16 along each axis).

    >>> check_block(24, "BLOCK_M")
    Traceback (most recent call last):
    ...
    ValueError: BLOCK_M must be a power of two >= 16, got 24
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")
    return value


def load_kernels(module: str):
    """Import the kernel module ``module`` (``@triton.jit`` definitions) on first use, in the right mode.

    The mode is checked first, so that the kernels are decorated in the mode Triton was imported in;
    a kernel module imported earlier in the other mode (by the registry, say) is reported.
    """
    interpreted = interpreting()
    kernels = importlib.import_module(module)
    if kernels.triton is _NoTriton:  # imported while triton was missing (blocked), and it imports now
        kernels = importlib.reload(kernels)
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernels.MODE_PROBE, InterpretedFunction) != interpreted:
        raise TritonModeError(f"{module} was imported while {INTERPRET_ENV} asked for another mode than the one "
                              "triton runs in; set the variable before the first import of triton or llmbook's kernels")
    return kernels


class _NoTriton:
    """Stands in for ``triton`` in a kernel module where it is not installed: the decorators do nothing."""

    @staticmethod
    def jit(fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)

    @staticmethod
    def autotune(*args, **kwargs):
        return lambda f: f

    @staticmethod
    def Config(*args, **kwargs):  # noqa: N802 (triton's name)
        return (args, kwargs)


def triton_for_kernels():
    """``(triton, triton.language)`` for a module of ``@triton.jit`` kernels, or stand-ins without triton."""
    try:
        triton = import_triton()
    except TritonUnavailableError:
        return _NoTriton, None
    import triton.language as tl

    return triton, tl
