"""Test set-up shared by the whole suite.

On a machine without a CUDA GPU the Triton kernels run in Triton's CPU interpreter, which must be
switched on before ``triton`` is first imported; so it is set here, before any test module imports
``liger_losses``. On the GPU (``pytest -m gpu``) the interpreter stays off and kernels compile.
"""

import os

import pytest

try:  # decide before torch/triton are imported anywhere
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests where there is no CUDA device."""
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    """Fresh but reproducible random inputs per test."""
    import torch

    torch.manual_seed(0)
    yield
