"""Tests of liger_losses/kernels/tuning.py: the kernels' knob slots and their context managers.

Exact checks (no tolerance): which value is current inside and after a block, which errors name
which knob; and one kernel launched inside an override, against the same launch with the knob set
through a whole value (bitwise equal outputs: only the launch configuration differs).
"""

import dataclasses
import threading

import pytest
import torch

import liger_losses  # noqa: F401  (registers every kernel's slot)
from liger_losses.kernels.rms_norm import RMS_NORM_TUNING, rms_norm
from liger_losses.kernels.scale import SCALE_TUNING, ScaleTuning
from liger_losses.kernels.tuning import Knobs, knob, register, registered, tuning

EXPECTED_SLOTS = {
    "rms_norm", "layer_norm", "norm_sum", "swiglu", "geglu", "gated_down", "mlp", "label_stats",
    "logits_tile", "logp_entropy_grad", "divergence_tile", "rope", "scale", "pdl", "rope_patch", "online_block",
}


def test_every_kernel_has_a_slot_with_frozen_knobs():
    """Each kernel's knobs are one frozen dataclass, registered by name; assigning a knob raises."""
    slots = registered()
    assert EXPECTED_SLOTS <= set(slots)
    for name, slot in slots.items():
        assert dataclasses.is_dataclass(slot.current) and slot.current == slot.default, name
        field = dataclasses.fields(slot.current)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(slot.current, field, getattr(slot.current, field))


def test_override_is_restored_even_on_error():
    """Inside ``override`` the changes are current, after it (also after an exception) the previous
    value; nested overrides stack."""
    before = SCALE_TUNING.current
    with SCALE_TUNING.override(block=64) as inside:
        assert SCALE_TUNING.current is inside and inside.block == 64 and inside.num_warps == before.num_warps
        with SCALE_TUNING.override(num_warps=2):
            assert (SCALE_TUNING.current.block, SCALE_TUNING.current.num_warps) == (64, 2)
        assert SCALE_TUNING.current is inside
    assert SCALE_TUNING.current is before
    with pytest.raises(RuntimeError, match="boom"):
        with SCALE_TUNING.override(ScaleTuning(block=128)):
            raise RuntimeError("boom")
    assert SCALE_TUNING.current is before


def test_tuning_sets_several_kernels():
    """``tuning(a=Value, b={changes})`` sets both for the block and restores both."""
    with tuning(scale=ScaleTuning(block=256), rms_norm={"bwd_prefetch": False}):
        assert SCALE_TUNING.current.block == 256
        assert RMS_NORM_TUNING.current.bwd_prefetch is False
    assert SCALE_TUNING.current == SCALE_TUNING.default
    assert RMS_NORM_TUNING.current == RMS_NORM_TUNING.default


def test_bad_knobs_raise_naming_them():
    """Unknown slot / knob: ValueError naming it; wrong type or out of range: TypeError/ValueError
    naming the knob; a whole value of another kernel's class: TypeError."""
    with pytest.raises(ValueError, match="no_such_kernel"):
        with tuning(no_such_kernel={}):
            pass
    with pytest.raises(ValueError, match="blok"):
        with SCALE_TUNING.override(blok=64):
            pass
    with pytest.raises(TypeError, match="ScaleTuning.block"):
        ScaleTuning(block=64.0)
    with pytest.raises(TypeError, match="ScaleTuning.block"):
        ScaleTuning(block=True)
    with pytest.raises(ValueError, match="ScaleTuning.num_warps"):
        ScaleTuning(num_warps=0)
    with pytest.raises(TypeError, match="bwd_prefetch"):
        with RMS_NORM_TUNING.override(bwd_prefetch=1):
            pass
    with pytest.raises(TypeError, match="RMSNorm|NormTuning|rms_norm"):
        with RMS_NORM_TUNING.override(ScaleTuning()):
            pass
    assert SCALE_TUNING.current == SCALE_TUNING.default


def test_other_threads_see_the_override():
    """The value is process-wide: autograd's backward threads (here, a plain thread) read the knobs
    the block set."""
    seen = []
    with SCALE_TUNING.override(block=512):
        t = threading.Thread(target=lambda: seen.append(SCALE_TUNING.current.block))
        t.start()
        t.join()
    assert seen == [512]


def test_knobs_reach_the_launch():
    """RMSNorm forward + backward with a 4-row backward tile set by ``override`` equals the same
    with the whole value set through ``tuning`` bitwise, and the default launch within fp32
    rounding (other tiles sum the weight gradient in another order: 1e-6 relative)."""
    x = torch.randn(37, 50, requires_grad=True)
    w = (torch.rand(50) + 0.5).requires_grad_()

    def step():
        out = rms_norm(x, w, impl="triton")
        return (out, *torch.autograd.grad(out, (x, w), torch.ones_like(out)))

    small = dataclasses.replace(RMS_NORM_TUNING.default, bwd_small_h_tile_elems=4 * 64)
    with RMS_NORM_TUNING.override(bwd_small_h_tile_elems=4 * 64):
        a = step()
    with tuning(rms_norm=small):
        b = step()
    c = step()
    for u, v, r in zip(a, b, c):
        assert torch.equal(u, v)
        torch.testing.assert_close(u, r, rtol=1e-6, atol=1e-6)


def test_a_name_belongs_to_one_kernel():
    """Registering another kernel's knobs under a taken name is a ValueError naming it; ``default``
    must be a Knobs dataclass (TypeError)."""

    @dataclasses.dataclass(frozen=True)
    class OtherTuning(Knobs):
        block: int = knob(1, minimum=1)

    with pytest.raises(ValueError, match="'scale'"):
        register("scale", OtherTuning())
    with pytest.raises(TypeError, match="Knobs"):
        register("not_knobs", {"block": 1})
    assert registered()["scale"] is SCALE_TUNING
