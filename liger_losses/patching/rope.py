"""Drop-in replacements for a Hugging Face modeling module's ``apply_rotary_pos_emb``.

``make_rotary_replacement(original)`` returns a function with the same call signature as
``original`` (either ``(q, k, cos, sin, unsqueeze_dim=1)`` as in transformers 5.x, or the older
``(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)``) that rotates with
``liger_losses.kernels.rope.apply_rotary_pos_emb``.

Shapes as in Hugging Face: ``q`` ``[B, n_q_heads, T, D]``, ``k`` ``[B, n_kv_heads, T, D]`` (with
``unsqueeze_dim=1``), ``cos``/``sin`` ``[B, T, R]`` with ``R <= D``. When ``R < D`` (partial rotary,
e.g. Phi-3 with ``partial_rotary_factor < 1``) only the first ``R`` features are rotated and the
rest pass through, exactly as the Hugging Face function does (the kernel handles it). Any float dtype; outputs keep it.
"""

from __future__ import annotations

import inspect
from typing import Callable


def _rotate(q, k, cos, sin, unsqueeze_dim):
    from liger_losses.kernels.rope import apply_rotary_pos_emb

    # The kernel rotates the first R = cos.shape[-1] features itself (partial rotary).
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def liger_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers 5.x signature: ``(q, k, cos, sin, unsqueeze_dim=1) -> (q_embed, k_embed)``."""
    return _rotate(q, k, cos, sin, unsqueeze_dim)


def liger_rotary_pos_emb_with_position_ids(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Older signature: ``position_ids`` is accepted and ignored (cos/sin are already gathered)."""
    return _rotate(q, k, cos, sin, unsqueeze_dim)


liger_rotary_pos_emb._liger = True
liger_rotary_pos_emb_with_position_ids._liger = True


def make_rotary_replacement(original: Callable) -> Callable:
    """The replacement whose signature matches ``original``'s."""
    try:
        params = inspect.signature(original).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins/odd wrappers
        params = {}
    if "position_ids" in params:
        return liger_rotary_pos_emb_with_position_ids
    return liger_rotary_pos_emb
