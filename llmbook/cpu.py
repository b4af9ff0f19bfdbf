"""Which numerical code paths this machine's libraries take: the facts behind a notebook's last bits.

The same pinned versions of torch, NumPy and SciPy give results that differ in their last bits from one
x86-64 CPU to another, because each library picks a code path for the CPU at run time:

- torch's own kernels (``ATEN_CPU_CAPABILITY``: ``avx512``, ``avx2`` or ``default``, the plain C++ path);
- Intel MKL, torch's BLAS (``MKL_CBWR``, MKL's conditional numerical reproducibility: ``AVX2``,
  ``COMPATIBLE``, ...), and oneDNN (``ONEDNN_MAX_CPU_ISA``);
- OpenBLAS, NumPy's and SciPy's BLAS (``OPENBLAS_CORETYPE``: ``SkylakeX``, ``Haswell``, ``Zen``, ...);
- NumPy's own SIMD loops (``NPY_DISABLE_CPU_FEATURES``).

Each variable, set before the process starts, forces another path on the same machine: that is how
``make test-portable`` re-executes the book as a CPU unlike the recording one would, and proves that no
stored output depends on the last bits. :func:`describe` says which paths are in use.
"""

from __future__ import annotations

import os

__all__ = ["CODE_PATH_VARIABLES", "forced", "describe"]

#: The environment variables that choose a numerical code path (read when each library loads).
CODE_PATH_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "OPENBLAS_CORETYPE",
                       "NPY_DISABLE_CPU_FEATURES")


def forced() -> list[str]:
    """The code-path variables set in this process's environment, as ``NAME=value`` (empty: the machine's own).

    >>> forced() == [f"{k}={os.environ[k]}" for k in CODE_PATH_VARIABLES if os.environ.get(k)]
    True
    """
    return [f"{k}={os.environ[k]}" for k in CODE_PATH_VARIABLES if os.environ.get(k)]


def _openblas_cores() -> str:
    try:
        import threadpoolctl
    except ImportError:  # an optional dependency (scikit-learn's)
        return "unknown"
    cores = sorted({str(info.get("architecture")) for info in threadpoolctl.threadpool_info()
                    if info.get("internal_api") == "openblas"})
    return "/".join(cores) if cores else "not loaded"


def describe() -> str:
    """One line: torch's CPU capability, the BLAS libraries' paths and any path variable that is set.

    >>> "torch capability" in describe()
    True
    """
    import numpy  # noqa: F401  (loads NumPy's OpenBLAS, so that threadpoolctl can see its core type)
    import torch

    paths = forced()
    return (f"torch capability {torch.backends.cpu.get_cpu_capability()}, "
            f"MKL {'yes' if torch.backends.mkl.is_available() else 'no'}, OpenBLAS core {_openblas_cores()}; "
            + (f"forced: {' '.join(paths)}" if paths else "no path forced (this machine's defaults)"))
