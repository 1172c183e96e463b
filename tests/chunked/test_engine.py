"""Tests of the engine primitives (liger_losses/chunked/engine.py indexes them): chunking, compaction,
projection, gradient GEMMs and
sharded weights, each against a plain PyTorch formula (fp32 1e-5 relative error, or exact where
the operation is a copy). The sequence-objective driver: tests/chunked/test_sequence.py.
"""

import types

import pytest
import torch

from liger_losses.chunked.engine import (
    backprop_tile,
    chunk_bounds,
    compact_tokens,
    gather_weight,
    group_chunk_bounds,
    project,
    weight_grad_like,
)
from tests.helpers import TOL, assert_close_rel

FP32 = TOL[torch.float32]

# ----------------------------------------------------------------------------- primitives


def test_chunk_bounds():
    """Exact chunk_tokens gives fixed-size chunks covering [0, N); the budget gives balanced,
    128-aligned chunks whose tile fits; N=0 gives no chunk."""
    assert chunk_bounds(10, 100, chunk_tokens=3) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert chunk_bounds(0, 100) == []
    b = chunk_bounds(8192, 128256, budget_bytes=512 * 2**20, itemsize=2)
    assert b[0] == (0, 2048) and b[-1][1] == 8192 and len(b) == 4
    from liger_losses.chunked.config import get_engine_config

    for s, e in chunk_bounds(5000, 128256):
        assert (e - s) * 128256 * 2 <= get_engine_config().default_budget_bytes
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunk_bounds(10, 10, chunk_tokens=0)


def test_group_chunk_bounds():
    """Whole groups per chunk, greedily filled; None when one group alone exceeds the limit;
    empty groups are carried along."""
    assert group_chunk_bounds([3, 4, 2, 0, 5], 100, chunk_tokens=7) == [(0, 2, 0, 7), (2, 5, 7, 14)]
    assert group_chunk_bounds([3, 8], 100, chunk_tokens=7) is None
    assert group_chunk_bounds([0, 0], 100, chunk_tokens=7) == [(0, 2, 0, 0)]


def test_compact_tokens():
    """Valid tokens in flattened order with their positions; all-valid input returns a view."""
    h = torch.randn(2, 3, 4)
    labels = torch.tensor([[1, -100, 2], [3, 4, -100]])
    hv, lv, idx = compact_tokens(h, labels, -100)
    assert idx.tolist() == [0, 2, 3, 4] and lv.tolist() == [1, 2, 3, 4] and lv.dtype == torch.long
    assert torch.equal(hv, h.reshape(-1, 4)[idx])
    hv2, _, idx2 = compact_tokens(h, labels.clamp(min=0), -100)
    assert hv2.data_ptr() == h.data_ptr() and idx2.tolist() == list(range(6))
    hv3, lv3, idx3 = compact_tokens(h, torch.full((2, 3), -100), -100)
    assert hv3.shape == (0, 4) and lv3.numel() == 0 and idx3.numel() == 0


def test_project_dtype_and_autocast():
    """project gives hidden @ W.T + b in the weight dtype, and in the autocast dtype under
    torch.autocast (bf16 on the CPU), contiguous."""
    h, w, b = torch.randn(5, 8), torch.randn(11, 8), torch.randn(11)
    out = project(h, w, b)
    assert out.dtype == torch.float32 and out.is_contiguous()
    assert_close_rel(out, h.double() @ w.double().T + b.double(), FP32, "project")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert project(h, w).dtype == torch.bfloat16


@pytest.mark.parametrize("accum", [torch.float32, torch.bfloat16])
def test_backprop_tile(accum):
    """grad_hidden = diag(s) G W, grad_weight accumulates G^T diag(s) h across two calls,
    grad_bias = G^T s; bf16 operands with an fp32 accumulator also work (1e-2 bar in bf16)."""
    G, h, w, s = torch.randn(6, 11), torch.randn(6, 8), torch.randn(11, 8), torch.rand(6)
    dt = accum
    gh, gw, gb = torch.empty(6, 8, dtype=dt), torch.empty(11, 8, dtype=torch.float32), torch.empty(11)
    for i in range(2):
        backprop_tile(G.to(dt), h.to(dt), w.to(dt), grad_hidden=gh, grad_weight=gw, grad_bias=gb,
                      accumulate=i > 0, row_scale=s)
    tol = TOL[dt]
    assert_close_rel(gh, s[:, None].double() * (G.double() @ w.double()), tol, "grad_hidden")
    assert_close_rel(gw, 2 * G.double().T @ (s[:, None].double() * h.double()), tol, "grad_weight")
    assert_close_rel(gb, 2 * G.double().T @ s.double(), tol, "grad_bias")
    backprop_tile(G, h, w, grad_hidden=None, grad_weight=None, grad_bias=None, accumulate=False)


def test_gather_weight_plain_and_zero3():
    """A plain weight passes through both ways; a ZeRO-3 partitioned parameter raises a
    ValueError telling the caller to gather it; a gathered one (AVAILABLE) passes."""
    w = torch.randn(4, 3)
    assert gather_weight(w) is w and weight_grad_like(w, w) is w
    p = torch.nn.Parameter(torch.empty(0))
    p.ds_id, p.ds_status = 3, types.SimpleNamespace(name="NOT_AVAILABLE")
    with pytest.raises(ValueError, match="GatheredParameters"):
        gather_weight(p)
    q = torch.nn.Parameter(torch.randn(4, 3))
    q.ds_id, q.ds_status = 4, types.SimpleNamespace(name="AVAILABLE")
    assert gather_weight(q) is q
