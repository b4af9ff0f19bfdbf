"""The code-path variables really move torch and OpenBLAS to another path, and describe() says which."""

import os
import subprocess
import sys

import pytest

from llmbook import cpu


def _describe(env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in cpu.CODE_PATH_VARIABLES}
    out = subprocess.run([sys.executable, "-m", "llmbook", "cpu"], capture_output=True, text=True,
                         env={**clean, **env}, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_machine_default_is_reported_as_not_forced():
    line = _describe({})
    assert "torch capability" in line and "no path forced" in line


def test_forcing_torch_onto_its_plain_cpp_kernels_takes_effect():
    line = _describe({"ATEN_CPU_CAPABILITY": "default"})
    assert "torch capability DEFAULT" in line and "forced: ATEN_CPU_CAPABILITY=default" in line


def test_forcing_openblas_onto_another_core_takes_effect():
    pytest.importorskip("threadpoolctl")
    line = _describe({"OPENBLAS_CORETYPE": "Haswell"})
    assert "OpenBLAS core Haswell" in line, line


def test_forced_lists_exactly_the_variables_that_are_set(monkeypatch):
    for name in cpu.CODE_PATH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert cpu.forced() == []
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "")  # empty: not forced
    assert cpu.forced() == ["MKL_CBWR=COMPATIBLE"]
