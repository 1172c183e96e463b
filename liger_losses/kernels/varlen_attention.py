"""Causal attention over packed sequences of different lengths (variable-length, "varlen").

``varlen_causal_attention(query, key, value, cu_seqlens, max_seqlen, *, scale=None, dropout_p=0.0, window=None)``:
``query [N, Hq, D]``, ``key``/``value [N, Hkv, D]`` with ``Hq % Hkv == 0`` (grouped-query attention: query
head ``h`` reads key/value head ``h // (Hq // Hkv)``), the ``N`` tokens of ``S`` sequences laid end to end;
``cu_seqlens`` int32 ``[S + 1]``, the sequences' start offsets and ``N`` last (``cu_seqlens[s]`` to
``cu_seqlens[s + 1]`` is sequence ``s``; an empty one is allowed); ``max_seqlen``, an upper bound of their
lengths. Returns ``[N, Hq, D]`` in the query's dtype: every token attends causally to the earlier tokens of
its own sequence only, ``softmax(scale * q k^T) v`` (``scale`` defaults to ``D ** -0.5``); with ``window``
(a positive int) only the ``window`` latest of them, itself included (key ``j`` of query ``i`` when
``i - window < j <= i``: transformers' sliding window). Differentiable.

Why: a padded batch run this way attends without a mask, so the key/value heads are read as they are (the
masked form copies them out ``Hq / Hkv`` times for the memory-efficient kernel) and the padding is not
computed at all (``patching.pad_free`` packs a trainer's batch and routes the model's attention here).

Paths: on CUDA with fp16/bf16 operands, head size a multiple of 8 up to 256 and torch's flash attention
available, torch's flash-attention varlen kernel (``aten._flash_attention_forward``, whose autograd formula
is the varlen backward; grouped-query heads natively). Anywhere else, the reference: one
``scaled_dot_product_attention`` per sequence (exact, slow for many sequences, used by the CPU tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
           max_seqlen: int, window) -> None:
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(f"query, key and value must be [N, heads, D], got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    if key.shape != value.shape or key.shape[0] != query.shape[0] or key.shape[2] != query.shape[2]:
        raise ValueError(f"key and value must be [N, Hkv, D] with query's N and D, got query {tuple(query.shape)}, "
                         f"key {tuple(key.shape)}, value {tuple(value.shape)}")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"the query heads ({query.shape[1]}) must be a multiple of the key/value heads "
                         f"({key.shape[1]})")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32 [S + 1] with S >= 1, got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    if not isinstance(max_seqlen, int) or max_seqlen < 1:
        raise ValueError(f"max_seqlen must be a positive int, got {max_seqlen!r}")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"window must be None or a positive int, got {window!r}")


def flash_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether torch's flash varlen kernel serves operands of this device, dtype and head size (CUDA sm80+,
    fp16/bf16, a head size that is a multiple of 8 up to 256, flash attention built and enabled)."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 or head_dim > 256:
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    return bool(available()) and torch.backends.cuda.flash_sdp_enabled()


def flash_usable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :func:`varlen_causal_attention` takes torch's flash-attention kernel for these operands."""
    same = key.dtype == query.dtype and value.dtype == query.dtype
    return same and flash_supported(query.device, query.dtype, query.shape[-1])


def reference_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               cu_seqlens: torch.Tensor, *, scale=None, dropout_p: float = 0.0,
                               max_seqlen=None, window=None) -> torch.Tensor:
    """The reference path: one causal ``scaled_dot_product_attention`` per sequence (key/value heads repeated;
    a sequence longer than ``window`` with the window's mask); ``cu_seqlens`` read on the host once, checked (and
    against ``max_seqlen`` when given)."""
    group = query.shape[1] // key.shape[1]
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != query.shape[0] or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to N = {query.shape[0]}, got {bounds}")
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    if max_seqlen is not None and longest > max_seqlen:
        raise ValueError(f"max_seqlen ({max_seqlen}) is below the longest sequence ({longest})")
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
        if group > 1:
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        if window is not None and end - start > window:
            steps = torch.arange(end - start, device=q.device)
            back = steps[:, None] - steps[None, :]  # query index - key index
            mask = (back >= 0) & (back < window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs) if outputs else query.new_zeros(query.shape)


def varlen_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, *, scale=None, dropout_p: float = 0.0, window=None) -> torch.Tensor:
    """See the module docstring."""
    _check(query, key, value, cu_seqlens, max_seqlen, window)
    if window is not None and window >= max_seqlen:
        window = None  # no sequence is longer: plain causal attention
    if flash_usable(query, key, value):  # the kernel trusts cu_seqlens and max_seqlen: the caller's contract
        cu_seqlens = cu_seqlens.to(query.device)
        # positional: the schema's leading arguments are the same from torch 2.1 to 2.13; the window's keywords
        # (keys i - left .. i + right of query i) are in it since torch 2.5
        sides = {} if window is None else dict(window_size_left=window - 1, window_size_right=0)
        return torch.ops.aten._flash_attention_forward(
            query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, True, False,
            scale=scale, **sides)[0]
    return reference_varlen_attention(query, key, value, cu_seqlens, scale=scale, dropout_p=dropout_p,
                                      max_seqlen=max_seqlen, window=window)
