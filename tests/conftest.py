"""Shared test set-up: deterministic seeds and the ``equation`` marker's contract."""

import os
import random

import numpy as np
import pytest
import torch

# Without CUDA, Triton kernels can only run in its interpreter. The mode is fixed when triton is first
# imported (transformers' Mixtral module imports it too), so it is chosen here, before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One thread per test process: pytest-xdist already runs one process per core, and torch's own
# threads only fight over the cores for the tiny tensors used here.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same seeds, so a failure reproduces."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.equation`` must name catalogue ids and a non-empty ``oracle``."""
    from llmbook.registry import catalogue

    known = catalogue()
    for item in items:
        for mark in item.iter_markers("equation"):
            bad = [i for i in mark.args if i not in known]
            oracle = mark.kwargs.get("oracle", "")
            if bad or not mark.args:
                raise pytest.UsageError(f"{item.nodeid}: equation marker with unknown ids {bad or '(none given)'}")
            if not oracle or oracle.startswith("llmbook"):
                raise pytest.UsageError(
                    f"{item.nodeid}: equation marker must name an independent oracle, got {oracle!r}")
