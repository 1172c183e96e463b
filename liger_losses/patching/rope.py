"""Drop-in replacements for a Hugging Face modeling module's ``apply_rotary_pos_emb``.

``make_rotary_replacement(original)`` returns a function (out of place; in place for
``INPLACE_FAMILIES`` only when ``INPLACE`` is set) with the same call signature as ``original`` (either ``(q, k, cos, sin, unsqueeze_dim=1)`` as in transformers 5.x, or the older
``(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)``) that rotates with
``liger_losses.kernels.rope.apply_rotary_pos_emb``.

Shapes as in Hugging Face: ``q`` ``[B, n_q_heads, T, D]``, ``k`` ``[B, n_kv_heads, T, D]`` (with
``unsqueeze_dim=1``), ``cos``/``sin`` ``[B, T, R]`` with ``R <= D``. When ``R < D`` (partial rotary,
e.g. Phi-3 with ``partial_rotary_factor < 1``) only the first ``R`` features are rotated and the
rest pass through, exactly as the Hugging Face function does (the kernel handles it). Any float dtype; outputs keep it.

In-place rotation (off by default): for the families listed in ``INPLACE_FAMILIES`` the
replacement can rotate q and k in place (``inplace=True``): their attention builds q/k as ``proj(h).view(B, T, H, D).transpose(1, 2)``
fresh tensors used by nothing but the rotation, so this is
safe and saves the outputs' allocation (Qwen3's q/k are views of its q_norm/k_norm outputs, which our
RMSNorm returns as plain tensors so that autograd allows it). Phi-3 is excluded (q/k are slices of one
qkv tensor).
Set ``liger_losses.patching.rope.INPLACE = True`` to turn it on at call time; the gradients of
q_embed/k_embed (fresh buffers from the attention's backward, used by nothing else) are then rotated
in their own buffers too (``INPLACE_BACKWARD``). It is off: with the gradient layout SDPA returns,
in place and out of place take the same GPU time (H200, 8B shapes, forward + backward, 8192
tokens: 0.093 ms both, session 4 -- session 3's 0.160 for in place was a measurement error), the
out-of-place transient never sits on a training step's peak, and in place costs more host time per
call (0.22 vs 0.10 ms per forward, session 2), which decides short, host-bound steps.
"""

from __future__ import annotations

import inspect
from typing import Callable


# Module-level switches read at every call of the in-place replacements (see the module docstring).
INPLACE = False
INPLACE_BACKWARD = True  # with INPLACE: rotate the incoming gradients in their buffers as well

# transformers model families whose attention passes q/k to apply_rotary_pos_emb as fresh views of
# the projection (or q_norm/k_norm) outputs used by nothing else (checked in transformers 5.x).
INPLACE_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"})


def _rotate(q, k, cos, sin, unsqueeze_dim, inplace=False):
    from liger_losses.kernels.rope import apply_rotary_pos_emb

    # The kernel rotates the first R = cos.shape[-1] features itself (partial rotary).
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, inplace=inplace,
                                inplace_backward=inplace and INPLACE_BACKWARD)


def liger_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers 5.x signature: ``(q, k, cos, sin, unsqueeze_dim=1) -> (q_embed, k_embed)``."""
    return _rotate(q, k, cos, sin, unsqueeze_dim)


def liger_rotary_pos_emb_with_position_ids(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Older signature: ``position_ids`` is accepted and ignored (cos/sin are already gathered)."""
    return _rotate(q, k, cos, sin, unsqueeze_dim)


def liger_rotary_pos_emb_inplace(q, k, cos, sin, unsqueeze_dim=1):
    """As ``liger_rotary_pos_emb`` but rotating q and k in place while ``INPLACE`` is True."""
    return _rotate(q, k, cos, sin, unsqueeze_dim, INPLACE)


def liger_rotary_pos_emb_with_position_ids_inplace(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Older signature, in place while ``INPLACE`` is True."""
    return _rotate(q, k, cos, sin, unsqueeze_dim, INPLACE)


for _fn in (
    liger_rotary_pos_emb,
    liger_rotary_pos_emb_with_position_ids,
    liger_rotary_pos_emb_inplace,
    liger_rotary_pos_emb_with_position_ids_inplace,
):
    _fn._liger = True


def _family(original: Callable) -> str:
    """'llama' for transformers.models.llama.modeling_llama.apply_rotary_pos_emb, else ''."""
    module = getattr(original, "__module__", "") or ""
    prefix = "transformers.models."
    if module.startswith(prefix) and module.count(".") == 3:
        return module.split(".")[2]
    return ""


def make_rotary_replacement(original: Callable) -> Callable:
    """The replacement whose signature matches ``original``'s."""
    try:
        params = inspect.signature(original).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins/odd wrappers
        params = {}
    inplace = _family(original) in INPLACE_FAMILIES
    if "position_ids" in params:
        return liger_rotary_pos_emb_with_position_ids_inplace if inplace else liger_rotary_pos_emb_with_position_ids
    return liger_rotary_pos_emb_inplace if inplace else liger_rotary_pos_emb
