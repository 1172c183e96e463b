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

* ``"fused"`` (the GPU default): one persistent launch. Programs form groups of ``S`` (one per
  slice); group ``k`` walks rows ``k, k + n_groups, ...``. At each row the group's programs meet
  at a per-row counter (``atomic_add`` with release, spin with acquire) between publishing their
  slots and reading the row's; meanwhile the next row's slice is already loading (registers,
  double-buffered), so a row costs one meeting's latency, not a load's plus a meeting's. A program
  waits only for programs of its own group, so the grid is capped at the programs the device
  holds at once (read from the compiled kernel: registers, shared memory, warps), which makes the
  wait always end. The scratch and counters are new buffers per call (nothing is shared between
  streams or CUDA-graph replays).
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
from liger_losses.kernels.utils import device_ctx, import_triton, next_power_of_2, num_sms, triton_interpret

triton, tl = import_triton()

PHASES = ("fused", "two_pass")

if triton is not None:
    from liger_losses.kernels.logits_tile import _transform  # the shared elementwise transform

    @triton.jit
    def _slice_row(
        row, label, x_raw, split, cols, mask, G, stride_g, SCALE, scale_value, CW,
        LOSS, LSE, LOGP, ENT, CORRECT, LSUM, PART,
        V, logit_scale, inv_temp, softcap, eps, z_w, ignore_index,
        SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, SEG: tl.constexpr, NW: tl.constexpr,
        PHASE: tl.constexpr,
        MODE_CE: tl.constexpr, WRITE_GRAD: tl.constexpr, SCALE_PER_ROW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr, NEED_ENT: tl.constexpr,
        NEED_LSUM: tl.constexpr,
    ):
        """One slice of one row: partial slot (PHASE 0, 1), meeting (0), totals, statistics (slice
        0 only) and the slice's gradient (0, 2). ``x_raw``: the slice, already loaded."""
        valid = label != ignore_index
        safe = tl.where(valid, label, 0)
        k = tl.arange(0, NW)
        so = tl.arange(0, SPLITS_P2)
        smask = so < SPLITS
        if PHASE != 2:
            xf = x_raw.to(tl.float32)
            z, _t = _transform(xf, logit_scale, inv_temp, softcap, HAS_SOFTCAP)
            zm = tl.where(mask, z, float("-inf"))
            m = tl.max(zm, axis=0)  # every slice has a column (SPLITS = ceil(V / SEG))
            p = tl.exp(zm - m)
            # the label's logit from the registers of the slice that holds it (0 elsewhere): no
            # program reads a column another may already have overwritten in place
            stat = tl.where(k == 0, m, tl.where(k == 1, tl.sum(tl.where(cols == safe, xf, 0.0), axis=0), 0.0))
            if NEED_ENT:
                stat = tl.where(k == 2, tl.sum(p * tl.where(mask, z, 0.0), axis=0), stat)
            if NEED_LSUM:
                stat = tl.where(k == 3, tl.sum(tl.where(mask, z, 0.0), axis=0), stat)
            if HAS_CW:
                w = tl.load(CW + cols, mask=mask, other=0.0).to(tl.float32)
                stat = tl.where(k == 4, tl.sum(w * tl.where(mask, z, 0.0), axis=0), stat)
                stat = tl.where(k == 5, tl.sum(w, axis=0), stat)
            # word k = (sum exp) << 32 | stat k: the sum exp (>= 1, never 0 bits) flags the word as
            # written, so each word is valid on its own: relaxed atomics, no fence that would wait
            # for this program's earlier gradient stores
            d_bits = tl.sum(p, axis=0).to(tl.int32, bitcast=True).to(tl.int64) << 32
            words = d_bits | (stat.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
            if valid:  # ignored rows: every program of the row skips the slots alike
                tl.atomic_xchg(PART + (row * SPLITS + split) * NW + k, words, sem="relaxed")
        if PHASE != 1:
            ptrs = PART + (row * SPLITS + so[:, None]) * NW + k[None, :]
            wmask = smask[:, None] & (k[None, :] >= 0)
            got = tl.zeros([SPLITS_P2, NW], dtype=tl.int64)
            FLAG_ONLY: tl.constexpr = 1 << 32  # padding slots: flagged, stat 0
            if valid:
                # poll the row's slots until every word is flagged (at once in the two-pass phase)
                got = tl.load(ptrs, mask=wmask, other=FLAG_ONLY, volatile=True)
                while tl.min(tl.where((got >> 32) != 0, 1, 0)) == 0:
                    got = tl.load(ptrs, mask=wmask, other=FLAG_ONLY, volatile=True)
            lo = (got & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
            hi = (got >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            pm = tl.where(smask, tl.sum(tl.where(k[None, :] == 0, lo, 0.0), axis=1), float("-inf"))
            pd = tl.where(smask, tl.sum(tl.where(k[None, :] == 0, hi, 0.0), axis=1), 0.0)
            mx = tl.max(pm, axis=0)
            mx = tl.where(valid, mx, 0.0)
            r = tl.exp(pm - mx)
            d = tl.sum(pd * r, axis=0)
            d = tl.where(valid, d, 1.0)  # ignored rows: no NaN/inf on the way to zero outputs
            lse = tl.where(valid, mx + tl.log(d), 0.0)
            owner = safe // SEG
            x_y = tl.sum(tl.sum(tl.where((so[:, None] == owner) & (k[None, :] == 1), lo, 0.0), axis=1), axis=0)
            z_y, _ty = _transform(x_y, logit_scale, inv_temp, softcap, HAS_SOFTCAP)
            logp = z_y - lse
            s_tot = 0.0
            if NEED_LSUM:
                s_tot = tl.sum(tl.sum(tl.where(k[None, :] == 3, lo, 0.0), axis=1), axis=0)
            if HAS_CW:
                w_y = tl.load(CW + safe).to(tl.float32)
                sw_tot = tl.sum(tl.sum(tl.where(k[None, :] == 4, lo, 0.0), axis=1), axis=0)
                w_sum = tl.sum(tl.sum(tl.where(k[None, :] == 5, lo, 0.0), axis=1), axis=0)
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
                    pe = tl.sum(tl.where(k[None, :] == 2, lo, 0.0), axis=1)
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


    @triton.jit
    def _split_tile_kernel(
        X, stride_x, G, stride_g, LABELS, SCALE, scale_value, CW,
        LOSS, LSE, LOGP, ENT, CORRECT, LSUM, PART,
        V, n_rows, n_groups, ignore_index, logit_scale, inv_temp, softcap, eps, z_w,
        SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, SEG: tl.constexpr, NW: tl.constexpr,
        PHASE: tl.constexpr,
        MODE_CE: tl.constexpr, WRITE_GRAD: tl.constexpr, SCALE_PER_ROW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr, NEED_ENT: tl.constexpr,
        NEED_LSUM: tl.constexpr,
    ):
        # PHASE 0: fused and persistent (program = (group, slice); a group walks rows grp,
        # grp + n_groups, ...); 1: partial slots only; 2: combine + gradient (one row per program)
        pid = tl.program_id(0)
        split = pid % SPLITS
        cols = split * SEG + tl.arange(0, SEG)
        mask = cols < V
        if PHASE == 0:
            grp = pid // SPLITS
            row = grp.to(tl.int64)  # n_groups <= n_rows: every group has a first row
            label = tl.load(LABELS + row).to(tl.int64)
            x_raw = tl.load(X + row * stride_x + cols, mask=cols < tl.where(label != ignore_index, V, 0),
                            other=0.0)
            nxt = row + n_groups
            label_n = tl.load(LABELS + tl.minimum(nxt, n_rows - 1)).to(tl.int64)
            for _i in range(0, tl.cdiv(n_rows - grp, n_groups)):
                # prefetch the next row's slice (its label is known: ignored rows are not read)
                # and the label after it, so that their loads fly during this row's meeting
                v_next = tl.where((nxt < n_rows) & (label_n != ignore_index), V, 0)
                x_n = tl.load(X + nxt * stride_x + cols, mask=cols < v_next, other=0.0)
                nn = nxt + n_groups
                label_nn = tl.load(LABELS + tl.minimum(nn, n_rows - 1)).to(tl.int64)
                _slice_row(
                    row, label, x_raw, split, cols, mask, G, stride_g, SCALE, scale_value,
                    CW, LOSS, LSE, LOGP, ENT, CORRECT, LSUM, PART,
                    V, logit_scale, inv_temp, softcap, eps, z_w, ignore_index,
                    SPLITS, SPLITS_P2, SEG, NW, PHASE, MODE_CE, WRITE_GRAD, SCALE_PER_ROW, HAS_SOFTCAP, HAS_CW,
                    NEED_ENT, NEED_LSUM,
                )
                row = nxt
                nxt = nn
                label = label_n
                label_n = label_nn
                x_raw = x_n
        else:
            row = (pid // SPLITS).to(tl.int64)
            label = tl.load(LABELS + row).to(tl.int64)
            x_raw = tl.load(X + row * stride_x + cols, mask=cols < tl.where(label != ignore_index, V, 0),
                            other=0.0)
            _slice_row(
                row, label, x_raw, split, cols, mask, G, stride_g, SCALE, scale_value,
                CW, LOSS, LSE, LOGP, ENT, CORRECT, LSUM, PART,
                V, logit_scale, inv_temp, softcap, eps, z_w, ignore_index,
                SPLITS, SPLITS_P2, SEG, NW, PHASE, MODE_CE, WRITE_GRAD, SCALE_PER_ROW, HAS_SOFTCAP, HAS_CW,
                NEED_ENT, NEED_LSUM,
            )

    _split_tile_kernel = fast_kernel(_split_tile_kernel)


# Columns per slice (a power of two) and warps per program. Module constants for the benchmarks'
# sweeps (``benchmark/diag_ce_split.py``); SEG = 0 turns the split kernel off in ``logits_tile``.
SEG = 4096
WARPS = 4
# Fraction of the device's resident-program capacity the fused phase's persistent grid fills
# (1.0: every program the registers / shared memory allow; the benchmarks sweep it).
OCCUPANCY = 1.0
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
    nw = 8 if (need_ent or need_lsum or has_cw) else 2  # words per slot (see the kernel)
    part = torch.zeros((n * splits, nw), dtype=torch.int64, device=x.device)
    consts = dict(
        SPLITS=splits, SPLITS_P2=next_power_of_2(splits), SEG=seg, NW=nw,
        MODE_CE=mode_ce, WRITE_GRAD=grad, SCALE_PER_ROW=per_row, HAS_SOFTCAP=has_softcap,
        HAS_CW=has_cw, NEED_ENT=need_ent, NEED_LSUM=need_lsum, num_warps=warps,
    )

    def args(n_groups):
        return (
            x, x.stride(0), g, g.stride(0), lab, scale_ptr, scale_value, cw_arg,
            loss, lse, logp, ent, correct, lsum, part,
            V, n, n_groups, ignore_index, logit_scale, inv_temp, softcap, eps, z_w,
        )

    with device_ctx(x):
        if phase == "fused":
            n_groups = min(n, _resident_groups(args(1), consts, splits, x.device))
            _split_tile_kernel[(n_groups * splits,)](*args(n_groups), PHASE=0, **consts)
        else:
            _split_tile_kernel[(n * splits,)](*args(n), PHASE=1, **consts)
            _split_tile_kernel[(n * splits,)](*args(n), PHASE=2, **consts)


_RESIDENT: dict = {}


def _resident_groups(args: tuple, consts: dict, splits: int, device: torch.device) -> int:
    """Row groups (``splits`` programs each) the persistent fused grid may have: all of its
    programs must be resident at once (a program waits for the other slices of its row), so the
    grid is at most the device's capacity for this compiled kernel -- SMs times the programs per SM
    its registers, shared memory and warps allow -- times ``OCCUPANCY``. The compiled kernel's
    resources are read once per configuration (Triton's ``warmup``, as its persistent tutorials do).
    Under the interpreter: 3 (programs run one after another; a few rows per group)."""
    if triton_interpret():
        return 3
    key = (device.index, tuple(sorted(consts.items())), args[0].dtype, args[2].dtype, args[4].dtype)
    per_sm = _RESIDENT.get(key)
    if per_sm is None:
        kernel = _split_tile_kernel.jit_fn.warmup(*args, grid=(1,), PHASE=0, **consts)
        kernel._init_handles()
        props = torch.cuda.get_device_properties(device)
        warps = consts["num_warps"]
        regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
        smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
        threads_per_sm = getattr(props, "max_threads_per_multi_processor", 2048)
        regs_per_warp = -(-max(int(kernel.n_regs), 1) * 32 // 256) * 256  # allocated per warp in 256s
        smem = int(kernel.metadata.shared) + 1024  # plus the 1 KB the driver reserves per block
        per_sm = min(regs_per_sm // (regs_per_warp * warps), smem_per_sm // smem,
                     threads_per_sm // (32 * warps), 32)
        _RESIDENT[key] = per_sm
    capacity = int(num_sms(device) * per_sm * OCCUPANCY)
    return max(capacity // splits, 1)
