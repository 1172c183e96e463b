"""Tests of liger_losses/chunked/planning.py and config.py without tensors: the sequence driver's
plan (one pass / two phases / recompute) from token counts alone, and the engine's tuning knobs
through ``engine_config``. Plans are integer bounds: compared exactly."""

import pytest

from liger_losses.chunked.config import EngineConfig, engine_config, get_engine_config
from liger_losses.chunked.planning import plan_sequence_passes, tile_budget, token_chunks, unit_order

V, H, ITEM = 100, 8, 4


def plan(counts, **kw):
    kw.setdefault("group_size", 2)
    kw.setdefault("separable", True)
    return plan_sequence_passes(counts, vocab=V, hidden_size=H, itemsize=ITEM, **kw)


def test_unit_order_interleaves_pairs():
    """Pairs of a [chosen; rejected] batch of 6: c0, r0, c1, r1, c2, r2; sequences stay in order."""
    assert unit_order(6, 2) == [0, 3, 1, 4, 2, 5]
    assert unit_order(3, 1) == [0, 1, 2]


def test_separable_units_that_fit_run_in_one_pass():
    """Pairs of 7 tokens with 10-token chunks: one chunk per pair, no recompute."""
    p = plan([3, 4, 2, 5], chunk_tokens=10)
    assert p.mode == "one_pass"
    assert p.unit_chunks == ((0, 1, 0, 7), (1, 2, 7, 14))
    assert p.recompute_chunks == () and p.exempt_chunks == ()


def test_non_separable_objective_takes_two_phases_with_the_longest_sequence_exempt():
    """separable=False, sequences of 3, 9, 2 tokens, 4-token chunks: the 9-token sequence's tiles are
    back-propagated in phase 1 (chunked apart), the others recomputed."""
    p = plan([3, 9, 2], group_size=1, separable=False, chunk_tokens=4)
    assert p.mode == "recompute"
    assert p.exempt_position == 1 and p.exempt_tokens == (3, 12, 12) and p.rejected_ratio is None
    assert p.exempt_chunks == ((3, 7), (7, 11), (11, 12))
    assert p.recompute_chunks == ((0, 3), (12, 14))


def test_a_pair_with_a_gradient_ratio_is_exempt_as_a_whole():
    """Unit order [c0, r0, c1, r1] = [3, 2, 6, 5] with 4-token chunks cuts pair 1 (11 tokens); with
    ``pair_gradient_ratio = -1`` the whole pair is exempt (rejected side from token 11), else only
    its longest sequence."""
    p = plan([3, 2, 6, 5], chunk_tokens=4, pair_gradient_ratio=lambda c, r: -1.0)
    assert p.mode == "recompute" and p.exempt_position == 2 and p.rejected_ratio == -1.0
    assert p.exempt_tokens == (5, 11, 16)
    assert p.exempt_chunks == ((5, 9), (9, 13), (13, 16)) and p.recompute_chunks == ((0, 4), (4, 5))
    seen = []
    q = plan([3, 2, 6, 5], chunk_tokens=4, pair_gradient_ratio=lambda c, r: seen.append((c, r)))
    assert seen == [(6, 5)]  # asked for the longest pair's lengths
    assert q.exempt_position == 2 and q.exempt_tokens == (5, 11, 11) and q.rejected_ratio is None


def test_a_single_exempt_pair_recomputes_nothing():
    """One pair larger than a chunk, exempt as a whole: two phases, no tile recomputed."""
    p = plan([6, 5], chunk_tokens=4, pair_gradient_ratio=lambda c, r: -c / r)
    assert p.mode == "two_phase" and p.recompute_chunks == ()
    assert p.exempt_chunks == ((0, 4), (4, 8), (8, 11)) and p.rejected_ratio == pytest.approx(-6 / 5)


def test_a_unit_over_the_default_budget_stays_one_pass_within_the_unit_budget():
    """Tile budget of 8 tokens (default_budget_bytes = 8 V * itemsize, no weight share): a 10-token
    pair still runs in one pass under unit_budget_factor=4 (32 tokens), not under 1; an explicit
    chunk_tokens is never widened."""
    with engine_config(default_budget_bytes=8 * V * ITEM, weight_budget_fraction=0.0):
        assert tile_budget(V, H, ITEM) == 8 * V * ITEM
        assert plan([6, 4]).mode == "one_pass"
        with engine_config(unit_budget_factor=1):
            assert plan([6, 4]).mode == "recompute"
        assert plan([6, 4], chunk_tokens=8).mode == "recompute"


def test_empty_batch_plans_no_chunk():
    assert plan([], chunk_tokens=4).unit_chunks == ()
    p = plan([], group_size=1, separable=False, chunk_tokens=4)
    assert p.exempt_position is None and p.exempt_chunks == () and p.recompute_chunks == ()


def test_engine_config_blocks_closed_out_of_order_leave_the_defaults():
    """Two blocks opened and closed interleaved (as two threads may: the configuration is
    process-wide so that autograd's device threads see it) each take back their own changes: while
    only the second is open its knob alone is in force, and once both closed the defaults are."""
    default = get_engine_config()
    first = engine_config(half_weight_accum_dtype=None)
    second = engine_config(speculative_first_chunk=False)
    first.__enter__()
    second.__enter__()
    assert get_engine_config() == EngineConfig(half_weight_accum_dtype=None, speculative_first_chunk=False)
    first.__exit__(None, None, None)
    assert get_engine_config() == EngineConfig(speculative_first_chunk=False)
    second.__exit__(None, None, None)
    assert get_engine_config() == default
    with engine_config(default_budget_bytes=7):  # nested blocks: the inner one's knob wins inside
        with engine_config(default_budget_bytes=9, chunk_align=1) as inner:
            assert get_engine_config() is inner and inner.default_budget_bytes == 9
        assert get_engine_config() == EngineConfig(default_budget_bytes=7)
    assert get_engine_config() == default


@pytest.mark.timeout(60)
def test_engine_config_block_closed_by_the_garbage_collector_inside_another(monkeypatch):
    """A block abandoned in a reference cycle is closed by the garbage collector, which may run inside
    another block's own update of the configuration (here forced at its first ``dataclasses.replace``):
    no deadlock, and the abandoned block's change is gone once collected."""
    import dataclasses
    import gc

    from liger_losses.chunked import config

    class Holder:
        pass

    def abandon():
        holder = Holder()
        holder.me = holder
        holder.block = engine_config(chunk_align=64)
        holder.block.__enter__()

    real = dataclasses.replace

    def replace_after_collecting(*args, **kwargs):
        gc.collect()
        return real(*args, **kwargs)

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        abandon()
        assert get_engine_config().chunk_align == 64
        monkeypatch.setattr(config.dataclasses, "replace", replace_after_collecting)
        with engine_config(default_budget_bytes=5):
            cfg = get_engine_config()
            assert cfg.default_budget_bytes == 5 and cfg.chunk_align == EngineConfig().chunk_align
    finally:
        if was_enabled:
            gc.enable()
    assert get_engine_config() == EngineConfig()


def test_engine_config_is_scoped_and_validated():
    """engine_config changes the knobs inside the block only (restored after an exception too);
    unknown knobs raise TypeError, bad values ValueError/TypeError naming the knob."""
    default = get_engine_config()
    assert default == EngineConfig()
    with pytest.raises(RuntimeError):
        with engine_config(speculative_first_chunk=False) as cfg:
            assert get_engine_config() is cfg and not cfg.speculative_first_chunk
            raise RuntimeError
    assert get_engine_config() == default
    with pytest.raises(TypeError):
        with engine_config(speculative_first_chunk_typo=False):
            pass
    with pytest.raises(ValueError, match="default_budget_bytes"):
        EngineConfig(default_budget_bytes=0)
    with pytest.raises(ValueError, match="weight_budget_fraction"):
        EngineConfig(weight_budget_fraction=2.0)
    with pytest.raises(ValueError, match="wide_accum_budget_fraction"):
        EngineConfig(wide_accum_budget_fraction=-0.5)
    with pytest.raises(TypeError, match="device_scale"):
        EngineConfig(device_scale=1)


def test_a_wide_weight_accumulator_takes_the_weights_size_as_tile_budget():
    """A pass whose weight gradient accumulates wider than the weight (fp32 for bf16) plans tiles of
    ``wide_accum_budget_fraction`` (1.0) of the head instead of ``weight_budget_fraction`` (0.5): at
    H=4096, V=128256 in bf16, 4096 tokens a chunk instead of 2048 (the accumulator and its cast
    already hold three times the weight's bytes); the sequence planner follows the same rule."""
    V, H = 128256, 4096
    assert tile_budget(V, H, 2) == V * H
    assert tile_budget(V, H, 2, wide_accum=True) == 2 * V * H
    assert token_chunks(V, H, 2, 16384, None) == [(i, i + 2048) for i in range(0, 16384, 2048)]
    assert token_chunks(V, H, 2, 16384, None, wide_accum=True) == [(i, i + 4096) for i in range(0, 16384, 4096)]
    counts = [1024] * 16
    narrow = plan_sequence_passes(counts, group_size=2, separable=True, vocab=V, hidden_size=H, itemsize=2)
    wide = plan_sequence_passes(counts, group_size=2, separable=True, vocab=V, hidden_size=H, itemsize=2,
                                wide_accum=True)
    assert len(narrow.unit_chunks) == 8 and len(wide.unit_chunks) == 4
    with engine_config(wide_accum_budget_fraction=0.5):
        assert tile_budget(V, H, 2, wide_accum=True) == V * H
