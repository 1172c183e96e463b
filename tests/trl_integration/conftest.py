"""Fixtures of the TRL-integration tests.

``apply_liger_kernels`` patches RoPE module-wide (the modeling module's ``apply_rotary_pos_emb``), so
a test that patches a model would leave every later model of that family on our (interpreted, slow)
RoPE kernel. Every test here is followed by ``revert_liger_kernels()``, so tests don't depend on order.
``tok`` is the tokenizer fixture shared by the test modules.
"""

import pytest


@pytest.fixture(autouse=True)
def _revert_module_patches():
    yield
    from liger_losses.patching import revert_liger_kernels

    revert_liger_kernels()


@pytest.fixture(scope="module")
def tok():
    """The bundled character tokenizer (right padding); a test module may override it."""
    from .utils import build_tokenizer

    return build_tokenizer()
