"""The package surface: every name in ``liger_losses.__all__`` exists, and importing the package
pulls in neither ``trl`` nor ``transformers`` (layers 1-2 must stay importable without them)."""

import subprocess
import sys

import liger_losses


def test_public_names_exist():
    """Each re-exported name resolves to an object (a missing one would be an ImportError at use)."""
    missing = [n for n in liger_losses.__all__ if not hasattr(liger_losses, n)]
    assert missing == []


def test_import_is_light():
    """`import liger_losses` in a fresh interpreter imports neither trl nor transformers."""
    code = "import sys, liger_losses; print('trl' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr
