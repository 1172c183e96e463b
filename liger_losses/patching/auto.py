"""``AutoLigerModelForCausalLM``: ``AutoModelForCausalLM`` followed by ``apply_liger_kernels``.

``AutoLigerModelForCausalLM.from_pretrained(name_or_path, *model_args, rms_norm=True, rope=True,
swiglu=True, geglu=True, cross_entropy=True, **kwargs)`` reads the config first (so an
unsupported ``model_type`` fails with a ``ValueError`` before any weights are loaded), loads the
model with ``AutoModelForCausalLM.from_pretrained(name_or_path, *model_args, **kwargs)`` and
patches it in place. ``from_config(config, **kwargs)`` does the same for a fresh random model. A composite
config whose text config is a supported family's (Gemma-3 4B+) is accepted: its text model is patched.
"""

from __future__ import annotations

from liger_losses.patching.apply import apply_liger_kernels, family_type
from liger_losses.patching.specs import SUPPORTED_MODEL_TYPES

_CONFIG_KWARGS = (
    "revision",
    "trust_remote_code",
    "token",
    "cache_dir",
    "local_files_only",
    "subfolder",
)


def _check_model_type(config) -> None:
    """A supported family's config, or a composite config (Gemma-3 4B+, which ``AutoModelForCausalLM`` loads as
    ``Gemma3ForConditionalGeneration``) whose text config is one: its text model is patched."""
    if family_type(config) is None:
        raise ValueError(
            f"config.model_type must be one of {SUPPORTED_MODEL_TYPES} (or a composite config's text config), "
            f"got {getattr(config, 'model_type', None)!r}"
        )


class AutoLigerModelForCausalLM:
    """Load a causal LM with liger_losses kernels patched in. Not instantiable; use the classmethods."""

    def __init__(self, *args, **kwargs):
        raise EnvironmentError(
            "AutoLigerModelForCausalLM is built with AutoLigerModelForCausalLM.from_pretrained(...) "
            "or AutoLigerModelForCausalLM.from_config(...)"
        )

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path,
        *model_args,
        rms_norm: bool = True,
        rope: bool = True,
        swiglu: bool = True,
        geglu: bool = True,
        cross_entropy: bool = True,
        **kwargs,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = kwargs.get("config")
        if config is None or isinstance(config, str):
            source = pretrained_model_name_or_path if config is None else config
            config = AutoConfig.from_pretrained(
                source, **{k: kwargs[k] for k in _CONFIG_KWARGS if k in kwargs}
            )
        _check_model_type(config)
        model = AutoModelForCausalLM.from_pretrained(
            pretrained_model_name_or_path, *model_args, **kwargs
        )
        return apply_liger_kernels(
            model, rms_norm=rms_norm, rope=rope, swiglu=swiglu, geglu=geglu, cross_entropy=cross_entropy
        )

    @classmethod
    def from_config(
        cls,
        config,
        *,
        rms_norm: bool = True,
        rope: bool = True,
        swiglu: bool = True,
        geglu: bool = True,
        cross_entropy: bool = True,
        **kwargs,
    ):
        from transformers import AutoModelForCausalLM

        _check_model_type(config)
        model = AutoModelForCausalLM.from_config(config, **kwargs)
        return apply_liger_kernels(
            model, rms_norm=rms_norm, rope=rope, swiglu=swiglu, geglu=geglu, cross_entropy=cross_entropy
        )
