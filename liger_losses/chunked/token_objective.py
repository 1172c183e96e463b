"""The per-token objective driver: losses that are sums of functions of each token's log-prob and entropy.

:func:`fused_linear_token_objective` scores ``hidden [B, T, H]`` against ``labels [B, T]`` through
``weight [V, H]`` (+ ``bias [V]``) chunk by chunk on the engine's primitives and hands each chunk's
per-token statistics (:class:`TokenChunk`: ``[n]`` log-probs, entropies, reference log-probs in
float32 -- float64 when the head computes in float64, so a float64 run stays float64 end to end --
and positions) to a small PyTorch ``objective(chunk) -> (loss, metric_sums)``. ``loss`` is
the chunk's 0-d contribution to the total (the objective applies its own normalisation, known
before any GEMM), ``metric_sums`` are additive (0-d or ``[B]`` tensors summed over chunks).
Autograd on the ``[n]`` tensors gives ``d loss / d logp`` and ``d loss / d entropy`` per token, and
the tile gradient is written while the tile exists (GRPO and its variants are one such function).

An objective is a :class:`TokenObjective` and declares its ``coupling``: what it needs to see at
once (a plain callable is wrapped by :func:`as_token_objective` with the caller's coupling):

* ``"token"``: each token's loss depends only on its own statistics: one pass over chunks of any
  size (6·N·H·V FLOPs for the policy);
* ``"sequence"``: a token's loss depends on sums over its sequence (GSPO's sequence ratio, the
  off-policy mask): one pass over chunks of whole sequences when every sequence fits the tile
  budget (a sequence longer than one tile budget may take up to ``EngineConfig.unit_budget_factor``
  default budgets, the sequence driver's rule for a preference unit), else two phases;
* ``"batch"``: it depends on a statistic of the whole batch (an entropy quantile): two phases.

Two phases: a first pass takes every token's statistics (no gradient), the objective runs once on
all tokens, and a second pass recomputes each tile and writes its gradient from the saved row
statistics (:func:`~liger_losses.kernels.logp_entropy_grad.logp_entropy_grad_`): 8·N·H·V FLOPs.

Metrics once (:attr:`TokenObjective.metrics_once`): in one pass, an objective that declares it is
called per chunk with ``chunk.metrics=False`` for its gradient alone, and once more on every token,
without grad, for the loss value and the metric sums. Its per-chunk calls then skip the metric
ops, which on a GPU step are host time (each op a launch): the GRPO objective's per-chunk call
has about a third of the ops then (see ``benchmark/NOTES.md``). The sums are the same sums, added
in another order.

The gradient of a chunk: without an entropy gradient the log-prob kernel writes ``d logp / d logits``
in place and ``d loss / d logp`` is the row scale of the gradient GEMMs; with ``entropy_grad`` the
statistics are taken first and :func:`logp_entropy_grad_` writes the combined gradient. Gradients
are computed inside the forward and scaled by ``grad_output`` in backward; one host sync per call.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from liger_losses.chunked.autograd import needs_head_grads, save_forward_grads, scaled_grads
from liger_losses.chunked.config import get_engine_config
from liger_losses.chunked.gemm import HeadGrads, compute_dtype, itemsize, project, weight_accum
from liger_losses.chunked.options import HeadOptions, check_head_inputs
from liger_losses.chunked.planning import group_chunk_bounds, tile_budget, token_chunks
from liger_losses.chunked.tokens import grad_like, hidden_rows_at, scan_labels, valid_index
from liger_losses.chunked.weights import head_in_dtype
from liger_losses.kernels.logits_tile import logits_tile, torch_stats_dtype
from liger_losses.kernels.logp_entropy_grad import logp_entropy_grad_
from liger_losses.kernels.utils import check_choice, check_same_device, check_tensor

# From the loosest to the tightest: running an objective with a tighter coupling than it declares
# gives the same loss (it only sees more tokens at once).
COUPLINGS = ("token", "sequence", "batch")


@dataclass
class TokenChunk:
    """The tokens of one chunk (or of the whole batch in two phases), in batch order."""

    logps: Tensor  # [n] stats dtype (float32; float64 heads: float64) log p(label); a leaf when grads are wanted
    entropy: Optional[Tensor]  # [n] softmax entropy (need_entropy); a leaf when entropy_grad
    ref_logps: Optional[Tensor]  # [n] reference log-probs (from ref_hidden), else None
    index: Tensor  # [n] long: flat positions in labels' [B * T] layout
    seq: Tensor  # [n] long: the sequence of each token (index // T)
    # False: the driver takes only the loss share's gradient from this call (metrics_once), and the
    # objective may return no metric sums
    metrics: bool = True


class TokenObjective(abc.ABC):
    """Base of the per-token objectives: ``__call__(chunk) -> (loss, metric_sums)`` (module
    docstring) and the declared ``coupling`` (class attribute or set per instance; one of
    :data:`COUPLINGS`), which picks the driver's path. ``metrics_once = True`` lets the one-pass
    driver take only the gradient from the per-chunk calls (``chunk.metrics`` False: the objective
    may skip its metric ops) and the loss value and metrics from one no-grad call on every token."""

    coupling: str = "token"
    # True: in one pass, per-chunk calls get chunk.metrics=False (their loss share is only
    # differentiated); one more call on every token, under no grad, gives the loss and the metrics
    metrics_once: bool = False

    @abc.abstractmethod
    def __call__(self, chunk: TokenChunk) -> tuple[Tensor, dict]:
        """``(0-d loss share, {name: additive 0-d or [B] sum})`` of the chunk's tokens."""


class FunctionTokenObjective(TokenObjective):
    """A plain ``fn(chunk) -> (loss, metric_sums)`` as a :class:`TokenObjective` of ``coupling``."""

    def __init__(self, fn: Callable[[TokenChunk], tuple[Tensor, dict]], *, coupling: str = "token"):
        check_choice("coupling", coupling, COUPLINGS)
        self.fn, self.coupling = fn, coupling

    def __call__(self, chunk: TokenChunk) -> tuple[Tensor, dict]:
        return self.fn(chunk)


def as_token_objective(objective, *, coupling: Optional[str] = None) -> TokenObjective:
    """``objective`` as a :class:`TokenObjective`: an instance runs with its declared coupling, or
    with ``coupling`` when that is tighter (a looser one than declared raises ``ValueError``: the
    loss would be wrong); a plain callable is wrapped with ``coupling`` (default ``"token"``)."""
    if coupling is not None:
        check_choice("coupling", coupling, COUPLINGS)
    if isinstance(objective, TokenObjective):
        declared = objective.coupling
        check_choice(f"{type(objective).__name__}.coupling", declared, COUPLINGS)
        if coupling is None or coupling == declared:
            return objective
        if COUPLINGS.index(coupling) < COUPLINGS.index(declared):
            raise ValueError(f"coupling={coupling!r} is looser than the objective's declared {declared!r}")
        return FunctionTokenObjective(objective, coupling=coupling)
    if not callable(objective):
        raise TypeError(f"objective must be callable, got {type(objective).__name__}")
    return FunctionTokenObjective(objective, coupling=coupling or "token")


class TokenStats(NamedTuple):
    """Detached per-token statistics of the whole batch, ``[N]`` over the valid tokens in batch order."""

    logps: Tensor
    entropy: Optional[Tensor]
    ref_logps: Optional[Tensor]
    index: Tensor
    correct: Tensor  # [N] bool: the label is the first maximal logit (the tile kernel's argmax rule)


@dataclass(frozen=True)
class _Run:
    """What one call hands its autograd Function (validated by the public function)."""

    labels: Tensor
    objective: TokenObjective
    head: HeadOptions
    ref_hidden: Optional[Tensor]
    ref_weight: Optional[Tensor]
    ref_bias: Optional[Tensor]
    entropy_grad: bool
    grad_enabled: bool

    @property
    def coupling(self) -> str:
        return self.objective.coupling

    @property
    def need_entropy(self) -> bool:
        return self.head.need_entropy or self.entropy_grad

    @property
    def chunk_tokens(self) -> Optional[int]:
        return self.head.chunk_tokens


class _TokenObjectiveFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, hidden, bias, run, sink):
        needs_w, needs_h, needs_b = needs_head_grads(ctx, run.grad_enabled)
        driver = TokenDriver(weight, hidden, bias, run, needs_h, needs_w, needs_b and bias is not None)
        loss, gh, gw, gb = driver.execute()
        sink["metrics"], sink["stats"] = driver.metric_sums, driver.stats()
        save_forward_grads(ctx, weight, gh, gw, gb, needs_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        gh, gw, gb = scaled_grads(ctx, grad_loss)
        return gw, gh, gb, None, None


class TokenDriver:
    """One call's chunk loop: statistics, objective calls and tile gradients (see the module
    docstring): :meth:`plan` picks the path, :meth:`one_pass` / :meth:`two_phases` run it."""

    def __init__(self, weight, hidden, bias, run: _Run, needs_h, needs_w, needs_b):
        self.run, self.hidden = run, hidden
        B, T, H = hidden.shape
        self.dev = hidden.device
        self.cdt = compute_dtype(weight)
        self.sdt = torch_stats_dtype(self.cdt)  # the objective's dtype: float64 only for a float64 head
        w_full, self.w = head_in_dtype(weight, self.cdt)
        self.b = bias
        self.V = V = self.w.shape[0]
        self.kernel_opts = run.head.tile_options()
        ignore_index = run.head.ignore_index
        self.scan = scan_labels(run.labels, ignore_index, V, row_counts=True)  # the host sync
        self.labels, index = valid_index(run.labels, ignore_index, scan=self.scan)
        self.index, self.seq, self.N = index, index // T, index.numel()
        self.rows = hidden_rows_at(hidden, index)
        self.ref_rows = None
        if run.ref_hidden is not None:
            self.ref_rows = self.rows.like(run.ref_hidden.reshape(-1, run.ref_hidden.shape[-1]))
            self.ref_w = self.w if run.ref_weight is None else head_in_dtype(run.ref_weight, self.cdt)[1]
            self.ref_b = run.ref_bias if (run.ref_bias is not None or run.ref_weight is not None) else bias
        self.need_grad = needs_h or needs_w or needs_b
        self.grads = HeadGrads(self.rows, V, H, dtype=self.cdt, accum=weight_accum(run.head.accum_dtype, w_full.dtype),
                               device=self.dev, hidden=needs_h, weight=needs_w, bias=needs_b)
        self.H, self.itemsize = H, itemsize(self.cdt)
        self.budget = tile_budget(V, H, self.itemsize, wide_accum=self.grads.wide_accum)
        self.metric_sums: dict = {}
        self.parts: dict = {"logps": [], "entropy": [], "ref_logps": [], "correct": []}

    # ------------------------------------------------------------------ planning
    def plan(self) -> Optional[list[tuple[int, int]]]:
        """Chunks of the one-pass path, or None for two phases."""
        run, V = self.run, self.V
        if run.coupling == "token":
            return self.token_bounds()
        if run.coupling == "batch":
            return None
        counts = self.scan.row_counts_host
        plan = group_chunk_bounds(counts, V, chunk_tokens=run.chunk_tokens, budget_bytes=self.budget,
                                  itemsize=self.itemsize)
        if plan is None and run.chunk_tokens is None:
            # a sequence larger than one tile budget: up to unit_budget_factor default budgets
            # (the sequence driver's rule for a preference unit) before two phases
            cfg = get_engine_config()
            budget = max(cfg.unit_budget_factor * cfg.default_budget_bytes, self.budget)
            plan = group_chunk_bounds(counts, V, budget_bytes=budget, itemsize=self.itemsize)
        return None if plan is None else [(ts, te) for _, _, ts, te in plan if te > ts]

    def token_bounds(self) -> list[tuple[int, int]]:
        """Chunks of the valid tokens from the tile budget (sequences may be split)."""
        return token_chunks(self.V, self.H, self.itemsize, self.N, self.run.chunk_tokens,
                            wide_accum=self.grads.wide_accum)

    # ------------------------------------------------------------------ pieces
    def ref_logps(self, ts: int, te: int) -> Optional[Tensor]:
        if self.ref_rows is None:
            return None
        tile = project(self.ref_rows(ts, te), self.ref_w, self.ref_b)
        st = logits_tile(tile, self.labels[ts:te], mode="logp", grad=False, need_logits_sum=False,
                         **self.kernel_opts)
        return st.logp

    def call_objective(self, ts, te, logps, entropy, ref, want_grad, metrics=True):
        """``(d loss / d logp [n] | None, d loss / d entropy [n] | None)``; adds the chunk's loss and
        metrics, unless ``metrics`` is False (the gradient alone: :attr:`TokenObjective.metrics_once`)."""
        run = self.run
        with torch.set_grad_enabled(want_grad):
            lp = logps.detach().to(self.sdt)
            # a leaf of its own: the kept statistics cannot change through it (in place on a leaf
            # that requires grad raises), so only the no-grad call copies it
            lp = lp.requires_grad_() if want_grad else lp.clone()
            ent = None
            if entropy is not None:
                ent = entropy.detach().to(self.sdt).clone().requires_grad_(want_grad and run.entropy_grad)
            if ref is not None:
                ref = ref.to(self.sdt)
            chunk = TokenChunk(lp, ent, ref, self.index[ts:te], self.seq[ts:te], metrics)
            loss, sums = run.objective(chunk)
            if not isinstance(loss, Tensor) or loss.dim() != 0:
                raise ValueError(f"objective must return a 0-d loss tensor, got "
                                 f"{tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__}")
            gl = ge = None
            if want_grad:
                leaves = [lp] + ([ent] if run.entropy_grad and ent is not None else [])
                got = [None] * len(leaves)
                if loss.requires_grad:
                    got = torch.autograd.grad(loss, leaves, allow_unused=True)
                gl, *rest = [torch.zeros_like(x) if g is None else g.to(self.sdt) for g, x in zip(got, leaves)]
                ge = rest[0] if rest else None
        if not metrics:
            return gl, ge
        self.loss = self.loss + loss.detach().to(self.sdt)
        for k, v in (sums or {}).items():
            v = v.detach()
            self.metric_sums[k] = v if k not in self.metric_sums else self.metric_sums[k] + v
        return gl, ge

    def keep(self, st, ref):
        """The chunk's statistics (tile ``st``, reference log-probs ``ref``) for the objective's
        later calls and :meth:`stats`."""
        self.parts["logps"].append(st.logp)
        self.parts["entropy"].append(st.entropy)
        self.parts["ref_logps"].append(ref)
        self.parts["correct"].append(st.correct)

    # ------------------------------------------------------------------ paths
    def execute(self):
        self.loss = torch.zeros((), dtype=self.sdt, device=self.dev)
        bounds = self.plan()
        if self.N == 0:
            e = torch.zeros(0, dtype=self.sdt, device=self.dev)
            self.call_objective(0, 0, e, e if self.run.need_entropy else None,
                                e if self.ref_rows is not None else None, False)
        elif bounds is not None:
            self.one_pass(bounds)
        else:
            self.two_phases(self.token_bounds())
        gh, gw, gb = self.grads.finish()
        return self.loss, (grad_like(gh, self.hidden) if gh is not None else None), gw, gb

    def one_pass(self, bounds):
        run, opts = self.run, self.kernel_opts
        once = run.objective.metrics_once
        for ts, te in bounds:
            ref = self.ref_logps(ts, te)
            h = self.rows(ts, te)
            tile = project(h, self.w, self.b)
            labels = self.labels[ts:te]
            fused = self.need_grad and not run.entropy_grad  # the kernel writes d logp / d logits now
            st = logits_tile(tile, labels, mode="logp", grad=fused, need_entropy=run.need_entropy,
                             need_logits_sum=False, **opts)
            self.keep(st, ref)
            gl = ge = None
            if self.need_grad or not once:
                gl, ge = self.call_objective(ts, te, st.logp, st.entropy, ref, self.need_grad, metrics=not once)
            if self.need_grad:
                if fused:
                    self.grads.add(tile, h, self.w, ts, te, row_scale=gl)
                else:
                    logp_entropy_grad_(tile, labels, st.lse, gl, entropy=st.entropy, grad_entropy=ge, **opts)
                    self.grads.add(tile, h, self.w, ts, te)
            del tile
        if once:  # the loss value and the metrics, from every token at once
            self.call_objective(0, self.N, self.cat("logps"), self.cat("entropy"), self.cat("ref_logps"), False)

    def two_phases(self, bounds):
        run, opts = self.run, self.kernel_opts
        lse_parts = []
        for ts, te in bounds:  # phase 1: statistics only
            ref = self.ref_logps(ts, te)
            tile = project(self.rows(ts, te), self.w, self.b)
            st = logits_tile(tile, self.labels[ts:te], mode="logp", grad=False, need_entropy=run.need_entropy,
                             need_logits_sum=False, **opts)
            del tile
            self.keep(st, ref)
            lse_parts.append(st.lse)
        logps, entropy, ref = self.cat("logps"), self.cat("entropy"), self.cat("ref_logps")
        gl, ge = self.call_objective(0, self.N, logps, entropy, ref, self.need_grad)
        if not self.need_grad:
            return
        lse = torch.cat(lse_parts)
        for ts, te in bounds:  # phase 2: recompute each tile, write its gradient from the saved statistics
            h = self.rows(ts, te)
            tile = project(h, self.w, self.b)
            logp_entropy_grad_(tile, self.labels[ts:te], lse[ts:te], gl[ts:te],
                               entropy=None if ge is None else entropy[ts:te],
                               grad_entropy=None if ge is None else ge[ts:te], **opts)
            self.grads.add(tile, h, self.w, ts, te)
            del tile

    def cat(self, key) -> Optional[Tensor]:
        """The kept ``key`` statistics of every chunk as one tensor, concatenated once (the
        metrics-once call and :meth:`stats` both read them)."""
        parts = self.parts[key]
        if not parts or parts[0] is None:
            return None
        if len(parts) > 1:
            parts[:] = [torch.cat(parts)]
        return parts[0]

    def stats(self) -> TokenStats:
        e = torch.zeros(0, dtype=self.sdt, device=self.dev)
        logps, correct = self.cat("logps"), self.cat("correct")
        return TokenStats(e if logps is None else logps.detach(), self.cat("entropy"), self.cat("ref_logps"),
                          self.index, e.bool() if correct is None else correct)


def check_reference_inputs(weight: Tensor, hidden: Tensor, ref_hidden: Optional[Tensor],
                           ref_weight: Optional[Tensor], ref_bias: Optional[Tensor]) -> None:
    """``ref_weight [V, Hr]`` (same vocab as ``weight``), ``ref_hidden [B, T, Hr]`` (``[B, T]`` of
    ``hidden``, ``Hr`` of ``ref_weight``, else of ``weight``), ``ref_bias [V]``, on hidden's device."""
    B, T, _ = hidden.shape
    V = weight.shape[0]
    if ref_weight is not None:
        check_tensor("ref_weight", ref_weight, ndim=2, floating=True)
        if ref_weight.shape[0] != V:
            raise ValueError(f"ref_weight must have shape [{V}, Hr] (same vocab as weight), "
                             f"got {tuple(ref_weight.shape)}")
    if ref_hidden is not None:
        check_tensor("ref_hidden", ref_hidden, ndim=3, floating=True)
        Hr = (ref_weight if ref_weight is not None else weight).shape[1]
        if tuple(ref_hidden.shape) != (B, T, Hr):
            raise ValueError(f"ref_hidden must have shape {(B, T, Hr)} ([B, T] of hidden, H of ref_weight), "
                             f"got {tuple(ref_hidden.shape)}")
    if ref_bias is not None:
        check_tensor("ref_bias", ref_bias, ndim=1, floating=True)
        if ref_bias.shape[0] != V:
            raise ValueError(f"ref_bias must have shape [{V}], got {tuple(ref_bias.shape)}")
    check_same_device(hidden=hidden, ref_hidden=ref_hidden, ref_weight=ref_weight, ref_bias=ref_bias)


def run_token_objective(
    weight: Tensor,
    hidden: Tensor,
    labels: Tensor,
    objective: TokenObjective,
    *,
    head: HeadOptions,
    bias: Optional[Tensor] = None,
    ref_hidden: Optional[Tensor] = None,
    ref_weight: Optional[Tensor] = None,
    ref_bias: Optional[Tensor] = None,
    entropy_grad: bool = False,
    inputs_checked: bool = False,
) -> tuple[Tensor, dict, TokenStats]:
    """:func:`fused_linear_token_objective` with its options already validated (``head``) and a
    :class:`TokenObjective` that declares its coupling; the head's tensors are checked here unless
    the caller did (``inputs_checked``: :func:`~liger_losses.chunked.options.check_head_inputs`
    with ``hidden_ndim=3``), the reference's always."""
    if not inputs_checked:
        check_head_inputs(weight, hidden, labels, bias, head, hidden_ndim=3)
    if not isinstance(objective, TokenObjective):
        raise TypeError(f"objective must be a TokenObjective (as_token_objective wraps a callable), "
                        f"got {type(objective).__name__}")
    check_choice(f"{type(objective).__name__}.coupling", objective.coupling, COUPLINGS)
    check_reference_inputs(weight, hidden, ref_hidden, ref_weight, ref_bias)
    run = _Run(
        labels=labels, objective=objective, head=head,
        ref_hidden=None if ref_hidden is None else ref_hidden.detach(),
        ref_weight=None if ref_weight is None else ref_weight.detach(),
        ref_bias=None if ref_bias is None else ref_bias.detach(),
        entropy_grad=bool(entropy_grad), grad_enabled=torch.is_grad_enabled(),
    )
    sink: dict = {}
    loss = _TokenObjectiveFunction.apply(weight, hidden, bias, run, sink)
    return loss, sink["metrics"], sink["stats"]


def fused_linear_token_objective(
    weight: Tensor,
    hidden: Tensor,
    labels: Tensor,
    objective,
    *,
    coupling: Optional[str] = None,
    bias: Optional[Tensor] = None,
    ref_hidden: Optional[Tensor] = None,
    ref_weight: Optional[Tensor] = None,
    ref_bias: Optional[Tensor] = None,
    need_entropy: bool = False,
    entropy_grad: bool = False,
    ignore_index: int = -100,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    chunk_tokens: Optional[int] = None,
    accum_dtype: Optional[torch.dtype] = None,
    impl: str = "auto",
) -> tuple[Tensor, dict, TokenStats]:
    """A loss that is a sum over chunks of ``objective(TokenChunk)``, computed from the hidden states.

    ``weight [V, H]``, ``hidden [B, T, H]``, ``labels [B, T]`` (already shifted; ``ignore_index`` at
    prompt and padding), ``bias [V]``. Reference log-probs (``chunk.ref_logps``) come from
    ``ref_hidden [B, T, Hr]`` through ``ref_weight [V, Hr]`` (default: the policy's head, with
    ``bias`` unless ``ref_bias`` is given) under no grad. ``need_entropy`` hands the objective each
    token's entropy; ``entropy_grad`` (implies it) differentiates the loss through it too.
    ``objective``: a :class:`TokenObjective` (its declared ``coupling`` picks the path, module
    docstring; ``coupling`` may only tighten it) or a plain callable (run with ``coupling``,
    default ``"token"``). Returns ``(loss, metric_sums, stats)``: the 0-d loss (differentiable
    w.r.t. ``weight``, ``hidden``, ``bias``), the objective's metric sums over all chunks
    (detached), and the detached :class:`TokenStats`. Shared options:
    :class:`~liger_losses.chunked.options.HeadOptions`.
    """
    head = HeadOptions(ignore_index=ignore_index, temperature=temperature, softcap=softcap,
                       logit_scale=logit_scale, chunk_tokens=chunk_tokens, accum_dtype=accum_dtype, impl=impl,
                       need_entropy=bool(need_entropy or entropy_grad))
    return run_token_objective(weight, hidden, labels, as_token_objective(objective, coupling=coupling),
                               head=head, bias=bias, ref_hidden=ref_hidden, ref_weight=ref_weight,
                               ref_bias=ref_bias, entropy_grad=entropy_grad)
