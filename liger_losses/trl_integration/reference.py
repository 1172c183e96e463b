"""What the adapters whose loss compares the policy to a *reference* share (``DPOTrainer``, ``KTOTrainer``).

:class:`LigerReferenceTrainerMixin` (a :class:`~liger_losses.trl_integration.base.LigerTrainerMixin`) gives them:

* construction: :meth:`~LigerReferenceTrainerMixin._liger_before_trl_init` (TRL's default config when
  ``args`` is None, the loss built from it so option checks fail fast) and
  :meth:`~LigerReferenceTrainerMixin._liger_after_trl_init` (an MoE auxiliary loss rejected where not served,
  the loss rebuilt with the head's softcap / logit scale and kept following the trainer's option attributes
  (``_liger_live_fields``, :class:`~.live_options.LiveLoss`), layer patching of policy and reference). A
  vision-language model's calls with images run through base models (``multimodal.py``).
  A subclass names its config class and loss builder in ``_liger_config_cls`` / ``_liger_build_loss``.
* the reference: :meth:`~LigerReferenceTrainerMixin._liger_reference_scope` (no grad, gradient
  checkpointing off, the PEFT policy switched to its reference adapter when it is the reference),
  :meth:`~LigerReferenceTrainerMixin._liger_peft_reference` (is the PEFT policy the reference),
  :meth:`~LigerReferenceTrainerMixin._liger_reference_hidden` (the reference's hidden states
  ``[B, T-1, H]`` and head) and :meth:`~LigerReferenceTrainerMixin._liger_token_logps` (per-token
  log-probs ``[B, T-1]`` of a model on completion labels, chunked, for the precompute and the KL terms).
* the loss: :meth:`~LigerReferenceTrainerMixin._liger_policy_loss` runs the policy backbone (``hidden[:, :-1]``,
  ``[B, T-1, H]``) and ``self.liger_loss`` on it, the labels ``[B, T-1]`` (``-100`` ignored), the LM head and the
  reference's hidden states / head (detached) or precomputed log-probs; inside the model's forward when the
  model is distributed. TRL's ``num_tokens`` is kept by the base mixin's ``_liger_gather(..., inputs=)``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ClassVar, Dict, Mapping, Optional, Sequence

import torch
from torch import nn

from ..chunked.token_logprobs import fused_linear_token_logprobs
from ..patching.pad_free import label_read_mask
from .base import (
    IGNORE_INDEX,
    LigerTrainerMixin,
    gathered_params,
    head_is_peft_wrapped,
    head_logit_options,
    is_peft_model,
    reference_adapter,
    reject,
    unwrap_causal_lm,
)
from .live_options import LiveLoss
from .router_aux import log_router_aux_loss, policy_hidden_and_router_aux


class LigerReferenceTrainerMixin(LigerTrainerMixin):
    """Base of the DPO / KTO adapters (see the module docstring); list it before the TRL trainer class."""

    _liger_config_cls: ClassVar[type]  # the TRL config (trl.DPOConfig...)
    _liger_build_loss: ClassVar[Callable[..., nn.Module]]  # (args, *, chunk_tokens, softcap, logit_scale) -> loss
    # True where the trainer adds the MoE router aux loss to its policy loss as TRL does (DPO, KTO); else rejected
    _liger_serves_router_aux_loss: ClassVar[bool] = False
    # config field -> the trainer attribute TRL's loss reads it from at every step (None: TRL reads the config)
    _liger_live_fields: ClassVar[Mapping[str, Optional[str]]]

    # ------------------------------------------------------------------ construction

    def __init__(
        self,
        model,
        ref_model=None,
        args=None,
        *trl_args: Any,
        use_liger: bool = False,
        liger_patch_model: bool = True,
        liger_chunk_tokens: Optional[int] = None,
        **trl_kwargs: Any,
    ):
        """TRL's ``(model, ref_model, args, ...)`` plus the three ``liger_*`` keywords; ``args`` is the
        trainer's config (``_liger_config_cls``)."""
        self._liger_setup(
            use_liger=use_liger, liger_patch_model=liger_patch_model, liger_chunk_tokens=liger_chunk_tokens
        )
        if use_liger:
            args = self._liger_before_trl_init(model, args, trl_args, trl_kwargs)
        super().__init__(model, ref_model, args, *trl_args, **trl_kwargs)
        if use_liger:
            self._liger_after_trl_init(trl_kwargs)

    def _liger_before_trl_init(self, model, args, trl_args: Sequence[Any], trl_kwargs: Mapping[str, Any]):
        """The ``args`` to hand TRL (its default ``<model name>-<DPO|KTO>`` config when None), after building
        ``self.liger_loss`` from it."""
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            tag = self._liger_config_cls.__name__[: -len("Config")]
            args = self._liger_config_cls(f"{str(name).split('/')[-1] or 'model'}-{tag}")
        self.liger_loss = self._liger_build_loss(args, chunk_tokens=self.liger_chunk_tokens)  # fail fast
        return args

    def _liger_after_trl_init(self, trl_kwargs: Mapping[str, Any]) -> None:
        """Checks that need TRL's built trainer, the loss with the head's logit transform, layer patching."""
        if self.aux_loss_enabled and not self._liger_serves_router_aux_loss:
            reject("router_aux_loss_coef", self.router_aux_loss_coef,
                   "the MoE load-balancing loss needs the router logits of TRL's forward")
        logit_opts = head_logit_options(unwrap_causal_lm(self.model).config)
        if self.ref_model is not None and not getattr(self.args, "precompute_ref_log_probs", False):
            ref_opts = head_logit_options(unwrap_causal_lm(self.ref_model).config)
            if ref_opts != logit_opts:  # the loss applies the policy's transform to the reference's tiles too
                reject("ref_model", type(unwrap_causal_lm(self.ref_model)).__name__,
                       f"its head's logit transform {ref_opts} differs from the policy's {logit_opts}, and the fused "
                       "loss applies one to both (precompute_ref_log_probs=True computes the reference's with its own)")
        build = functools.partial(self._liger_build_loss, chunk_tokens=self.liger_chunk_tokens, **logit_opts)
        if logit_opts["softcap"] is not None or logit_opts["logit_scale"] != 1.0:
            self.liger_loss = build(self.args)
        self._liger_live = LiveLoss(self, self._liger_live_fields, build)
        self._liger_after_init(self.model, self.ref_model, trl_kwargs=trl_kwargs)

    # ------------------------------------------------------------------ reference

    def _liger_peft_reference(self) -> bool:
        """True when the policy itself, with its PEFT adapter off (or its "ref" adapter), is the reference."""
        return self.ref_model is None and is_peft_model(self.accelerator.unwrap_model(self.model))

    @contextlib.contextmanager
    def _liger_reference_scope(self, peft_ref: bool):
        """No grad, gradient checkpointing off and, when ``peft_ref``, the policy acting as the reference."""
        from trl.models.utils import disable_gradient_checkpointing

        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
            reference_adapter(self.accelerator.unwrap_model(self.model)) if peft_ref else contextlib.nullcontext(),
        ):
            yield

    def _liger_reference_hidden(self, model: nn.Module, model_kwargs: Dict[str, Any], *,
                                also: Optional[Callable[[nn.Module], Any]] = None,
                                labels: Optional[torch.Tensor] = None):
        """``(ref_hidden [B, T-1, H], ref_weight, ref_bias, also(ref) or None)`` under no grad; pad-free where the
        loss's shifted ``labels [B, T-1]`` allow (``patching/pad_free.py``: zeros where nothing is attended).

        The reference is ``self.ref_model`` (with its own head) or, without one, the policy ``model`` with its PEFT
        adapter off (:meth:`_liger_reference_scope`). A head PEFT wraps (``modules_to_save``, trainable tokens)
        is read in that scope, where it is its original; an unwrapped head is the policy's own, and
        ``ref_weight``/``ref_bias`` are then None (it serves both). ``also`` runs in the same scope on the
        reference module (e.g. the KL completions' log-probs).
        """
        peft_ref = self.ref_model is None
        ref = model if peft_ref else self.ref_model
        ref_weight = ref_bias = None
        with (self._liger_reference_scope(True) if peft_ref else torch.no_grad()):
            read = None if labels is None else label_read_mask(labels, IGNORE_INDEX)
            ref_hidden = self._liger_run(ref, self._liger_backbone_hidden, ref, model_kwargs, read)[:, :-1]
            extra = None if also is None else also(ref)
            if not peft_ref or head_is_peft_wrapped(unwrap_causal_lm(ref)):
                ref_weight, ref_bias = self._liger_head(ref)
        return ref_hidden, ref_weight, ref_bias, extra

    def _liger_token_logps(self, model: nn.Module, model_kwargs: Dict[str, Any],
                           labels: torch.Tensor) -> torch.Tensor:
        """Per-token log-probs ``[B, T-1]`` of ``model`` on ``labels [B, T-1]`` (0 where ignored), chunked."""
        logit_opts = head_logit_options(unwrap_causal_lm(model).config)

        def run():
            hidden = self._liger_backbone_hidden(model, model_kwargs, label_read_mask(labels, IGNORE_INDEX))[:, :-1]
            weight, bias = self._liger_head(model)
            with gathered_params(weight, bias):
                return fused_linear_token_logprobs(
                    weight, hidden, labels.to(hidden.device), bias=bias, ignore_index=IGNORE_INDEX,
                    chunk_tokens=self.liger_chunk_tokens, **logit_opts,
                )

        return self._liger_run(model, run)

    # ------------------------------------------------------------------ the loss

    def _liger_policy_loss(self, model: nn.Module, model_kwargs: Dict[str, Any], labels: torch.Tensor,
                           ref_hidden: Optional[torch.Tensor], ref_weight: Optional[torch.Tensor],
                           ref_bias: Optional[torch.Tensor], **loss_kwargs: Any):
        """``self.liger_loss(weight, hidden, ref_hidden, labels, bias=, ref_weight=, ref_bias=, **loss_kwargs)`` on
        the policy's ``hidden[:, :-1]`` and head; tensors of ``loss_kwargs`` moved to the hidden states' device."""

        aux_enabled = self.aux_loss_enabled and self._liger_serves_router_aux_loss

        def run():
            # MoE: the router logits of this same policy forward give the aux loss
            hidden, aux = policy_hidden_and_router_aux(self, model, model_kwargs, enabled=aux_enabled,
                                                       read_mask=label_read_mask(labels, IGNORE_INDEX))
            hidden = hidden[:, :-1]
            weight, bias = self._liger_head(model)
            extra = {k: v.to(hidden.device) if isinstance(v, torch.Tensor) else v for k, v in loss_kwargs.items()}
            with gathered_params(weight, bias, ref_weight, ref_bias):
                return self.liger_loss(
                    weight, hidden, ref_hidden, labels.to(hidden.device), bias=bias,
                    ref_weight=None if ref_weight is None else ref_weight.detach(),
                    ref_bias=None if ref_bias is None else ref_bias.detach(), **extra,
                ), aux

        (loss, metrics), aux = self._liger_run(model, run)
        if aux is not None:  # TRL's DPO: loss + router_aux_loss_coef * aux_loss, logged as aux_loss
            loss = loss + self.router_aux_loss_coef * aux
            mode = "train" if self.model.training else "eval"
            log_router_aux_loss(self, mode, aux)
        return loss, metrics
