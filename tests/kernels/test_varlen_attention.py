"""``kernels/varlen_attention.py``: causal attention over packed sequences against a float64 formula.

The formula is the masked one a padded batch uses: one ``[N, N]`` score matrix per head with every
pair outside "same sequence, key not after query" (and, with a sliding window ``w``, "query - key < w",
transformers' window) set to -inf, then softmax and the value sum, with each query head reading
key/value head ``h // group``. The reference path (per-sequence SDPA) must
match it to 1e-12 in float64 (the same math in another order), forward and every input gradient.
On the GPU (``-m gpu``) the flash varlen path in bf16 must match the float64 formula to 1e-2
relative (bf16's 8 bits of mantissa in the inputs and the output), gradients included.
"""

import pytest
import torch

from liger_losses.kernels.varlen_attention import (
    flash_usable,
    reference_varlen_attention,
    varlen_causal_attention,
)
from tests.helpers import rel_err


def _formula(query, key, value, cu_seqlens, scale, window=None):
    n, heads, dim = query.shape
    group = heads // key.shape[1]
    seq = torch.zeros(n, dtype=torch.long)
    for s, (a, b) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        seq[a:b] = s
    idx = torch.arange(n)
    allowed = (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None])
    if window is not None:
        allowed &= idx[:, None] - idx[None, :] < window
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, k) * (dim ** -0.5 if scale is None else scale)
    probs = scores.masked_fill(~allowed.to(query.device), float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _inputs(lengths, heads=4, kv_heads=2, dim=16, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    tensors = [torch.randn(n, h, dim, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads)]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in tensors], cu


@pytest.mark.parametrize("lengths,heads,kv_heads,scale,window", [
    ([5, 1, 7], 4, 2, None, None),
    ([3, 0, 6, 2], 6, 1, 0.3, None),  # an empty sequence, multi-query
    ([9], 2, 2, None, None),          # one sequence, no grouping
    ([5, 1, 7], 4, 2, None, 3),       # a sliding window shorter than two sequences
    ([3, 0, 6, 2], 6, 1, 0.3, 1),     # a window of one: each token attends to itself
    ([5, 2], 4, 2, None, 5),          # a window no sequence exceeds: plain causal
])
def test_reference_equals_the_masked_formula(lengths, heads, kv_heads, scale, window):
    (q, k, v), cu = _inputs(lengths, heads, kv_heads)
    out = varlen_causal_attention(q, k, v, cu, max(lengths), scale=scale, window=window)
    ref = _formula(q, k, v, cu, scale, window)
    assert rel_err(out, ref) <= 1e-12
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for name, a, b in zip("qkv", got, want):
        assert rel_err(a, b) <= 1e-12, name


def test_bad_inputs_raise_naming_the_argument():
    (q, k, v), cu = _inputs([4, 4])
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        varlen_causal_attention(q, k[:, :1].expand(8, 3, 16), v[:, :1].expand(8, 3, 16), cu, 4)
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        varlen_causal_attention(q, k, v, cu.long(), 4)
    with pytest.raises(ValueError, match="max_seqlen"):
        varlen_causal_attention(q, k, v, cu, 0)
    with pytest.raises(ValueError, match=r"\[N, heads, D\]"):
        varlen_causal_attention(q[None], k, v, cu, 4)
    with pytest.raises(ValueError, match="key and value"):
        varlen_causal_attention(q, k[:7], v[:7], cu, 4)
    with pytest.raises(ValueError, match="rise from 0 to N = 8"):
        varlen_causal_attention(q, k, v, torch.tensor([0, 2, 4], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="rise from 0 to N = 8"):
        varlen_causal_attention(q, k, v, torch.tensor([0, 6, 2, 8], dtype=torch.int32), 6)
    with pytest.raises(ValueError, match=r"max_seqlen \(3\) is below the longest sequence \(4\)"):
        varlen_causal_attention(q, k, v, cu, 3)
    for window in (0, 2.0, True):
        with pytest.raises(ValueError, match="window must be None or a positive int"):
            varlen_causal_attention(q, k, v, cu, 4, window=window)


def test_no_tokens_attend_to_nothing():
    (q, k, v), _ = _inputs([2])
    cu = torch.tensor([0, 0], dtype=torch.int32)
    out = varlen_causal_attention(q[:0], k[:0], v[:0], cu, 1)
    assert out.shape == (0, 4, 16)


def test_cpu_takes_the_reference_path():
    (q, k, v), cu = _inputs([3, 5], dtype=torch.bfloat16)
    assert not flash_usable(q, k, v)
    out = varlen_causal_attention(q, k, v, cu, 5)
    assert torch.equal(out, reference_varlen_attention(q, k, v, cu))


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads,dim,window", [(12, 2, 128, None), (8, 8, 64, None), (8, 4, 256, 300)])
def test_flash_path_matches_the_formula(heads, kv_heads, dim, window):
    lengths = [700, 1, 0, 333, 1024]
    (q, k, v), cu = _inputs(lengths, heads, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    assert flash_usable(q, k, v)
    out = varlen_causal_attention(q, k, v, cu.cuda(), max(lengths), window=window)
    assert out.dtype == torch.bfloat16
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _formula(q64, k64, v64, cu, None, window)
    assert rel_err(out, ref) <= 1e-2
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    want = torch.autograd.grad(ref, (q64, k64, v64), grad)
    for name, a, b in zip("qkv", got, want):
        assert rel_err(a, b) <= 1e-2, name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_dropout_drops_attention_weights_and_backward_replays_them(device):
    """Attention dropout (what a packed training call with ``attention_dropout`` runs): with each value row the
    one-hot of its position in its sequence, the output rows are the attention matrix's rows, so the test reads the
    matrix ``A`` the call drew. Each weight is dropped with probability p = 0.2 (the dropped fraction of the
    causal pairs within 0.03 of p: 0.0035 is its standard deviation at these sizes) and the kept ones are the
    undropped weights scaled by 1 / (1 - p); the value gradient is ``A^T grad`` of that same ``A`` (the backward
    drew the forward's mask). Tolerances: 1e-12 in float64 on the CPU (the reference attention), 2e-2 in bf16 on
    CUDA (the flash kernel)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA")
    lengths, heads, kv_heads, dim, p = [40, 23, 64], 4, 2, 64, 0.2
    dtype, tol = (torch.float64, 1e-12) if device == "cpu" else (torch.bfloat16, 2e-2)
    (q, k, _), cu = _inputs(lengths, heads, kv_heads, dim, dtype=dtype, device=device)
    starts = cu[:-1].tolist()
    position = torch.cat([torch.arange(n) for n in lengths])
    v = torch.nn.functional.one_hot(position, dim)[:, None, :].expand(-1, kv_heads, -1)
    v = v.to(device=device, dtype=dtype).contiguous().requires_grad_()
    cu = cu.to(device)
    if device == "cuda":
        assert flash_usable(q, k, v)
    with torch.no_grad():
        undropped = varlen_causal_attention(q, k, v, cu, max(lengths)).double()
    torch.manual_seed(3)
    out = varlen_causal_attention(q, k, v, cu, max(lengths), dropout_p=p)
    grad = torch.randn(out.shape, dtype=torch.float64, device=device)
    got_v = torch.autograd.grad(out, v, grad.to(out.dtype))[0].double()
    drawn = out.detach().double()
    dropped = kept = 0
    want_v = torch.zeros_like(got_v)
    group = heads // kv_heads
    for start, n in zip(starts, lengths):
        rows = slice(start, start + n)
        a = drawn[rows, :, :n]                       # [n queries, heads, n keys]: the drawn matrix
        a0 = undropped[rows, :, :n]
        pairs = torch.ones(n, n, dtype=torch.bool, device=device).tril()[:, None, :].expand(-1, heads, -1)
        assert not a[~pairs].any()
        zero = (a == 0) & pairs
        dropped += int(zero.sum())
        kept += int((pairs & ~zero).sum())
        live = pairs & ~zero & (a0 != 0)
        assert rel_err(a[live], a0[live] / (1 - p)) <= tol
        contrib = torch.einsum("qhk,qhd->khd", a, grad[rows])  # [n keys, heads, dim]
        want_v[rows] = contrib.reshape(n, kv_heads, group, dim).sum(2)
    assert abs(dropped / (dropped + kept) - p) <= 0.03
    assert rel_err(got_v, want_v) <= tol
