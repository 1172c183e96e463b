"""Tests of the checked-signature shortcut (``kernels/utils.py``: ``CheckedSignatures``) as the layer
kernels use it (RMSNorm, SwiGLU/GeGLU, RoPE): a call whose signature passed the checks once skips
them, so every test here first makes a good call and then asserts that a bad one of the same kind
still raises the error the checks give, and that a change of what the implementation choice reads
(the ``impl`` switch, ``TRITON_INTERPRET``) is seen. Values are compared exactly (same kernels).
"""

import pytest
import torch

from liger_losses.kernels import gated
from liger_losses.kernels import rms_norm as rms_norm_module
from liger_losses.kernels import rope as rope_module
from liger_losses.kernels.geglu import geglu
from liger_losses.kernels.rms_norm import rms_norm
from liger_losses.kernels.rope import apply_rotary_pos_emb
from liger_losses.kernels.swiglu import swiglu
from liger_losses.kernels.utils import CheckedSignatures, layout_signature, owns_buffer, tensor_signature


def test_signatures_of_plain_tensors_only():
    x = torch.randn(2, 3, 8)
    assert tensor_signature(x) == (torch.float32, x.device, 3, 8)
    assert tensor_signature(torch.nn.Parameter(torch.ones(8))) == (torch.float32, x.device, 1, 8)
    assert tensor_signature(None) == ()
    assert tensor_signature([1.0]) is None

    class Sub(torch.Tensor):
        pass

    assert tensor_signature(x.as_subclass(Sub)) is None  # subclasses are checked every call
    assert layout_signature(x) == (torch.float32, x.device, torch.Size([2, 3, 8]))


def test_key_is_none_for_unplain_parts_and_the_cache_is_bounded():
    seen = CheckedSignatures(maxsize=2)
    assert seen.key(1, None) is None
    seen.remember(None, "triton")  # ignored
    for i in range(3):
        seen.remember(seen.key(i), i)
    assert seen.get(seen.key(2)) == 2  # full -> forgotten, then collected anew
    assert seen.get(seen.key(0)) is None


def test_rms_norm_checks_after_a_remembered_call():
    x, w = torch.randn(4, 16), torch.ones(16)
    rms_norm(x, w)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, eps=-1.0)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(8))
    with pytest.raises(TypeError, match="hidden"):
        rms_norm(x.tolist(), w)
    with pytest.raises(ValueError, match="casting_mode"):
        rms_norm(x, w, casting_mode="bogus")


def test_rms_norm_follows_impl_and_the_interpreter_switch(monkeypatch):
    x, w = torch.randn(4, 16), torch.ones(16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    via_triton = rms_norm(x, w, impl="auto")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # no GPU, no interpreter: only the torch path runs here
    if x.device.type == "cpu":
        with pytest.raises(RuntimeError, match="impl='triton' cannot run here"):
            rms_norm(x, w, impl="triton")
    torch.testing.assert_close(rms_norm(x, w, impl="auto"), via_triton, rtol=1e-6, atol=1e-6)


def test_rms_norm_without_grad_skips_the_function_and_matches_it():
    x, w = torch.randn(3, 5, 32), torch.nn.Parameter(torch.randn(32))
    with torch.no_grad():
        plain = rms_norm(x, w, impl="triton")
    assert plain.grad_fn is None
    tracked = rms_norm(x, w, impl="triton")
    assert tracked.grad_fn is not None
    assert torch.equal(plain, tracked.detach())


@pytest.mark.parametrize("fn", [swiglu, lambda g, u, **kw: geglu(g, u, **kw)])
def test_gated_checks_after_a_remembered_call(fn):
    gate, up = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    fn(gate, up)
    with pytest.raises(ValueError, match="same shape"):
        fn(gate, torch.randn(2, 4, 16))
    with pytest.raises(TypeError, match="dtype"):
        fn(gate, up.double())
    with pytest.raises(TypeError, match="inplace_backward"):
        fn(gate, up, inplace_backward=1)
    with pytest.raises(TypeError, match="up"):
        fn(gate, None)


def test_geglu_checks_its_option_after_a_remembered_call():
    gate, up = torch.randn(4, 16), torch.randn(4, 16)
    geglu(gate, up, approximate="tanh")
    with pytest.raises(ValueError, match="approximate"):
        geglu(gate, up, approximate="erf")


def test_gated_contiguous_and_strided_inputs_agree():
    """The flat launch (contiguous gate/up) and the 2-D one (strided halves) give equal values and
    gradients."""
    gu = torch.randn(6, 32, requires_grad=True)
    gate_s, up_s = gu[:, :16], gu[:, 16:]  # strided rows
    gate_c, up_c = gate_s.detach().clone().requires_grad_(), up_s.detach().clone().requires_grad_()
    out_s, out_c = swiglu(gate_s, up_s, impl="triton"), swiglu(gate_c, up_c, impl="triton")
    assert torch.equal(out_s, out_c)
    g = torch.randn_like(out_c)
    out_s.backward(g)
    out_c.backward(g)
    assert torch.equal(gu.grad[:, :16], gate_c.grad) and torch.equal(gu.grad[:, 16:], up_c.grad)


def test_rope_checks_after_a_remembered_call():
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    cos, sin = torch.randn(1, 8, 16), torch.randn(1, 8, 16)
    apply_rotary_pos_emb(q, k, cos, sin)
    with pytest.raises(ValueError, match="k must have shape"):
        apply_rotary_pos_emb(q, torch.randn(1, 2, 7, 16), cos, sin)
    with pytest.raises(ValueError, match="needs inplace=True"):
        apply_rotary_pos_emb(q, k, cos, sin, inplace_backward=True)
    with pytest.raises(TypeError, match="repeated_tables"):
        apply_rotary_pos_emb(q, k, cos, sin, repeated_tables=1)
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=3)


def test_rope_gathered_tables_are_checked_every_call():
    """2-D tables indexed by position_ids are never remembered: their ids are range-checked per call."""
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    table = torch.randn(8, 16)
    ids = torch.arange(8)[None]
    apply_rotary_pos_emb(q, k, table, table, ids)
    with pytest.raises(ValueError, match="position_ids must be in"):
        apply_rotary_pos_emb(q, k, table, table, ids + 1)


def test_the_caches_stay_small_over_many_shapes():
    for n in range(1, 40):
        rms_norm(torch.randn(n, 16), torch.ones(16))
    assert len(rms_norm_module._CHECKED._seen) <= rms_norm_module._CHECKED.maxsize
    assert len(gated._CHECKED._seen) <= gated._CHECKED.maxsize
    assert len(rope_module._CHECKED._seen) <= rope_module._CHECKED.maxsize


def test_owns_buffer_of_a_whole_contiguous_tensor():
    leaf = torch.randn(4, 8, requires_grad=True)
    inter = leaf * 2
    assert owns_buffer(inter) and not owns_buffer(leaf)
    assert not owns_buffer(leaf.view(32))  # a view of a leaf: the leaf's buffer behind it
    assert owns_buffer(inter.view(2, 16))


def test_options_of_other_types_are_checked_every_call():
    """Lists, arrays and tensors given as options are never part of a key: the checks see them (a
    tensor changed in place after a good call is not taken for the value it had)."""
    x, w = torch.randn(4, 16), torch.ones(16)
    rms_norm(x, w)
    with pytest.raises(ValueError, match="casting_mode"):
        rms_norm(x, w, casting_mode=["llama"])
    with pytest.raises(ValueError, match="impl"):
        rms_norm(x, w, impl=["auto"])
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    cos, sin = torch.randn(1, 8, 16), torch.randn(1, 8, 16)
    dim = torch.tensor(1)
    apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=dim)
    dim.fill_(7)
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=dim)


def test_error_order_is_the_checks_order():
    """With two bad arguments the first check's error is raised, as without the shortcut."""
    gate, up = torch.randn(4, 16), torch.randn(4, 16)
    with pytest.raises(ValueError, match="approximate"):
        geglu(gate, up, approximate="bad", inplace_backward=1)
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    cos = torch.randn(1, 8, 16, requires_grad=True)
    with pytest.raises(ValueError, match="cos and sin must not require grad"):
        apply_rotary_pos_emb(q, k, cos, cos.detach(), inplace=1, impl="triton")


@pytest.mark.parametrize("grad_mode", [True, False])
def test_forward_mode_ad_is_not_dropped(grad_mode):
    """A dual tensor does not require grad; the no-graph shortcuts must still go through the
    autograd Function, which has no jvp and says so, instead of returning a tangent-less output."""
    import torch.autograd.forward_ad as fwAD

    x, w = torch.randn(4, 16), torch.ones(16)
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    cos, sin = torch.randn(1, 8, 16), torch.randn(1, 8, 16)
    with torch.set_grad_enabled(grad_mode), fwAD.dual_level():
        with pytest.raises(NotImplementedError):
            rms_norm(fwAD.make_dual(x, torch.ones_like(x)), w, impl="triton")
        with pytest.raises(NotImplementedError):
            apply_rotary_pos_emb(fwAD.make_dual(q, torch.ones_like(q)), k, cos, sin, impl="triton")
        plain = rms_norm(x, w, impl="triton")  # no dual input: the Function runs as usual
    assert torch.equal(plain, rms_norm(x, w, impl="triton").detach())
