"""Drop-in replacements for a Hugging Face modeling module's ``apply_rotary_pos_emb``.

``make_rotary_replacement(original)`` returns a function (in place for ``INPLACE_FAMILIES`` while
``ROPE_PATCH.current.inplace`` is set, else out of place) with the same call signature as
``original`` (either ``(q, k, cos, sin, unsqueeze_dim=1)`` as in transformers 5.x, or the older
``(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)``) that rotates with
``liger_losses.kernels.rope.apply_rotary_pos_emb``.

Shapes as in Hugging Face: ``q`` ``[B, n_q_heads, T, D]``, ``k`` ``[B, n_kv_heads, T, D]`` (with
``unsqueeze_dim=1``), ``cos``/``sin`` ``[B, T, R]`` with ``R <= D``. When ``R < D`` (partial rotary,
e.g. Phi-3 with ``partial_rotary_factor < 1``) only the first ``R`` features are rotated and the
rest pass through, exactly as the Hugging Face function does (the kernel handles it). Any float dtype; outputs keep it.

In-place rotation (on by default): for the families listed in ``INPLACE_FAMILIES`` the
replacement rotates q and k in place (``inplace=True``): their attention builds q/k as
``proj(h).view(B, T, H, D).transpose(1, 2)``, fresh tensors used by nothing but the rotation, so
this is safe and saves the outputs' allocation (Qwen3's q/k are views of its q_norm/k_norm outputs,
which our RMSNorm returns as plain tensors so that autograd allows it). Phi-3 is excluded (q/k are
slices of one qkv tensor). The gradients of q_embed/k_embed (fresh buffers from the attention's
backward, used by nothing else) are rotated in their own buffers too (``inplace_backward``), as
liger-kernel does: the rotation then allocates nothing, forward or backward. H200
(``bench_rope.py --sweep``, CUDA graphs, q-layout gradients): Llama-3-8B shapes 0.0889 ms at 8192
tokens (out of place 0.0875, liger-kernel 0.0869) and 0.3464 at 32768 (0.3386, 0.3406), Qwen2-0.5B
0.0179 (0.0192, 0.0170); host time per call (``bench_host.py``) 108 us forward and 828 us forward
+ backward, against 126 / 958 out of place. ``with ROPE_PATCH.override(inplace=False)`` (or
``tuning(rope_patch={"inplace": False})``) gives the out-of-place rotation (read at every call) --
e.g. with a forward hook that keeps ``q_proj``'s or
``k_proj``'s output (activation capture): in place, the tensor it kept is rotated afterwards. The
model's outputs and gradients are the same either way (``tests/patching/test_inplace_rope_paths.py``:
eager and SDPA attention, gradient checkpointing, LoRA with dropout, KV-cache generation, an input
used twice).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from torch import nn

from liger_losses.kernels.rope import apply_rotary_pos_emb
from liger_losses.kernels.tuning import Knobs, knob, register


@dataclass(frozen=True)
class RoPEPatchConfig(Knobs):
    """The switches of the patched RoPE, read at every call (slot ``rope_patch``).

    ``inplace``: the in-place replacements rotate q and k in place (see the module docstring).
    ``inplace_backward``: with ``inplace``, rotate the incoming gradients in their buffers as well.
    ``repeated_tables``: read only the first half of each cos/sin row: the rotary embeddings of every
    family in ``specs.FAMILIES`` build their tables as ``cat(freqs, freqs)``
    (tests/patching/test_rope.py checks it for each family and rope type). H200
    (benchmark/experiments/diag_rope.py, in place with the gradients rotated in their buffers,
    q-layout gradients, 8192 tokens): Llama-3-8B shapes 0.0862 ms (reading both halves 0.0886;
    liger-kernel 0.0873), Qwen2-0.5B 0.0173 (0.0176; liger-kernel 0.0170), both with the constexpr
    head stride.
    """

    inplace: bool = knob(True)
    inplace_backward: bool = knob(True)
    repeated_tables: bool = knob(True)


ROPE_PATCH = register("rope_patch", RoPEPatchConfig())

# transformers model families whose attention passes q/k to apply_rotary_pos_emb as fresh views of
# the projection (or q_norm/k_norm) outputs used by nothing else (checked in transformers 5.x).
INPLACE_FAMILIES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2",
    # audited by tests/patching/test_inplace_rope_paths.py with LIGER_LOSSES_FULL_MATRIX=1 (every
    # configuration passes): llama's attention code (ministral, granite); q/k views of the q_norm /
    # k_norm outputs, per head (gemma3) or over the whole projection (olmo2, olmo3). Not yet: smollm3
    # and exaone4 (layers without RoPE break the audit's count of rotations), the MoE families (the
    # audit's generate test fails for them; not investigated), deepseek_v3 (q/k are split slices).
    "ministral", "granite", "gemma3", "olmo2", "olmo3",
})


def _rotate(q, k, cos, sin, unsqueeze_dim, inplace=False):
    config = ROPE_PATCH.current
    # The kernel rotates the first R = cos.shape[-1] features itself (partial rotary).
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, inplace=inplace,
                                inplace_backward=inplace and config.inplace_backward,
                                repeated_tables=config.repeated_tables)


def liger_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers 5.x signature: ``(q, k, cos, sin, unsqueeze_dim=1) -> (q_embed, k_embed)``."""
    return _rotate(q, k, cos, sin, unsqueeze_dim)


def liger_rotary_pos_emb_with_position_ids(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Older signature: ``position_ids`` is accepted and ignored (cos/sin are already gathered)."""
    return _rotate(q, k, cos, sin, unsqueeze_dim)


def liger_rotary_pos_emb_inplace(q, k, cos, sin, unsqueeze_dim=1):
    """As ``liger_rotary_pos_emb`` but rotating q and k in place while ``ROPE_PATCH.current.inplace``."""
    return _rotate(q, k, cos, sin, unsqueeze_dim, ROPE_PATCH.current.inplace)


def liger_rotary_pos_emb_with_position_ids_inplace(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Older signature, in place while ``ROPE_PATCH.current.inplace``."""
    return _rotate(q, k, cos, sin, unsqueeze_dim, ROPE_PATCH.current.inplace)


for _fn in (
    liger_rotary_pos_emb,
    liger_rotary_pos_emb_with_position_ids,
    liger_rotary_pos_emb_inplace,
    liger_rotary_pos_emb_with_position_ids_inplace,
):
    _fn._liger = True


def underlying_function(fn: Callable) -> Callable:
    """The plain function behind ``fn`` when ``fn`` wraps one, else ``fn``: ``functools.wraps``
    wrappers, and the hub-kernel wrapper of the ``kernels`` package. With that package installed
    (transformers >= 5.2x requires it), transformers' ``@use_kernel_forward_from_hub`` turns
    ``apply_rotary_pos_emb`` into an ``nn.Module`` instance whose ``forward(*args, **kwargs)`` calls
    the function it closes over (``func``); the attention still calls the module-level name, which
    is what the patch replaces. Used to read the original's signature and family, never to call it."""
    fn = inspect.unwrap(fn) if callable(fn) else fn
    forward = getattr(type(fn), "forward", None)
    code = getattr(forward, "__code__", None)
    if isinstance(fn, nn.Module) and code is not None and "func" in code.co_freevars and forward.__closure__:
        inner = forward.__closure__[code.co_freevars.index("func")].cell_contents
        if callable(inner) and not isinstance(inner, nn.Module):
            return inspect.unwrap(inner)
    return fn


def _family(original: Callable) -> str:
    """'llama' for transformers.models.llama.modeling_llama.apply_rotary_pos_emb, else ''."""
    module = getattr(original, "__module__", "") or ""
    prefix = "transformers.models."
    if module.startswith(prefix) and module.count(".") == 3:
        return module.split(".")[2]
    return ""


def make_rotary_replacement(original: Callable) -> Callable:
    """The replacement whose signature matches ``original``'s (seen through a wrapper:
    :func:`underlying_function`)."""
    original = underlying_function(original)
    try:
        params = inspect.signature(original).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins/odd wrappers
        params = {}
    inplace = _family(original) in INPLACE_FAMILIES
    if "position_ids" in params:
        return liger_rotary_pos_emb_with_position_ids_inplace if inplace else liger_rotary_pos_emb_with_position_ids
    return liger_rotary_pos_emb_inplace if inplace else liger_rotary_pos_emb
