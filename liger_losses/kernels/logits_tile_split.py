"""The logits tile of :mod:`kernels.logits_tile` with each row split over several programs that
read their slice once (layer 1).

Same inputs, outputs and semantics as :func:`kernels.logits_tile.logits_tile` (``x [n, V]`` bf16 /
fp16 / fp32 logits, ``labels [n]``; per-row float32 statistics ``[n]``; the gradient written in
the tile's dtype, in place or into ``out``). What differs is the memory traffic: the one-program-
per-row kernel reads every logit twice (pass 1: max and sum-exp; pass 2: the gradient), so it moves
three row-sized streams per row. Here row ``r`` is cut into ``S = ceil(V / seg)`` slices of ``seg``
columns, one program per slice. A program loads its slice into registers once, reduces it to
partial statistics ``(max m_i, sum exp(z - m_i), sum p z, sum z, sum w z, sum w)`` -- six fp32
numbers in a slot of a ``[n * S, 8]`` scratch buffer -- and, once every slice of the row has
published its slot, combines the ``S`` slots into the row's ``lse`` (and the other sums) and writes
the gradient of its slice from the registers: one read and one write per logit.

Phases (``phase``):

* ``"fused"`` (the GPU default): one launch; the programs of a row meet at a per-row counter
  (``atomic_add`` with release, spin with acquire). Programs take their (row, slice) from a ticket
  counter in the order they start, so a waiting program only ever waits for programs that already
  run or start next: with at least ``S`` programs resident on the device (checked on the host) the
  wait always ends, whatever order the hardware starts programs in. The scratch and counters are
  new zeroed buffers per call (no state shared between streams or graph replays).
* ``"two_pass"``: two launches, partial slots first, then combine + gradient (re-reading the
  slice). Same arithmetic with no inter-program waiting: what the Triton interpreter runs (it runs
  programs one after another, so a waiting program would wait forever), and the tests' way to hold
  the combine step with several slices to the reference on the CPU.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from liger_losses.kernels.launch import fast_kernel
from liger_losses.kernels.utils import device_ctx, import_triton, next_power_of_2, num_sms

triton, tl = import_triton()

PHASES = ("fused", "two_pass")
N_SLOT = 8  # fp32 per slot: m, sum exp, sum p z, sum z, sum w z, sum w (and 2 spare)

if triton is not None:
    from liger_losses.kernels.logits_tile import _transform  # the shared elementwise transform

    @triton.jit
    def _split_tile_kernel(
        X, stride_x, G, stride_g, LABELS, SCALE, scale_value, CW,
        LOSS, LSE, LOGP, ENT, CORRECT, LSUM, PART, SYNC,
        V, ignore_index, logit_scale, inv_temp, softcap, eps, z_w,
        SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, SEG: tl.constexpr, PHASE: tl.constexpr,
        MODE_CE: tl.constexpr, WRITE_GRAD: tl.constexpr, SCALE_PER_ROW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr, NEED_ENT: tl.constexpr,
        NEED_LSUM: tl.constexpr, TICKET: tl.constexpr, READ_IGNORED: tl.constexpr,
    ):
        # PHASE 0: fused (one launch, per-row meeting); 1: partial slots only; 2: combine + gradient
        if PHASE == 0 and TICKET:
            # a ticket in start order (see the module docstring): programs of one row start together
            t = tl.atomic_add(SYNC, 1, sem="relaxed")
        else:
            t = tl.program_id(0)
        row = (t // SPLITS).to(tl.int64)
        split = t % SPLITS
        x_ptr = X + row * stride_x
        label = tl.load(LABELS + row).to(tl.int64)
        valid = label != ignore_index
        safe = tl.where(valid, label, 0)
        cols = split * SEG + tl.arange(0, SEG)
        mask = cols < V
        # the slice stays in registers in its own dtype. READ_IGNORED: the load does not wait for
        # the label (ignored rows are read, their values masked out below); else they are skipped
        if READ_IGNORED:
            x_raw = tl.load(x_ptr + cols, mask=mask, other=0.0)
        else:
            x_raw = tl.load(x_ptr + cols, mask=cols < tl.where(valid, V, 0), other=0.0)
        slot = PART + (row * SPLITS + split) * 8
        if PHASE != 2:
            # the label's logit is read before any program of the row may overwrite it in place
            x_y = tl.load(x_ptr + safe).to(tl.float32)
            z, _t = _transform(x_raw.to(tl.float32), logit_scale, inv_temp, softcap, HAS_SOFTCAP)
            zm = tl.where(mask, z, float("-inf"))
            m = tl.max(zm, axis=0)  # every slice has a column (SPLITS = ceil(V / SEG))
            p = tl.exp(zm - m)
            part = tl.zeros([8], dtype=tl.float32)
            k = tl.arange(0, 8)
            part = tl.where(k == 0, m, part)
            part = tl.where(k == 1, tl.sum(p, axis=0), part)
            if NEED_ENT:
                part = tl.where(k == 2, tl.sum(p * tl.where(mask, z, 0.0), axis=0), part)
            if NEED_LSUM:
                part = tl.where(k == 3, tl.sum(tl.where(mask, z, 0.0), axis=0), part)
            if HAS_CW:
                w = tl.load(CW + cols, mask=mask, other=0.0).to(tl.float32)
                part = tl.where(k == 4, tl.sum(w * tl.where(mask, z, 0.0), axis=0), part)
                part = tl.where(k == 5, tl.sum(w, axis=0), part)
            part = tl.where(k == 6, x_y, part)  # for the two-pass phase (its programs run apart)
            tl.store(slot + k, part)
            if PHASE == 0:
                if valid:  # every program of an ignored row skips the meeting alike
                    tl.debug_barrier()  # all threads' slot stores precede the release below
                    tl.atomic_add(SYNC + 1 + row, 1, sem="release")
                    seen = tl.atomic_add(SYNC + 1 + row, 0, sem="acquire")
                    while seen < SPLITS:
                        seen = tl.atomic_add(SYNC + 1 + row, 0, sem="acquire")
        if PHASE != 1:
            so = tl.arange(0, SPLITS_P2)
            smask = so < SPLITS
            base = PART + (row * SPLITS + so) * 8
            # .cg: read the slots from L2 (other SMs wrote them), never a stale L1 line
            pm = tl.load(base + 0, mask=smask, other=float("-inf"), cache_modifier=".cg")
            pd = tl.load(base + 1, mask=smask, other=0.0, cache_modifier=".cg")
            mx = tl.max(pm, axis=0)
            mx = tl.where(valid, mx, 0.0)
            r = tl.exp(pm - mx)
            d = tl.sum(pd * r, axis=0)
            d = tl.where(valid, d, 1.0)  # ignored rows: no NaN/inf on the way to zero outputs
            lse = tl.where(valid, mx + tl.log(d), 0.0)
            if PHASE == 2:
                x_y = tl.load(PART + row * SPLITS * 8 + 6, cache_modifier=".cg")
            z_y, _ty = _transform(x_y, logit_scale, inv_temp, softcap, HAS_SOFTCAP)
            logp = z_y - lse
            s_tot = 0.0
            if NEED_LSUM:
                s_tot = tl.sum(tl.load(base + 3, mask=smask, other=0.0, cache_modifier=".cg"), axis=0)
            if HAS_CW:
                w_y = tl.load(CW + safe).to(tl.float32)
                sw_tot = tl.sum(tl.load(base + 4, mask=smask, other=0.0, cache_modifier=".cg"), axis=0)
                w_sum = tl.sum(tl.load(base + 5, mask=smask, other=0.0, cache_modifier=".cg"), axis=0)
            else:
                w_y = 1.0
                w_sum = V * 1.0
                sw_tot = s_tot
            if split == 0:
                if MODE_CE:
                    loss = (1.0 - eps) * w_y * (-logp) + eps / V * (w_sum * lse - sw_tot) + z_w * lse * lse
                else:
                    loss = logp
                tl.store(LOSS + row, tl.where(valid, loss, 0.0))
                tl.store(LSE + row, tl.where(valid, lse, 0.0))
                tl.store(LOGP + row, tl.where(valid, logp, 0.0))
                tl.store(CORRECT + row, tl.where(valid & (z_y >= mx), 1, 0).to(tl.int8))
                tl.store(LSUM + row, tl.where(valid, s_tot, 0.0))
                if NEED_ENT:
                    pe = tl.load(base + 2, mask=smask, other=0.0, cache_modifier=".cg")
                    e_tot = tl.sum(pe * r, axis=0)
                    tl.store(ENT + row, tl.where(valid, lse - e_tot / d, 0.0))
            if WRITE_GRAD:
                if SCALE_PER_ROW:
                    scale = tl.load(SCALE + row).to(tl.float32)
                else:
                    scale = scale_value
                zc = 2.0 * z_w * lse
                coef = tl.where(valid, inv_temp * logit_scale * scale, 0.0)
                z, t2 = _transform(x_raw.to(tl.float32), logit_scale, inv_temp, softcap, HAS_SOFTCAP)
                p = tl.exp(tl.minimum(z - lse, 0.0))
                if HAS_CW and MODE_CE:
                    w = tl.load(CW + cols, mask=mask, other=0.0).to(tl.float32)
                    g = ((1.0 - eps) * w_y * p + eps / V * (w_sum * p - w) + zc * p) * coef
                    g = tl.where(cols == safe, g - (1.0 - eps) * coef * w_y, g)
                elif MODE_CE:
                    g = p * ((1.0 + zc) * coef) - eps / V * coef
                    g = tl.where(cols == safe, g - (1.0 - eps) * coef, g)
                else:  # d logp / dz = onehot - p
                    g = tl.where(cols == safe, coef - p * coef, -p * coef)
                if HAS_SOFTCAP:
                    g = g * (1.0 - t2 * t2)
                g = tl.where(valid, g, 0.0)
                g_ptr = G + row * stride_g
                tl.store(g_ptr + cols, g.to(G.dtype.element_ty), mask=mask)

    _split_tile_kernel = fast_kernel(_split_tile_kernel)


# Columns per slice (a power of two) and warps per program. Module constants for the benchmarks'
# sweeps (``benchmark/diag_ce_split.py``); SEG = 0 turns the split kernel off in ``logits_tile``.
SEG = 4096
WARPS = 4
# TICKET: (row, slice) from a ticket counter in start order (False: from the program id, which
# relies on the hardware starting programs in id order -- a diagnostic only). READ_IGNORED: load the
# slice without waiting for the label (ignored rows are read and masked out).
TICKET = True
READ_IGNORED = False
# The split kernel is used from this many slices up (fewer: the one-program-per-row kernel, whose
# second read of a short row is an L1/L2 hit anyway).
MIN_SPLITS = 2


def split_settings(V: int, seg: Optional[int] = None) -> tuple[int, int]:
    """``(seg, splits)`` for a row of ``V`` columns: the slice width and ``ceil(V / seg)``."""
    seg = next_power_of_2(int(seg or SEG))
    return seg, -(-V // seg)


# None: "fused" on a GPU, "two_pass" under the Triton interpreter (tests set it to hold both).
PHASE: Optional[str] = None


def split_phase(V: int, device: torch.device) -> Optional[str]:
    """The phase :func:`logits_tile` should run the split kernel in for ``V`` columns on
    ``device``, or None for the one-program-per-row kernel: splitting on (``SEG > 0``), at least
    ``MIN_SPLITS`` slices and, on a GPU, at most one slice per SM (the fused meeting needs a whole
    row's programs resident at once). Called only where Triton runs (GPU or interpreter)."""
    if SEG <= 0:
        return None
    _, splits = split_settings(V)
    if splits < MIN_SPLITS:
        return None
    if device.type == "cuda":
        if splits > num_sms(device):
            return None
        return PHASE or "fused"
    return PHASE or "two_pass"


def split_logits_tile(
    x: Tensor, lab: Tensor, *, g: Tensor, scale_ptr: Tensor, scale_value: float, cw_arg: Tensor,
    loss: Tensor, lse: Tensor, logp: Tensor, ent: Tensor, correct: Tensor, lsum: Tensor,
    ignore_index: int, logit_scale: float, inv_temp: float, softcap: float, eps: float, z_w: float,
    mode_ce: bool, grad: bool, per_row: bool, has_softcap: bool, has_cw: bool, need_ent: bool,
    need_lsum: bool, phase: str = "fused", seg: Optional[int] = None, warps: Optional[int] = None,
) -> None:
    """Launch the split kernel on prepared arguments (those :func:`logits_tile` builds: output
    buffers ``[n]`` filled here, ``g`` the gradient destination). ``phase`` and ``seg`` / ``warps``
    (default: the module's ``SEG`` / ``WARPS``) as in the module docstring."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    n, V = x.shape
    seg, splits = split_settings(V, seg)
    warps = int(warps or WARPS)
    part = torch.empty((n * splits, N_SLOT), dtype=torch.float32, device=x.device)
    sync = torch.zeros(n + 1 if phase == "fused" else 1, dtype=torch.int32, device=x.device)
    common = (
        x, x.stride(0), g, g.stride(0), lab, scale_ptr, scale_value, cw_arg,
        loss, lse, logp, ent, correct, lsum, part, sync,
        V, ignore_index, logit_scale, inv_temp, softcap, eps, z_w,
    )
    consts = dict(
        SPLITS=splits, SPLITS_P2=next_power_of_2(splits), SEG=seg,
        MODE_CE=mode_ce, WRITE_GRAD=grad, SCALE_PER_ROW=per_row, HAS_SOFTCAP=has_softcap,
        HAS_CW=has_cw, NEED_ENT=need_ent, NEED_LSUM=need_lsum, TICKET=TICKET,
        READ_IGNORED=READ_IGNORED, num_warps=warps,
    )
    with device_ctx(x):
        if phase == "fused":
            _split_tile_kernel[(n * splits,)](*common, PHASE=0, **consts)
        else:
            _split_tile_kernel[(n * splits,)](*common, PHASE=1, **consts)
            _split_tile_kernel[(n * splits,)](*common, PHASE=2, **consts)
