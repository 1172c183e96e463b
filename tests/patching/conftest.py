"""Every patching test starts and ends with the Hugging Face modeling modules unpatched.

The RoPE patch (and class-level patches) are process-wide, so a test that patches would otherwise
leak our kernels into the reference models of the next test.
"""

import pytest


@pytest.fixture(autouse=True)
def _unpatched_modules():
    from liger_losses.patching import revert_liger_kernels

    revert_liger_kernels()
    yield
    revert_liger_kernels()
