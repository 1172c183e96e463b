"""Tensor layouts for kernels that write through strides, and the carriers of in-place updates.

* :func:`dense_perm` / :func:`empty_like_layout`: whether ``(shape, stride)`` is a permutation of a
  contiguous layout (non-overlapping and dense), and an uninitialised tensor laid out like one.
* :func:`carrier_of` / :func:`rebuild`: for an in-place update of a view
  ``x`` that is a permuted reshape of the whole of its contiguous base (Hugging Face's
  ``proj(h).view(B, T, H, D).transpose(1, 2)``), the base to update instead (one in-place op on
  the base for autograd, not an in-place op on a view, which costs a base-sized copy), the view's
  geometry ``(shape, stride, offset)`` relative to it, and the view rebuilt from it.
* :func:`overlaps`: whether two elements of a tensor share memory.

Pure geometry on shapes and strides (cached per layout: called on every step); no data is read.
"""

from __future__ import annotations

import functools

import torch


def dense_perm(shape, stride):
    """Dims ordered by decreasing stride when (shape, stride) is a permutation of a contiguous
    layout (non-overlapping and dense), else None (cached per layout: called on every step)."""
    return dense_perm_cached(tuple(shape), tuple(stride))


@functools.lru_cache(maxsize=1024)
def dense_perm_cached(shape, stride):
    perm = sorted(range(len(shape)), key=lambda i: (-stride[i], -shape[i]))
    expected = 1
    for i in reversed(perm):
        if shape[i] != 1 and stride[i] != expected:
            return None
        expected *= shape[i]
    return tuple(perm)


def empty_like_layout(shape, stride, like: torch.Tensor) -> torch.Tensor:
    """Uninitialised tensor of ``shape`` with ``stride`` when that layout is dense with a unit last
    stride (the kernel writes the head dim contiguously), else contiguous."""
    if stride[-1] == 1 and dense_perm(shape, stride) is not None:
        return torch.empty_strided(shape, stride, dtype=like.dtype, device=like.device)
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def carrier_of(x: torch.Tensor):
    """(carrier, geometry) for an in-place rotation of ``x``. When ``x`` is a permuted reshape of
    the whole of its contiguous ``_base`` (HF's ``proj(h).view(B, T, H, D).transpose(1, 2)``),
    the carrier is that base, so autograd records one in-place op on the base instead of an
    in-place op on a view (which costs a base-sized copy and a clone in backward); else ``x``.
    geometry = (shape, stride, offset) of ``x`` relative to the carrier's storage offset."""
    base = x._base
    if (
        base is not None
        and base.numel() == x.numel()
        and base.storage_offset() == x.storage_offset()
        and base.is_contiguous()
        and (base.requires_grad or not x.requires_grad)  # a view made inside a Function has an untracked base
        and dense_perm(x.shape, x.stride()) is not None
    ):
        return base, (tuple(x.shape), tuple(x.stride()), 0)
    return x, None


def rebuild(carrier: torch.Tensor, geom) -> torch.Tensor:
    """The view of ``carrier`` with ``geom``'s shape and strides, made by view + permute (cheap
    backward: a reshape and a permute, no zero-filled as_strided buffer)."""
    view_shape, inverse = rebuild_plan(*geom[:2])
    return carrier.view(view_shape).permute(inverse)


@functools.lru_cache(maxsize=1024)
def rebuild_plan(shape, stride):
    """(the permuted dense shape, the permutation back to ``shape``) of a dense layout."""
    perm = dense_perm(shape, stride)
    return tuple(shape[i] for i in perm), tuple(perm.index(i) for i in range(len(shape)))


def overlaps(x: torch.Tensor) -> bool:
    """True when two elements of ``x`` share memory (expanded / zero-stride layouts)."""
    return overlaps_cached(x.shape, x.stride())


@functools.lru_cache(maxsize=1024)
def overlaps_cached(shape, stride) -> bool:
    if any(st == 0 and sz > 1 for sz, st in zip(shape, stride)):
        return True
    # torch's own test (a function of sizes and strides only) on a meta tensor of this layout
    return torch._debug_has_internal_overlap(torch.empty_strided(shape, stride, device="meta")) == 1
