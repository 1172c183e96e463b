"""Shared machinery of the TRL adapters: what every ``XxxTrainer(use_liger=True)`` needs besides its loss.

The adapters (``sft.py``, ``dpo.py``, ``kto.py``, ``cpo.py``, ``orpo.py``, ``gkd.py``, ``distillation.py``;
``reference.py`` adds what the reference-model ones share) subclass a TRL trainer and
replace only the method that turns the model's output into a loss. With ``use_liger=True`` that
method runs the model's *backbone* (the decoder without its LM head) to get the last hidden states
``[B, T, H]`` and hands them, with the LM head's ``weight [V, H]`` (and ``bias [V]``), to a chunked
loss of :mod:`liger_losses.chunked`, so the ``[B, T, V]`` logits are never held whole.

This module gives those pieces, each usable on its own:

* :class:`LigerTrainerMixin` -- put it *before* the TRL trainer in the bases. It stores the three
  constructor options (``use_liger``, ``liger_patch_model``, ``liger_chunk_tokens``), patches the
  policy/reference models with :func:`liger_losses.patching.apply_liger_kernels` (a family it has no
  kernels for keeps transformers' layers, with a warning: :func:`patch_model_layers`), and has the
  helpers the adapters call: :meth:`~LigerTrainerMixin._liger_backbone_hidden` (run the backbone,
  inside the wrapper's forward when the model is distributed), :meth:`~LigerTrainerMixin._liger_head`
  (LM head weight/bias), :meth:`~LigerTrainerMixin._liger_gather` / :meth:`~LigerTrainerMixin._liger_log`
  (metrics reduced over processes in one gather, logged under TRL's names, with TRL's ``num_tokens``),
  :meth:`~LigerTrainerMixin._liger_return` (TRL's ``return_outputs`` contract).
* :func:`gather_metric_values` -- per-process 0-d values averaged or summed over processes by one
  ``gather_for_metrics`` and one host read; :func:`completion_labels` -- shifted labels of a completion mask.
* :func:`innermost_module`, :func:`unwrap_causal_lm`, :func:`backbone_of`, :func:`lm_head_params`,
  :func:`head_logit_options` -- find the decoder, the head parameters and the head's logit transform
  (softcap / scale) of a Hugging Face causal LM, through PEFT and accelerate wrappers (:mod:`.anatomy`,
  re-exported here).
* :func:`gathered_params` -- a ZeRO-3 partitioned LM head is gathered with
  ``deepspeed.zero.GatheredParameters`` for the duration of the loss (``deepspeed`` imported lazily;
  a null context otherwise).
* :func:`run_in_forward` -- "forward redirection": under FSDP (and DDP / DeepSpeed engines)
  parameters are gathered and gradient hooks armed by the *root* module's ``__call__``. Calling the
  backbone submodule directly would skip that, so the loss function is run as the root module's
  forward for one call, for every model (a plain one's hooks then run as in ``model(...)``): the root's
  ``forward`` attribute is swapped for the call and restored afterwards, also on error.
* :func:`forward_autocast` -- the mixed-precision autocast accelerate wraps a prepared model's
  ``forward`` in (``bf16=True``/``fp16=True``); the swapped forward would drop it, so
  :meth:`~LigerTrainerMixin._liger_run` enters it around the loss function: the backbone (PEFT
  adapters included) and the head GEMMs run in the precision TRL's own step runs them in.
* :func:`reference_adapter` -- the PEFT reference: the "ref" adapter when TRL created one (re-training
  an existing adapter), else all adapters disabled (``model.disable_adapter()``).
* :func:`reject` -- the one way an adapter says "TRL supports this option, use_liger=True does not":
  a ``ValueError`` naming the option, raised at construction (``multimodal.reject_vision`` for a VLM processor).
* :func:`build_loss` / :func:`build_config_loss` -- the loss module of a TRL config: each config field
  mapped to a loss keyword, the adapter's options added, what the loss cannot serve rejected.

Shapes: hidden ``[B, T, H]`` in the model's compute dtype; weight ``[V, H]``; labels ``[B, T]`` int64
with ``-100`` on ignored positions. Metrics are Python floats appended to ``trainer._metrics[mode]``, queued
on the device during the step and read in one transfer when the store is read (:mod:`.metrics`); the labels'
scan is queued before the backbone (:meth:`~LigerTrainerMixin._liger_scan_ahead`), so no host read in the step
waits for the model's forward or the loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..chunked.tokens import scan_labels_ahead
from ..chunked.weights import is_zero3_partitioned, run_as_forward, run_with_head_params, zero3_gathered
from ..patching.pad_free import pack_batch
from .anatomy import (  # noqa: F401 - re-exported: the adapters and tests import them from here
    backbone_of,
    check_head_path,
    compiled_like,
    compiled_module,
    has_forward_hooks,
    head_is_peft_wrapped,
    head_logit_options,
    innermost_module,
    is_peft_model,
    lm_head_params,
    unwrap_causal_lm,
)
from .checkpointing import lean_allowed, lean_checkpointing
from .logit_check import check_model_logits
from .metrics import DeferredMetrics
from .metrics import install as install_resolving_store
from .multimodal import multimodal_backbone_of, packed_language_model, runs_base_model

IGNORE_INDEX = -100


# --------------------------------------------------------------------------- errors


def reject(option: str, value: Any, why: str) -> None:
    """Raise the ``ValueError`` an adapter gives for a TRL option it cannot serve with use_liger=True."""
    raise ValueError(f"use_liger=True does not support {option}={value!r}: {why}. "
                     f"Unset {option}, or pass use_liger=False to use TRL's own loss.")


# --------------------------------------------------------------------------- sharded heads


def is_zero3_param(param: Optional[torch.Tensor]) -> bool:
    """True for a DeepSpeed ZeRO-3 partitioned parameter (it carries ``ds_id``)."""
    return param is not None and hasattr(param, "ds_id")


def gathered_params(*params: Optional[torch.Tensor]):
    """Context in which ZeRO-3 partitioned ``params`` hold their full values (a null context when
    none is partitioned now). Our losses read ``lm_head.weight`` directly, so the head module's own
    gather hook never fires; this does its job. ``deepspeed`` is imported only when needed."""
    # only those partitioned now: inside the engine's forward DeepSpeed has already gathered the policy's head
    # read there, and it refuses nested GatheredParameters over the same parameter
    sharded = [p for p in params if is_zero3_param(p) and is_zero3_partitioned(p)]
    if not sharded:
        return contextlib.nullcontext()
    # read-only gather; the gradients reach ZeRO-3's hooks on the parameters' gradient accumulators
    return zero3_gathered(sharded)


# --------------------------------------------------------------------------- forward redirection


def run_in_forward(root: nn.Module, fn: Callable[..., Any], *args, **kwargs) -> Any:
    """Call ``fn(*args, **kwargs)`` *as the forward of* ``root``, through ``root.__call__``.

    The module whose forward is swapped is the innermost one the wrapper calls (``root.module``
    for DDP/FSDP1/DeepSpeed, ``root`` itself for FSDP2 or a plain module). All of ``root``'s
    forward pre/post hooks run around ``fn`` (FSDP unshards, DDP prepares its reducer), and the
    original forward is restored before ``fn`` runs, so nested calls of the model inside ``fn``
    are ordinary calls. Returns ``fn``'s result.
    """
    return run_as_forward(innermost_module(root), lambda: fn(*args, **kwargs), call=root)


def forward_autocast(model: nn.Module, accelerator) -> contextlib.AbstractContextManager:
    """The autocast ``model``'s own forward runs under: accelerate's mixed-precision context when
    ``accelerator.prepare_model`` wrapped that forward, else a null context.

    With native AMP (``bf16=True`` / ``fp16=True``, not DeepSpeed) ``prepare_model`` replaces the prepared
    module's ``forward`` by one that runs the original under
    ``get_mixed_precision_context_manager(native_amp, autocast_handler)`` -- the context
    ``accelerator.autocast()`` also returns -- and records the original as ``_original_forward``; that
    attribute is how a wrapped forward is recognised. The prepared module is the innermost one of
    ``model``'s DDP / FSDP1 / DeepSpeed wrappers (an FSDP2 module, a PEFT model or a plain causal LM is its
    own). A reference model TRL prepared with ``prepare_fsdp``/``prepare_deepspeed`` has no such wrapper, and
    TRL's call of it runs without autocast: so does ours.
    """
    inner = innermost_module(model)
    if accelerator is not None and inner.__dict__.get("_original_forward") is not None:
        return accelerator.autocast()
    return contextlib.nullcontext()


# --------------------------------------------------------------------------- PEFT reference


@contextlib.contextmanager
def reference_adapter(peft_model: nn.Module):
    """Inside: ``peft_model`` computes the reference policy. The "ref" adapter when present (TRL
    adds it when re-training an existing adapter), otherwise the base model (adapters disabled)."""
    if "ref" in getattr(peft_model, "peft_config", {}):
        previous = peft_model.active_adapter
        peft_model.set_adapter("ref")
        try:
            yield
        finally:
            peft_model.set_adapter(previous)
    else:
        with peft_model.disable_adapter():
            yield


# --------------------------------------------------------------------------- model patching


def patch_model_layers(model: nn.Module, *, allow_new_params: bool = True) -> bool:
    """Swap ``model``'s layers for our kernels in place (``apply_liger_kernels``; the LM-head/loss
    forward is left alone, the adapters compute the loss themselves). Returns whether it patched.

    The layer kernels are a speed-up, the fused loss serves any causal LM: a model of a family
    ``apply_liger_kernels`` does not know (``ValueError``), or whose transformers classes no longer look
    as its patch expects (``FamilyMismatchError``, raised before anything is patched), keeps
    transformers' layers, with a ``UserWarning`` that says so, and trains with the fused loss.

    With ``allow_new_params=False`` (an optimizer already holds the parameters), raise ValueError if
    patching replaced any parameter object, since the optimizer would not update the new ones.
    """
    from ..patching import FamilyMismatchError, apply_liger_kernels
    from ..patching.apply import family_of

    target = unwrap_causal_lm(model)
    try:
        family_of(target)
    except ValueError:
        model_type = getattr(getattr(target, "config", None), "model_type", None)
        _warn_unpatched(target, f"no layer kernels for model_type {model_type!r}")
        return False
    before = {id(p) for p in target.parameters()}
    try:
        apply_liger_kernels(target, cross_entropy=False)
    except FamilyMismatchError as exc:
        _warn_unpatched(target, str(exc))
        return False
    if not allow_new_params and {id(p) for p in target.parameters()} != before:
        raise ValueError(
            "liger_patch_model=True replaced parameters of a model whose optimizer was passed to the "
            "trainer (optimizers=...); pass liger_patch_model=False, or patch the model with "
            "liger_losses.patching.apply_liger_kernels before building the optimizer"
        )
    return True


def _warn_unpatched(model: nn.Module, why: str) -> None:
    warnings.warn(
        f"liger_patch_model=True: {type(model).__name__}'s layers stay transformers' ({why}); the fused loss "
        "still computes the loss from its hidden states and LM head. Pass liger_patch_model=False to silence "
        "this warning.",
        UserWarning,
        stacklevel=_caller_stacklevel(),
    )


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside this package (the user's trainer construction, however
    many of the adapters' own frames lie between)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("liger_losses."):
        frame, level = frame.f_back, level + 1
    return level


# --------------------------------------------------------------------------- loss construction


def build_loss(cls, options: Mapping[str, Any], defaults: Mapping[str, Any], config_name: str):
    """Instantiate the loss module ``cls`` with the TRL options it accepts.

    ``options`` maps a TRL config field name to (loss keyword, value). A field whose value differs
    from ``defaults[field]`` but that ``cls`` does not accept is rejected (ValueError naming the
    field); so is any ValueError/NotImplementedError/TypeError ``cls`` raises for a value.
    """
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {}
    for field, (keyword, value) in options.items():
        if keyword in params or takes_any:
            kwargs[keyword] = value
        elif field in defaults and value != defaults[field]:
            reject(f"{config_name}.{field}", value, f"{cls.__name__} has no option {keyword!r}")
    try:
        return cls(**kwargs)
    except (ValueError, NotImplementedError, TypeError) as exc:
        raise ValueError(f"use_liger=True cannot serve this {config_name}: {exc}") from exc


def config_defaults(config_cls) -> Dict[str, Any]:
    """``{field: default}`` of the dataclass ``config_cls`` (a TRL config; ``default_factory`` fields called)."""
    out = {}
    for f in dataclasses.fields(config_cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


def build_config_loss(cls, args, fields: Mapping[str, str], config_cls, *, chunk_tokens: Optional[int] = None,
                      softcap=None, logit_scale: float = 1.0, need_entropy: bool = False):
    """The loss module ``cls`` serving the TRL config ``args`` (a ``config_cls``), by :func:`build_loss`.

    ``fields`` maps a config field to the keyword of ``cls`` it sets. The adapter adds ``chunk_tokens``
    (``liger_chunk_tokens``), ``ignore_index=-100``, ``need_entropy=True`` when asked (TRL logs the entropy)
    and the head's ``softcap`` / ``logit_scale`` when they are not the identity. ValueError names what
    ``cls`` cannot serve (``config_cls.__name__ + "." + field``).
    """
    options = {field: (kw, getattr(args, field)) for field, kw in fields.items()}
    options["liger_chunk_tokens"] = ("chunk_tokens", chunk_tokens)
    if need_entropy:
        options["need_entropy"] = ("need_entropy", True)
    options["ignore_index"] = ("ignore_index", IGNORE_INDEX)
    if softcap is not None:
        options["final_logit_softcapping"] = ("softcap", softcap)
    if logit_scale != 1.0:
        options["logit_scale"] = ("logit_scale", logit_scale)
    defaults = {f: v for f, v in config_defaults(config_cls).items() if f in fields}
    defaults.update(liger_chunk_tokens=None, need_entropy=True, ignore_index=IGNORE_INDEX,
                    final_logit_softcapping=None, logit_scale=1.0)
    return build_loss(cls, options, defaults, config_cls.__name__)


# --------------------------------------------------------------------------- labels and metrics


def completion_labels(input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Shifted labels ``[B, T-1]``: ``input_ids[:, 1:]`` with ``-100`` where ``completion_mask[:, 1:]`` is 0."""
    return input_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)[:, 1:]


def gather_metric_tensor(accelerator, values: Sequence[torch.Tensor],
                         reduction: Union[str, Sequence[str]] = "mean") -> torch.Tensor:
    """Each 0-d tensor of ``values`` reduced over processes -- ``"mean"`` or ``"sum"`` (one for all, or one per
    value) -- as one ``[K]`` tensor on the values' device, from one ``gather_for_metrics``; nothing is read
    on the host (the adapters queue it: :mod:`.metrics`).

    The values are stacked into one ``[1, K]`` row (float64, so counts stay exact and float32 values pass
    unchanged; float32 on MPS, which has no float64), gathered to ``[processes, K]`` and reduced over dim 0.
    On one process each result is its value exactly.
    """
    reductions = [reduction] * len(values) if isinstance(reduction, str) else list(reduction)
    if len(reductions) != len(values) or not set(reductions) <= {"mean", "sum"}:
        raise ValueError(f"reduction must be 'mean' or 'sum', one for all or one per value, got {reduction!r}")
    if not values:
        return torch.zeros(0, dtype=torch.float64)
    device = values[0].device
    dtype = torch.float32 if device.type == "mps" else torch.float64
    row = torch.stack([v.detach().reshape(()).to(device=device, dtype=dtype) for v in values]).unsqueeze(0)
    rows = accelerator.gather_for_metrics(row)  # [processes, K]
    if all(r == "sum" for r in reductions):
        return rows.sum(0)
    if all(r == "mean" for r in reductions):
        return rows.mean(0)
    return torch.where(_sum_mask(tuple(r == "sum" for r in reductions), rows.device), rows.sum(0), rows.mean(0))


_SUM_MASKS: Dict[Tuple[Tuple[bool, ...], torch.device], torch.Tensor] = {}


def _sum_mask(is_sum: Tuple[bool, ...], device: torch.device) -> torch.Tensor:
    """``is_sum`` as a bool tensor on ``device``, made once per pattern and device: a tensor copied from host
    memory at every step would wait for the stream to drain (the step's forward and loss) before the backward."""
    key = (is_sum, device)
    mask = _SUM_MASKS.get(key)
    if mask is None:
        mask = _SUM_MASKS[key] = torch.tensor(is_sum, device=device)
    return mask


def gather_metric_values(accelerator, values: Sequence[torch.Tensor],
                         reduction: Union[str, Sequence[str]] = "mean") -> List[float]:
    """:func:`gather_metric_tensor` read on the host now, as Python floats (for a caller that needs them at
    once, e.g. TRL's evaluation path that returns the metrics)."""
    return gather_metric_tensor(accelerator, values, reduction).tolist() if values else []


# --------------------------------------------------------------------------- the mixin


class LigerTrainerMixin:
    """Base of the ``use_liger`` adapters; list it before the TRL trainer class.

    Subclasses call :meth:`_liger_setup` before ``super().__init__`` (it needs only the options) and
    :meth:`_liger_after_init` after it (model patching). ``self.use_liger`` False leaves the TRL
    trainer untouched: every override starts with ``if not self.use_liger: return super()...``.
    """

    use_liger: bool = False

    def _liger_setup(self, *, use_liger: bool, liger_patch_model: bool, liger_chunk_tokens) -> None:
        if not isinstance(use_liger, bool):
            raise TypeError(f"use_liger must be a bool, got {type(use_liger).__name__}")
        if not isinstance(liger_patch_model, bool):
            raise TypeError(f"liger_patch_model must be a bool, got {type(liger_patch_model).__name__}")
        if liger_chunk_tokens is not None and (
            not isinstance(liger_chunk_tokens, int) or isinstance(liger_chunk_tokens, bool) or liger_chunk_tokens < 1
        ):
            raise ValueError(f"liger_chunk_tokens must be None or a positive int, got {liger_chunk_tokens!r}")
        self.use_liger = use_liger
        self.liger_patch_model = liger_patch_model
        self.liger_chunk_tokens = liger_chunk_tokens

    def _liger_after_init(self, *models: Optional[nn.Module], trl_kwargs: Mapping[str, Any]) -> None:
        """Checks that need the built model, then layer patching of ``models`` (None entries skipped);
        ``trl_kwargs`` are the keywords given to TRL's trainer (an ``optimizers=`` there forbids new parameters)."""
        if not self.use_liger:
            return
        # metrics are queued on the device and read when the store is read (.metrics): no host sync in the step
        for attr in ("_metrics", "_stored_metrics"):
            install_resolving_store(self, attr, self._liger_pending)
        user_optimizer = trl_kwargs.get("optimizers", (None, None))[0] is not None
        policy = unwrap_causal_lm(self.model)
        peft_root = innermost_module(self.model)
        if is_peft_model(peft_root):
            cfg = peft_root.peft_config.get(peft_root.active_adapter)
            if cfg is not None and getattr(cfg, "is_prompt_learning", False):
                reject("peft_config", type(cfg).__name__, "prompt-learning adapters prepend virtual tokens "
                       "inside PeftModel.forward, which the backbone call bypasses")
        for role, m in (("model", policy), *(("ref_model / teacher_model", unwrap_causal_lm(m))
                                               for m in models[1:] if m is not None)):
            try:  # fail now, not at the first step, if the loss cannot read the model
                check_head_path(m)
            except ValueError as exc:
                raise ValueError(f"use_liger=True cannot serve {role}: {exc}") from None
        if getattr(self, "aux_loss_enabled", False):
            from .router_aux import moe_sizes

            moe_sizes(policy)  # the load-balancing loss's expert count and top-k: fail now if the config has neither
        if self.liger_patch_model:
            for m in models:
                if m is not None:
                    patch_model_layers(m, allow_new_params=not user_optimizer)

    # -- running the model

    def _liger_backbone(self, model: nn.Module, model_kwargs: Optional[Dict[str, Any]] = None) -> nn.Module:
        """``model``'s backbone, to be called (on ``model_kwargs``: a composite model's call with images or audio runs
        its base model, :func:`~.multimodal.runs_base_model`). When the trainer compiled ``model``
        (``torch_compile=True``: accelerate wraps the prepared model in ``torch.compile``), the backbone is compiled
        under the same Dynamo context (:func:`compiled_like`), once per backbone. TRL's step then runs a compiled
        model, and ours a compiled backbone with the fused loss eagerly after it. Calling the wrapper's inner
        module alone would run eagerly."""
        causal_lm = unwrap_causal_lm(model)
        base = runs_base_model(causal_lm, model_kwargs)
        backbone = multimodal_backbone_of(causal_lm) if base else backbone_of(causal_lm)
        wrapper = compiled_module(model)
        if wrapper is None:
            return backbone
        cache = self.__dict__.setdefault("_liger_compiled_backbones", {})  # modules hash by identity
        if backbone not in cache:
            cache[backbone] = compiled_like(wrapper, backbone)
        return cache[backbone]

    def _liger_backbone_hidden(self, model: nn.Module, model_kwargs: Dict[str, Any], read_mask=None) -> torch.Tensor:
        """Last hidden states [B, T, H] of ``model``'s backbone (no LM head); given ``read_mask [B, T]`` (what the loss
        reads), on the attended tokens alone where :func:`~..patching.pad_free.pack_batch` packs them (a base model's
        language model: :func:`~.multimodal.packed_language_model`, in torch's checkpointing form, not the lean one)."""
        self._liger_check_logits(model, model_kwargs)
        backbone = self._liger_backbone(model, model_kwargs)
        base = runs_base_model(unwrap_causal_lm(model), model_kwargs)
        packed = None if base else pack_batch(backbone, model_kwargs, read_mask)
        kwargs = model_kwargs if packed is None else packed.kwargs
        with (packed_language_model(backbone, read_mask) if base
              else self._liger_lean_checkpointing(model, backbone, kwargs)):
            hidden = backbone(**kwargs).last_hidden_state
        return hidden if packed is None else packed.unpack(hidden)

    def _liger_lean_checkpointing(self, model: nn.Module, backbone: nn.Module,
                                  model_kwargs: Dict[str, Any]) -> contextlib.AbstractContextManager:
        """:func:`~.checkpointing.lean_checkpointing` of ``backbone`` (``model``'s, :meth:`_liger_backbone`) for one
        call on ``model_kwargs`` (its token count decides with the layers' size), where
        :func:`~.checkpointing.lean_allowed` says the model allows it (decided once per model and class: FSDP2's
        ``fully_shard`` changes a module's class in place, e.g. after a reference precompute ran on the bare model)."""
        allowed = self.__dict__.setdefault("_liger_lean_allowed", {})
        key = (id(model), type(model))
        if key not in allowed:
            allowed[key] = lean_allowed(model)
        inputs = model_kwargs.get("input_ids")
        inputs = model_kwargs.get("inputs_embeds") if inputs is None else inputs
        tokens = inputs.shape[0] * inputs.shape[1] if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2 else None
        return lean_checkpointing(backbone, allowed[key], tokens)  # a compiled model: not allowed

    def _liger_check_logits(self, model: nn.Module, model_kwargs: Dict[str, Any]) -> None:
        """At ``model``'s first step: its own forward's logits against the fused loss's formula on its backbone's
        output with its config's softcap / logit scale (:func:`~.logit_check.check_model_logits`). Once per causal LM
        (a PEFT reference is the policy's)."""
        causal_lm = unwrap_causal_lm(model)
        checked = self.__dict__.setdefault("_liger_logits_checked", set())
        if id(causal_lm) in checked:
            return
        checked.add(id(causal_lm))
        role = "model" if causal_lm is unwrap_causal_lm(self.model) else "ref_model / teacher_model"
        distributed = getattr(getattr(self, "accelerator", None), "num_processes", 1) > 1  # every rank checks it now
        check_model_logits(model, causal_lm, model_kwargs, role=role, distributed=distributed,
                           **head_logit_options(causal_lm.config))

    def _liger_run(self, model: nn.Module, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """``fn(*args, **kwargs)`` run as ``model``'s forward, in the context TRL's ``model(...)`` call has.

        That context is (1) the hooks of the root module's ``__call__`` -- FSDP unshards, DDP prepares its
        reducer, DeepSpeed's engine gathers -- so ``fn`` runs through :func:`run_in_forward`; and (2) the
        mixed-precision autocast accelerate wraps a prepared model's ``forward`` in (:func:`forward_autocast`),
        which a swapped forward would otherwise drop: with ``bf16=True`` the backbone, PEFT adapters included,
        and the LM-head GEMMs then run in bf16 as in TRL's step, not in the weights' dtype; and (3) for an LM
        head that FSDP2 shards in a group of its own, that group's hooks (``run_with_head_params``: ``fn`` runs as
        the head's forward too, so the head is unsharded while ``fn`` reads it and its gradient is reduced).
        """
        wrapper = compiled_module(model)
        inner = model if wrapper is None else wrapper._orig_mod
        autocast = forward_autocast(inner, getattr(self, "accelerator", None))
        get_head = getattr(unwrap_causal_lm(inner), "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None

        def as_forward():
            with autocast:  # an FSDP2 head of its own group: fn runs as its forward too (run_with_head_params)
                return run_with_head_params(head, fn, *args, **kwargs)

        if wrapper is not None and has_forward_hooks(wrapper):
            # accelerate shards a compiled model's wrapper itself with FSDP2 (its hooks outside the compiled
            # code): fn runs as the wrapper's forward, its hooks around it, nothing traced
            return run_as_forward(wrapper, as_forward)
        # a compiled model's other hooks are the inner wrappers' (accelerate compiles DDP / FSDP1 last);
        # the backbone inside fn is compiled (_liger_backbone)
        return run_in_forward(inner, as_forward)

    def _liger_scan_ahead(self, model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        """Queue the loss's label scan now, before the forward (:func:`~liger_losses.chunked.tokens.scan_labels_ahead`):
        the loss's one host read then waits for this scan alone, not for the backbone's forward. Returns
        ``labels``; the loss must get this same tensor (``.to`` its own device is a no-op)."""
        weight = self._liger_head(model)[0]
        vocab = getattr(weight, "ds_shape", weight.shape)[0]  # a ZeRO-3 partition keeps its full shape there
        return scan_labels_ahead(labels, IGNORE_INDEX, int(vocab))

    def _liger_head(self, model: nn.Module) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(weight, bias) of ``model``'s LM head; DTensor shards are gathered by the loss engine."""
        return lm_head_params(unwrap_causal_lm(model))

    def _liger_return(self, model: nn.Module, model_kwargs: Dict[str, Any], loss: torch.Tensor,
                      return_outputs: bool):
        """``loss``, or ``(loss, outputs)`` for TRL's deprecated ``return_outputs`` path: the model's outputs
        (logits for ``compute_metrics``) by one extra no-grad forward."""
        if return_outputs:
            with torch.no_grad():
                outputs = model(**model_kwargs)
            return loss, outputs
        return loss

    # -- metrics

    @property
    def _liger_pending(self) -> DeferredMetrics:
        """This trainer's queue of metric values not read on the host yet (:mod:`.metrics`)."""
        pending = self.__dict__.get("_liger_pending_metrics")
        if pending is None:
            pending = self.__dict__["_liger_pending_metrics"] = DeferredMetrics()
        return pending

    def _liger_defer(self, values, then: Callable[[List[float]], None]) -> None:
        """Queue ``values`` (a ``[K]`` tensor, 0-d tensors, or None) for ``then(floats)``, called when the
        metric store is next read (:class:`~liger_losses.trl_integration.metrics.DeferredMetrics`)."""
        self._liger_pending.add(values, then)

    def _liger_gather(self, mode: str, values: Sequence[torch.Tensor], reduction: Union[str, Sequence[str]] = "mean",
                      *, inputs: Optional[Mapping[str, Any]] = None,
                      then: Optional[Callable[[List[float]], None]] = None) -> None:
        """:func:`gather_metric_tensor` of ``values``, queued for ``then(floats)`` (one float per value); with
        ``inputs``, TRL's ``num_tokens`` too, in the same gather: in training this process's token count
        (:meth:`_liger_local_tokens`) is summed over processes and added to the running total, and
        ``num_tokens`` is set to the total in either mode (when the queue is read, before ``then``)."""
        # the queued function must not hold ``inputs``: the batch would stay on the device, one per
        # step, until the metrics are next read (a flag is all it needs)
        has_inputs = inputs is not None
        count = has_inputs and mode == "train"
        if count:
            values = [*values, self._liger_local_tokens(inputs)]
            reduction = ([reduction] * (len(values) - 1) if isinstance(reduction, str) else list(reduction)) + ["sum"]
        reduced = gather_metric_tensor(self.accelerator, values, reduction) if values else None

        def resolved(out: List[float]) -> None:
            if count:
                self._total_train_tokens += int(out.pop()) // self._tp_size
            if has_inputs:
                self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
            if then is not None:
                then(out)

        self._liger_defer(reduced, resolved)

    @staticmethod
    def _liger_local_tokens(inputs: Mapping[str, Any]) -> torch.Tensor:
        """This process's tokens for TRL's ``num_tokens``: the attended ones (``attention_mask``), else the packed
        length (``position_ids``, padding-free batches)."""
        if "attention_mask" in inputs:
            return inputs["attention_mask"].sum()
        if "position_ids" in inputs:
            return torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
        raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")

    def _liger_log(self, mode: str, metrics: Mapping[str, torch.Tensor], names: Mapping[str, str], *,
                   inputs: Optional[Mapping[str, Any]] = None,
                   token_counts: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        """Append each metric of ``metrics`` (0-d tensors) under its TRL name ``names[key]``, averaged over processes
        (keys absent from ``metrics`` are ignored); with ``inputs``, ``num_tokens`` too (:meth:`_liger_gather`).

        A key of ``token_counts`` is a mean over this process's tokens (its count, 0-d): it is reduced as TRL reduces
        it, ``sum(mean * count) / sum(count)`` over processes (0 when no process has a token), not as a mean of the
        processes' means, which differs when the processes hold different numbers of tokens."""
        counts = token_counts or {}
        keys = [key for key in names if key in metrics]
        values, reductions = [], []
        for key in keys:
            if key in counts:
                count = counts[key].to(metrics[key].device, torch.float64)
                values += [metrics[key].detach().double() * count, count]
                reductions += ["sum", "sum"]
            else:
                values.append(metrics[key])
                reductions.append("mean")

        weighted = {key for key in keys if key in counts}  # the queued function holds no tensor

        def append(floats: List[float]) -> None:
            out = iter(floats)
            for key in keys:
                if key in weighted:
                    total, count = next(out), next(out)
                    value = total / count if count > 0 else 0.0
                else:
                    value = next(out)
                self._metrics[mode][names[key]].append(value)

        self._liger_gather(mode, values, reductions, inputs=inputs, then=append)
