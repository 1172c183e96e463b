"""The kernel modules a family's patch binds, by kind (``specs.NORM_KINDS``, ``specs.MLP_KINDS``).

* norms: ``llama`` -> ``LigerRMSNorm`` (``w * x_hat.to(dtype)``), ``gemma`` -> ``LigerGemmaRMSNorm``
  (``(x_hat * (1 + w)).to(dtype)`` in fp32), ``olmo`` -> ``LigerOlmoRMSNorm`` (``(w * x_hat).to(dtype)``,
  the product in fp32: OLMo-2/3's ``Olmo2RMSNorm``; the kernel's ``casting_mode="none"``).
  Each is built as ``(hidden_size, eps)``, like the transformers class it replaces.
* MLPs: ``swiglu`` -> ``LigerSwiGLUMLP``, ``phi3`` (packed ``gate_up_proj``: Phi-3, GLM-4) ->
  ``LigerPhi3SwiGLUMLP``, ``geglu`` -> ``LigerGEGLUMLP``; ``mlp_parts(kind)`` names the
  ``nn.Linear`` sub-modules each re-binds from the transformers MLP.
"""

from __future__ import annotations

from liger_losses.kernels.mlp import LigerGEGLUMLP, LigerPhi3SwiGLUMLP, LigerSwiGLUMLP
from liger_losses.kernels.rms_norm import LigerGemmaRMSNorm, LigerRMSNorm
from liger_losses.patching.checks import mlp_parts  # noqa: F401 (re-exported)


class LigerOlmoRMSNorm(LigerRMSNorm):
    """Drop-in for ``Olmo2RMSNorm`` / ``Olmo3RMSNorm``: ``(weight * normalize(x.float())).to(x.dtype)``
    (weight of ones, ``variance_epsilon`` attr), i.e. ``LigerRMSNorm`` in ``casting_mode="none"``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, **options) -> None:
        options.setdefault("casting_mode", "none")
        super().__init__(hidden_size, eps, **options)


_NORMS = {"llama": LigerRMSNorm, "gemma": LigerGemmaRMSNorm, "olmo": LigerOlmoRMSNorm}
_MLPS = {"swiglu": LigerSwiGLUMLP, "phi3": LigerPhi3SwiGLUMLP, "geglu": LigerGEGLUMLP}


def norm_class(kind: str) -> type:
    return _NORMS[kind]


def mlp_class(kind: str) -> type:
    return _MLPS[kind]
