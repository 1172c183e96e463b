"""Input checks of :func:`liger_losses.kernels.rope.apply_rotary_pos_emb`: q/k/cos/sin shapes, dtypes
and devices (and a 2-D table's ``position_ids``, gathered here), and the in-place flags.

``check_inputs(q, k, cos, sin, position_ids, unsqueeze_dim) -> (cos, sin, head_axis)``: q and k
``[B, H, T, D]`` (``unsqueeze_dim=1``) or ``[B, T, H, D]`` (2), one dtype; cos/sin ``[B or 1, T, R]``
(or a 2-D ``[S, R]`` table with ``position_ids [B or 1, T]``), R even in ``[2, D]``. ``ValueError`` /
``TypeError`` naming the argument otherwise.
"""

from __future__ import annotations

import torch

from liger_losses.kernels.utils import check_same_device, check_tensor


def check_inputs(q, k, cos, sin, position_ids, unsqueeze_dim):
    check_tensor("q", q, ndim=4, floating=True)
    check_tensor("k", k, ndim=4, floating=True)
    if k.dtype != q.dtype:
        raise TypeError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    if isinstance(unsqueeze_dim, bool) or unsqueeze_dim not in (1, 2, -3, -2):
        raise ValueError(
            f"unsqueeze_dim must be 1 (q/k [B, H, T, D]) or 2 (q/k [B, T, H, D]), got {unsqueeze_dim!r}"
        )
    head_axis = 1 if unsqueeze_dim in (1, -3) else 2
    layout = "[B, H, T, D]" if head_axis == 1 else "[B, T, H, D]"
    bsz, d = q.shape[0], q.shape[-1]
    seq = q.shape[3 - head_axis]
    want_k = list(q.shape)
    want_k[head_axis] = "Hk"
    if k.shape[0] != bsz or k.shape[3 - head_axis] != seq or k.shape[-1] != d:
        raise ValueError(
            f"k must have shape {layout} = {tuple(want_k)} matching q {tuple(q.shape)}, got {tuple(k.shape)}"
        )
    if d % 2:
        raise ValueError(f"q's head_dim (last dimension) must be even, got shape {tuple(q.shape)}")
    check_tensor("cos", cos, ndim=(2, 3), floating=True)
    check_tensor("sin", sin, ndim=(2, 3), floating=True)
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    check_same_device(q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)
    if cos.dim() == 2:
        if position_ids is None:
            raise ValueError(
                f"cos must have shape [B or 1, T, R] (got {tuple(cos.shape)}); a 2-D table [S, R] "
                "needs position_ids [B or 1, T]"
            )
        check_tensor("position_ids", position_ids, ndim=(1, 2), floating=False)
        if position_ids.shape[-1] != seq or (position_ids.dim() == 2 and position_ids.shape[0] not in (1, bsz)):
            raise ValueError(
                f"position_ids must have shape [{bsz} or 1, {seq}], got {tuple(position_ids.shape)}"
            )
        lo, hi = torch.stack([position_ids.min(), position_ids.max()]).tolist() if position_ids.numel() else (0, -1)
        if lo < 0 or hi >= cos.shape[0]:
            raise ValueError(f"position_ids must be in [0, {cos.shape[0]}) (rows of the cos table)")
        pid2 = position_ids if position_ids.dim() == 2 else position_ids[None]
        cos, sin = cos[pid2], sin[pid2]
    rot = cos.shape[-1]
    if cos.shape[0] not in (1, bsz) or cos.shape[1] != seq:
        raise ValueError(
            f"cos and sin must have shape [{bsz} or 1, {seq}, R] (q is {layout} {tuple(q.shape)}), "
            f"got {tuple(cos.shape)}"
        )
    if rot % 2 or rot == 0 or rot > d:
        raise ValueError(
            f"cos's last dimension (rotary dim R) must be even and in [2, head_dim={d}], got {rot}"
        )
    return cos, sin, head_axis


def check_flags(inplace, inplace_backward, repeated_tables) -> None:
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {inplace!r}")
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward must be a bool, got {inplace_backward!r}")
    if inplace_backward and not inplace:
        raise ValueError("inplace_backward=True needs inplace=True")
    if not isinstance(repeated_tables, bool):
        raise TypeError(f"repeated_tables must be a bool, got {repeated_tables!r}")
