"""The RoPE replacement keeps the signature of the function it replaces (fp32, 1e-5).

fp32 bar 1e-5 (tests/helpers.TOL): the kernel and HF's rotate-half formula differ by rounding only.
"""

import torch

from liger_losses.patching.rope import (
    liger_rotary_pos_emb,
    liger_rotary_pos_emb_with_position_ids,
    make_rotary_replacement,
)
from tests.helpers import TOL, assert_close_rel


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


def test_inplace_families_and_switch(monkeypatch):
    """Llama-like families get the in-place replacement, Phi-3 (q/k slices of one qkv) does not; the
    in-place replacement rotates in the projection's memory while INPLACE is True and out of place
    when it is switched off, with the same values as HF's llama function (fp32, 1e-5)."""
    import liger_losses.patching.rope as prope
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_llama
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as hf_phi3

    fn = make_rotary_replacement(hf_llama)
    assert fn is prope.liger_rotary_pos_emb_inplace
    assert make_rotary_replacement(hf_phi3) is liger_rotary_pos_emb
    angles = torch.randn(2, 5, 8).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()
    for inplace in (True, False):
        monkeypatch.setattr(prope, "INPLACE", inplace)
        lin_q, lin_k = torch.randn(2, 5, 4 * 16), torch.randn(2, 5, 2 * 16)
        q, k = lin_q.view(2, 5, 4, 16).transpose(1, 2), lin_k.view(2, 5, 2, 16).transpose(1, 2)
        want_q, want_k = hf_llama(q, k, cos, sin)
        got_q, got_k = fn(q, k, cos, sin)
        assert (got_q.data_ptr() == lin_q.data_ptr()) == inplace
        assert_close_rel(got_q, want_q, TOL[torch.float32], "q")
        assert_close_rel(got_k, want_k, TOL[torch.float32], "k")
