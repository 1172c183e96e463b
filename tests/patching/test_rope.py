"""The RoPE replacement keeps the signature of the function it replaces (fp32, 1e-5).

fp32 bar 1e-5 (tests/helpers.TOL): the kernel and HF's rotate-half formula differ by rounding only.
"""

import inspect

import pytest
import torch

from liger_losses.patching.families import FAMILIES
from liger_losses.patching.rope import (
    liger_rotary_pos_emb,
    liger_rotary_pos_emb_with_position_ids,
    make_rotary_replacement,
)
from tests.helpers import TOL, assert_close_rel
from tests.patching.tiny_models import tiny_config


def _hf_new(q, k, cos, sin, unsqueeze_dim=1):
    raise AssertionError("signature only")


def _hf_old(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    raise AssertionError("signature only")


def test_signature_follows_original():
    """transformers 5.x (no position_ids) and older (position_ids 5th) signatures are mirrored."""
    assert make_rotary_replacement(_hf_new) is liger_rotary_pos_emb
    assert make_rotary_replacement(_hf_old) is liger_rotary_pos_emb_with_position_ids


def test_partial_rotary_matches_phi3():
    """cos/sin narrower than the head (Phi-3 partial rotary): equals HF's phi3 function (1e-5),
    called both ways (new and old signatures, unsqueeze_dim=1)."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as hf

    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    angles = torch.randn(2, 5, 4).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()
    want_q, want_k = hf(q, k, cos, sin)
    for got_q, got_k in (
        liger_rotary_pos_emb(q, k, cos, sin),
        liger_rotary_pos_emb_with_position_ids(q, k, cos, sin, None, 1),
    ):
        assert_close_rel(got_q, want_q, TOL[torch.float32], "q")
        assert_close_rel(got_k, want_k, TOL[torch.float32], "k")


def test_inplace_families_and_switch():
    """Llama-like families get the in-place replacement, Phi-3 (q/k slices of one qkv) does not; the
    in-place replacement rotates in the projection's memory while ``ROPE_PATCH.current.inplace`` is
    True and out of place
    when it is switched off, with the same values as HF's llama function (fp32, 1e-5)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_llama
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as hf_phi3

    import liger_losses.patching.rope as prope

    fn = make_rotary_replacement(hf_llama)
    assert fn is prope.liger_rotary_pos_emb_inplace
    assert make_rotary_replacement(hf_phi3) is liger_rotary_pos_emb
    angles = torch.randn(2, 5, 8).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()
    for inplace in (True, False):
        lin_q, lin_k = torch.randn(2, 5, 4 * 16), torch.randn(2, 5, 2 * 16)
        q, k = lin_q.view(2, 5, 4, 16).transpose(1, 2), lin_k.view(2, 5, 2, 16).transpose(1, 2)
        want_q, want_k = hf_llama(q, k, cos, sin)
        with prope.ROPE_PATCH.override(inplace=inplace):
            got_q, got_k = fn(q, k, cos, sin)
        assert (got_q.data_ptr() == lin_q.data_ptr()) == inplace
        assert_close_rel(got_q, want_q, TOL[torch.float32], "q")
        assert_close_rel(got_k, want_k, TOL[torch.float32], "k")


ROPE_TYPES = {  # rope_scaling of the config (None: the default rotary)
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    # factor lists: one per frequency, filled in by the test for the family's rotary dim
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("rope_type", list(ROPE_TYPES))
@pytest.mark.parametrize("model_type", sorted(m for m in FAMILIES if FAMILIES[m].rope))
def test_family_tables_repeat_their_first_half(model_type, rope_type):
    """The patched models rotate with repeated_tables=True (RoPEPatchConfig.repeated_tables), which reads only the
    first half of each cos/sin row: that is exact only because every family's rotary embedding builds
    cos/sin as cat(freqs, freqs). Checked here on the rotary module of each family whose RoPE is patched, for each
    rope type (positions past the original context included): the halves are bitwise equal."""
    import importlib

    import liger_losses.patching.rope as prope

    assert prope.ROPE_PATCH.current.repeated_tables is True
    overrides = {} if ROPE_TYPES[rope_type] is None else {"rope_scaling": dict(ROPE_TYPES[rope_type])}
    if rope_type == "longrope":
        base = tiny_config(model_type)
        head_dim = getattr(base, "head_dim", None) or base.hidden_size // base.num_attention_heads
        partial = getattr(base, "partial_rotary_factor", None)  # GLM-4-MoE keeps it in rope_parameters
        partial = partial or (getattr(base, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
        n_freqs = int(head_dim * partial) // 2
        overrides["rope_scaling"].update(short_factor=[1.0 + i for i in range(n_freqs)],
                                         long_factor=[2.0 + 3 * i for i in range(n_freqs)])
    try:
        config = tiny_config(model_type, **overrides)
    except Exception as exc:  # noqa: BLE001 - a rope type this family's config rejects
        pytest.skip(f"{model_type} does not take rope_scaling {rope_type}: {exc}")
    module = importlib.import_module(FAMILIES[model_type].module)
    rotary_classes = [c for n, c in vars(module).items() if n.endswith("RotaryEmbedding") and isinstance(c, type)]
    assert rotary_classes, f"no *RotaryEmbedding class in {FAMILIES[model_type].module}"
    x = torch.zeros(2, 7, config.hidden_size)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [40, 41, 90, 91, 92, 93, 200]])
    for cls in rotary_classes:
        rotary = cls(config=config)
        # Gemma-3's rotary keeps one table per layer type (sliding layers have their own base)
        by_type = "layer_type" in inspect.signature(rotary.forward).parameters
        for layer_type in sorted(set(config.layer_types)) if by_type else [None]:
            cos, sin = rotary(x, positions, layer_type) if by_type else rotary(x, positions)
            half = cos.shape[-1] // 2
            assert cos.shape[-1] % 2 == 0
            assert torch.equal(cos[..., :half], cos[..., half:]), f"{cls.__name__} cos halves differ"
            assert torch.equal(sin[..., :half], sin[..., half:]), f"{cls.__name__} sin halves differ"


def _hub_wrapped(fn):
    """What transformers' ``@use_kernel_forward_from_hub`` makes of a function when the ``kernels``
    package is installed: an ``nn.Module`` instance whose ``forward(*args, **kwargs)`` calls the
    function it closes over (``func``), as ``kernels``' ``_create_func_module`` builds it."""

    def build(func):
        class Func(torch.nn.Module):
            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)

        return Func()

    return build(fn)


def test_replacement_sees_through_a_hub_kernel_wrapper():
    """A hub-wrapped original (signature ``(*args, **kwargs)``, module ``kernels``'): the
    replacement follows the wrapped function's signature and family (llama: in place), and the
    family check accepts it; a wrapper around another signature is still refused."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_llama

    import liger_losses.patching.rope as prope
    from liger_losses.patching.checks import _parameters

    plain = prope.underlying_function(hf_llama)  # the plain function, whether or not kernels wrapped it
    assert list(_parameters(plain))[:4] == ["q", "k", "cos", "sin"]
    wrapped = _hub_wrapped(plain)
    assert list(inspect.signature(wrapped).parameters) == ["args", "kwargs"]
    assert prope.underlying_function(wrapped) is plain
    assert make_rotary_replacement(wrapped) is make_rotary_replacement(plain) is prope.liger_rotary_pos_emb_inplace
    assert make_rotary_replacement(_hub_wrapped(_hf_old)) is liger_rotary_pos_emb_with_position_ids
    assert prope.underlying_function(_hf_new) is _hf_new


def test_family_check_accepts_hub_wrapped_rope_and_refuses_other_signatures():
    """The module check reads a hub-wrapped ``apply_rotary_pos_emb`` through its wrapper: llama's
    passes, a wrapped function of another signature raises naming it."""
    from transformers.models.llama import modeling_llama as ml

    import liger_losses.patching.rope as prope
    from liger_losses.patching import FamilyMismatchError
    from liger_losses.patching.checks import check_module
    from liger_losses.patching.core import patch_family
    from tests.patching.test_checks import FLAGS, _fake_llama_module, _spec

    bad = "tests_fake_modeling_hub_wrapped_bad"
    _fake_llama_module(bad, apply_rotary_pos_emb=_hub_wrapped(lambda x, freqs: x))
    with pytest.raises(FamilyMismatchError, match=r"apply_rotary_pos_emb is not \(q, k, cos, sin"):
        patch_family(_spec(bad), None, **FLAGS)
    good = _fake_llama_module("tests_fake_modeling_hub_wrapped_good",
                              apply_rotary_pos_emb=_hub_wrapped(prope.underlying_function(ml.apply_rotary_pos_emb)))
    check_module(_spec("tests_fake_modeling_hub_wrapped_good"), good, rope=True, mlp=True, cross_entropy=True,
                 originals=lambda attr: getattr(good, attr))
