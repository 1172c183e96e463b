"""Tests of liger_losses/kernels/rope.py: rotary embedding of q and k (HF rotate-half layout).

Accuracy checks compare against the Hugging Face formula evaluated in float64 by relative error
(tests/helpers.py): fp32 <= 1e-5, bf16 <= 1e-2, for q_embed, k_embed, d_q and d_k.
"""

import pytest
import torch

from liger_losses.kernels.rope import apply_rotary_pos_emb, liger_rotary_pos_emb
from tests.helpers import TOL, assert_close_rel

IMPLS = ["triton", "torch"]
DTYPES = [torch.float32, torch.bfloat16]


def _cos_sin(positions, rot, dtype):
    """HF default rotary tables for integer ``positions`` [b, T]: cos/sin [b, T, rot]."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64, device=positions.device) / rot))
    freqs = positions[..., None].double() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _reference(q, k, cos, sin, unsqueeze_dim, gq, gk):
    """HF (phi3-style, partial rotary) formula in float64: outputs and input grads."""
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    c = cos.double().unsqueeze(unsqueeze_dim)
    s = sin.double().unsqueeze(unsqueeze_dim)
    r = c.shape[-1]

    def one(x):
        return torch.cat((x[..., :r] * c + _rotate_half(x[..., :r]) * s, x[..., r:]), dim=-1)

    oq, ok = one(q64), one(k64)
    ((oq * gq.double()).sum() + (ok * gk.double()).sum()).backward()
    return oq, ok, q64.grad, k64.grad


def _make(bsz, seq, n_qh, n_kh, head_dim, rot, cos_batch, unsqueeze_dim, dtype, hf_layout=True):
    """q/k as HF makes them (view [B, T, H, D] then transpose(1, 2) when unsqueeze_dim=1);
    cos/sin for random (not 0..T-1) positions."""
    q = torch.randn(bsz, seq, n_qh, head_dim).to(dtype)
    k = torch.randn(bsz, seq, n_kh, head_dim).to(dtype)
    if unsqueeze_dim == 1:
        q, k = (q.transpose(1, 2), k.transpose(1, 2)) if hf_layout else (
            q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous())
    positions = torch.randint(0, 4096, (cos_batch, seq))
    cos, sin = _cos_sin(positions, rot, dtype)
    return q, k, cos, sin


def _run_and_check(q, k, cos, sin, unsqueeze_dim, impl, dtype, **options):
    q = q.detach().requires_grad_()
    k = k.detach().requires_grad_()
    oq, ok = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, impl=impl, **options)
    gq, gk = torch.randn_like(oq), torch.randn_like(ok)
    ((oq * gq).sum() + (ok * gk).sum()).backward()
    rq, rk, dq, dk = _reference(q, k, cos, sin, unsqueeze_dim, gq, gk)
    assert oq.shape == q.shape and ok.shape == k.shape and oq.dtype == dtype
    tol = TOL[dtype]
    assert_close_rel(oq, rq, tol, "q_embed")
    assert_close_rel(ok, rk, tol, "k_embed")
    assert_close_rel(q.grad, dq, tol, "d_q")
    assert_close_rel(k.grad, dk, tol, "d_k")
    return oq, ok


CASES = {
    # bsz, seq, n_qh, n_kh, head_dim, rot, cos_batch, unsqueeze_dim
    "gqa": (2, 5, 4, 2, 16, 16, 2, 1),
    "batch_broadcast_cos": (3, 4, 4, 4, 32, 32, 1, 1),
    "head_dim_48": (2, 3, 3, 1, 48, 48, 2, 1),
    "one_token": (1, 1, 2, 1, 8, 8, 1, 1),
    "bthd_layout": (2, 6, 5, 1, 16, 16, 2, 2),
    "partial_rotary": (2, 4, 3, 1, 32, 12, 1, 1),
    "many_heads": (1, 2, 40, 8, 128, 128, 1, 1),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_rope_matches_float64(case, dtype, impl):
    """q_embed, k_embed, d_q, d_k within fp32 1e-5 / bf16 1e-2 of float64 for GQA, batch-1 cos/sin,
    head_dim 48, one token, the [B, T, H, D] layout, partial rotary, more heads than one tile;
    q/k non-contiguous (HF transpose layout), random positions."""
    bsz, seq, n_qh, n_kh, head_dim, rot, cos_batch, ud = CASES[case]
    q, k, cos, sin = _make(bsz, seq, n_qh, n_kh, head_dim, rot, cos_batch, ud, dtype)
    _run_and_check(q, k, cos, sin, ud, impl, dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_repeated_tables_match_float64(case, dtype, impl):
    """repeated_tables=True on Hugging Face tables (second half = first half): outputs and grads
    within fp32 1e-5 / bf16 1e-2 of float64, as without it (every case, partial rotary included)."""
    bsz, seq, n_qh, n_kh, head_dim, rot, cos_batch, ud = CASES[case]
    q, k, cos, sin = _make(bsz, seq, n_qh, n_kh, head_dim, rot, cos_batch, ud, dtype)
    _run_and_check(q, k, cos, sin, ud, impl, dtype, repeated_tables=True)


@pytest.mark.parametrize("inplace", [False, True])
def test_repeated_tables_read_the_first_half_only(inplace):
    """Tables whose halves differ: with repeated_tables=True both paths rotate by the first half of
    each row (Triton, in place or not, equals the torch path and the float64 formula on
    cat(first, first) at 1e-5, outputs and grads), which is not the full-table rotation."""
    q, k, _, _ = _make(2, 5, 4, 2, 16, 12, 2, 1, torch.float32)
    angles = torch.randn(2, 5, 12, dtype=torch.float64)  # halves differ
    cos, sin = angles.cos().float(), angles.sin().float()
    first = torch.cat((angles[..., :6],) * 2, dim=-1)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    rq, rk, dq, dk = _reference(q, k, first.cos(), first.sin(), 1, gq, gk)
    full_q = apply_rotary_pos_emb(q, k, cos, sin, impl="torch")[0]
    for impl in IMPLS:
        lq, lk = (q * 1).requires_grad_(), (k * 1).requires_grad_()
        qq, kk = (lq * 1, lk * 1) if inplace else (lq, lk)
        oq, ok = apply_rotary_pos_emb(qq, kk, cos, sin, inplace=inplace, repeated_tables=True, impl=impl)
        ((oq * gq).sum() + (ok * gk).sum()).backward()
        assert_close_rel(oq, rq, TOL[torch.float32], f"{impl} q_embed")
        assert_close_rel(ok, rk, TOL[torch.float32], f"{impl} k_embed")
        assert_close_rel(lq.grad, dq, TOL[torch.float32], f"{impl} d_q")
        assert_close_rel(lk.grad, dk, TOL[torch.float32], f"{impl} d_k")
        assert (oq.detach() - full_q).abs().max() > 1e-2
    with pytest.raises(TypeError, match="repeated_tables must be a bool"):
        apply_rotary_pos_emb(q, k, cos, sin, repeated_tables=1)


def test_rope_keeps_layout_and_contiguous_inputs():
    """Contiguous [B, H, T, D] inputs work too (1e-5); outputs keep the inputs' strides (HF transpose layout)."""
    q, k, cos, sin = _make(2, 3, 4, 2, 16, 16, 1, 1, torch.float32, hf_layout=False)
    oq, _ = _run_and_check(q, k, cos, sin, 1, "triton", torch.float32)
    assert oq.is_contiguous()
    q, k, cos, sin = _make(2, 3, 4, 2, 16, 16, 1, 1, torch.float32, hf_layout=True)
    oq, ok = _run_and_check(q, k, cos, sin, 1, "triton", torch.float32)
    assert oq.stride() == q.stride() and ok.stride() == k.stride()


def test_non_unit_last_stride_gradients():
    """q/k whose head dim is not the unit-stride one (a transpose of a dense [B, H, D, T]
    tensor): the Triton path copies them for the kernel, and the gradients (allocated in a
    layout the kernel can write) equal the torch path's within 1e-5."""
    torch.manual_seed(0)
    qb = torch.randn(1, 2, 8, 5, requires_grad=True)
    kb = torch.randn(1, 1, 8, 5, requires_grad=True)
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    weights = torch.randn(1, 2, 5, 8)
    grads = {}
    for impl in IMPLS:
        oq, ok = apply_rotary_pos_emb(qb.transpose(-1, -2), kb.transpose(-1, -2), cos, sin, impl=impl)
        grads[impl] = torch.autograd.grad((oq * weights).sum() + ok.sum(), (qb, kb))
    for name, a, b in zip(("d_q", "d_k"), grads["triton"], grads["torch"]):
        assert_close_rel(a, b, TOL[torch.float32], name)


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_transformers_llama(impl):
    """Same values as transformers' llama apply_rotary_pos_emb on the same fp32 inputs (1e-5)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_rope

    q, k, cos, sin = _make(2, 7, 4, 2, 64, 64, 2, 1, torch.float32)
    oq, ok = apply_rotary_pos_emb(q, k, cos, sin, impl=impl)
    rq, rk = hf_rope(q, k, cos, sin)
    assert_close_rel(oq, rq, 1e-5, "q_embed")
    assert_close_rel(ok, rk, 1e-5, "k_embed")


def test_matches_transformers_llama_rotary_module():
    """With cos/sin from LlamaRotaryEmbedding at position_ids not starting at 0, equals HF (1e-5)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_rope

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    rotary = LlamaRotaryEmbedding(cfg)
    x = torch.randn(2, 5, 64)
    position_ids = torch.tensor([[3, 4, 5, 6, 7], [100, 101, 102, 103, 104]])
    cos, sin = rotary(x, position_ids)
    q, k = torch.randn(2, 5, 4, 16).transpose(1, 2), torch.randn(2, 5, 2, 16).transpose(1, 2)
    oq, ok = apply_rotary_pos_emb(q, k, cos, sin, impl="triton")
    rq, rk = hf_rope(q, k, cos, sin)
    assert_close_rel(oq, rq, 1e-5, "q_embed")
    assert_close_rel(ok, rk, 1e-5, "k_embed")


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_transformers_phi3_partial(impl):
    """Partial rotary (cos's last dim < head_dim) equals transformers' phi3 apply_rotary_pos_emb (1e-5)."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as hf_rope

    q, k, cos, sin = _make(2, 3, 4, 2, 48, 24, 1, 1, torch.float32)
    oq, ok = apply_rotary_pos_emb(q, k, cos, sin, impl=impl)
    rq, rk = hf_rope(q, k, cos, sin)
    assert_close_rel(oq, rq, 1e-5, "q_embed")
    assert_close_rel(ok, rk, 1e-5, "k_embed")


def test_position_ids_with_table_and_positional_unsqueeze_dim():
    """A 2-D cos/sin table with position_ids equals pre-gathered 3-D cos/sin (exactly); with 3-D cos/sin
    position_ids is ignored; an int 5th argument is taken as unsqueeze_dim (transformers 5 order)."""
    q, k, _, _ = _make(2, 4, 2, 2, 16, 16, 1, 2, torch.float32)
    table_c, table_s = _cos_sin(torch.arange(50)[None], 16, torch.float32)
    position_ids = torch.tensor([[7, 3, 9, 1], [0, 49, 2, 2]])
    a = apply_rotary_pos_emb(q, k, table_c[0], table_s[0], position_ids, 2, impl="triton")
    c3, s3 = table_c[0][position_ids], table_s[0][position_ids]
    b = apply_rotary_pos_emb(q, k, c3, s3, unsqueeze_dim=2, impl="triton")
    c = apply_rotary_pos_emb(q, k, c3, s3, position_ids, unsqueeze_dim=2, impl="triton")
    d = liger_rotary_pos_emb(q, k, c3, s3, 2, impl="triton")
    for other in (b, c, d):
        assert torch.equal(a[0], other[0]) and torch.equal(a[1], other[1])


def test_cos_sin_requiring_grad():
    """cos/sin that require grad: impl='auto' takes the torch path and differentiates them (grad of cos
    matches float64 to 1e-5); impl='triton' raises ValueError naming cos."""
    q, k, cos, sin = _make(1, 3, 2, 1, 8, 8, 1, 1, torch.float32)
    cos = cos.clone().requires_grad_()
    oq, ok = apply_rotary_pos_emb(q, k, cos, sin)
    (oq.sum() + ok.sum()).backward()
    c64 = cos.detach().double().requires_grad_()
    cu = c64.unsqueeze(1)
    (q.double() * cu).sum().add((k.double() * cu).sum()).add(
        (_rotate_half(q.double()) * sin.double().unsqueeze(1)).sum()
    ).backward()
    assert_close_rel(cos.grad, c64.grad, 1e-5, "d_cos")
    with pytest.raises(ValueError, match="cos and sin must not require grad"):
        apply_rotary_pos_emb(q, k, cos, sin, impl="triton")


def test_bad_inputs_raise_clear_errors():
    """Rank, size, dtype, device and option mistakes raise ValueError/TypeError naming the argument."""
    q, k, cos, sin = _make(2, 3, 4, 2, 16, 16, 1, 1, torch.float32)
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        apply_rotary_pos_emb(q[0], k, cos, sin)
    with pytest.raises(ValueError, match="k must have shape"):
        apply_rotary_pos_emb(q, k[:, :, :2], cos, sin)
    with pytest.raises(TypeError, match="k must have q's dtype"):
        apply_rotary_pos_emb(q, k.double(), cos, sin)
    with pytest.raises(TypeError, match="q must be a floating-point"):
        apply_rotary_pos_emb(q.long(), k.long(), cos, sin)
    with pytest.raises(TypeError, match="cos must be a floating-point"):
        apply_rotary_pos_emb(q, k, cos.long(), sin)
    with pytest.raises(ValueError, match="head_dim"):
        apply_rotary_pos_emb(q[..., :15], k[..., :15], cos[..., :14], sin[..., :14])
    with pytest.raises(ValueError, match="rotary dim R"):
        apply_rotary_pos_emb(q[..., :8], k[..., :8], cos, sin)
    with pytest.raises(ValueError, match="rotary dim R"):
        apply_rotary_pos_emb(q, k, cos[..., :7], sin[..., :7])
    with pytest.raises(ValueError, match="sin must have cos's shape"):
        apply_rotary_pos_emb(q, k, cos, sin[:, :2])
    with pytest.raises(ValueError, match="cos and sin must have shape"):
        apply_rotary_pos_emb(q, k, cos[:, :2], sin[:, :2])
    with pytest.raises(ValueError, match="cos and sin must have shape"):
        apply_rotary_pos_emb(q, k, cos.expand(3, -1, -1), sin.expand(3, -1, -1))
    with pytest.raises(ValueError, match="unsqueeze_dim must be"):
        apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=3)
    with pytest.raises(ValueError, match="needs position_ids"):
        apply_rotary_pos_emb(q, k, cos[0], sin[0])
    with pytest.raises(ValueError, match="position_ids must be in"):
        apply_rotary_pos_emb(q, k, cos[0], sin[0], torch.tensor([[0, 1, 3]]))
    with pytest.raises(ValueError, match="position_ids must have shape"):
        apply_rotary_pos_emb(q, k, cos[0], sin[0], torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="one device"):
        apply_rotary_pos_emb(q, k, cos.to("meta"), sin.to("meta"))
    with pytest.raises(ValueError, match="impl must be one of"):
        apply_rotary_pos_emb(q, k, cos, sin, impl="gpu")


# --------------------------------------------------------------------------- GPU, 8B shapes


@pytest.mark.gpu
@pytest.mark.parametrize("loads_first", [False, True], ids=["tiled", "loads-first"])
@pytest.mark.parametrize("seq", [4096, 8192])
def test_rope_llama3_8b_shape_gpu(seq, loads_first):
    """Llama-3-8B attention (32 q / 8 kv heads of 128, bf16, HF transpose layout) on the GPU:
    q_embed, k_embed and their grads within 1e-2 of float64 (both kernel variants)."""
    from liger_losses.kernels import rope as rope_mod

    torch.manual_seed(0)
    q = torch.randn(1, seq, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, seq, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    cos, sin = _cos_sin(torch.arange(seq, device="cuda")[None], 128, torch.bfloat16)
    with rope_mod.ROPE_TUNING.override(loads_first=loads_first):
        _run_and_check(q, k, cos, sin, 1, "triton", torch.bfloat16)


# --------------------------------------------------------------------------- inplace=True


def _hf_views(lin_q, lin_k, n_qh, n_kh, head_dim, unsqueeze_dim):
    """q/k as HF attention makes them from projection outputs [B, T, H*D]."""
    bsz, seq = lin_q.shape[:2]
    q = lin_q.view(bsz, seq, n_qh, head_dim)
    k = lin_k.view(bsz, seq, n_kh, head_dim)
    return (q.transpose(1, 2), k.transpose(1, 2)) if unsqueeze_dim == 1 else (q, k)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["gqa", "bthd_layout", "partial_rotary", "many_heads"])
def test_inplace_matches_float64_through_hf_views(case, dtype, impl):
    """inplace=True on q/k = proj.view(B, T, H, D).transpose(1, 2) of non-leaf projection outputs:
    q_embed/k_embed live in the projections' memory, keep q's/k's shapes and strides, and they and the
    gradients w.r.t. the projection leaves are within fp32 1e-5 / bf16 1e-2 of float64."""
    bsz, seq, n_qh, n_kh, head_dim, rot, cos_batch, ud = CASES[case]
    _, _, cos, sin = _make(bsz, seq, n_qh, n_kh, head_dim, rot, cos_batch, ud, dtype)
    leaf_q = torch.randn(bsz, seq, n_qh * head_dim).to(dtype).requires_grad_()
    leaf_k = torch.randn(bsz, seq, n_kh * head_dim).to(dtype).requires_grad_()
    lin_q, lin_k = leaf_q * 1, leaf_k * 1
    q, k = _hf_views(lin_q, lin_k, n_qh, n_kh, head_dim, ud)
    q_before, k_before = q.detach().clone(), k.detach().clone()
    oq, ok = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=ud, inplace=True, impl=impl)
    assert oq.data_ptr() == lin_q.data_ptr() and ok.data_ptr() == lin_k.data_ptr()
    assert oq.shape == q.shape and oq.stride() == q.stride() and ok.stride() == k.stride()
    gq, gk = torch.randn_like(oq), torch.randn_like(ok)
    ((oq * gq).sum() + (ok * gk).sum()).backward()
    rq, rk, dq, dk = _reference(q_before, k_before, cos, sin, ud, gq, gk)
    tol = TOL[dtype]
    assert_close_rel(oq, rq, tol, "q_embed")
    assert_close_rel(ok, rk, tol, "k_embed")
    want_dq = dq.transpose(1, 2) if ud == 1 else dq
    want_dk = dk.transpose(1, 2) if ud == 1 else dk
    assert_close_rel(leaf_q.grad, want_dq.reshape(leaf_q.shape), tol, "d_q")
    assert_close_rel(leaf_k.grad, want_dk.reshape(leaf_k.shape), tol, "d_k")


@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace_equals_out_of_place(dtype):
    """In-place and out-of-place Triton results are bitwise equal (same kernel math), for a
    contiguous non-view q/k, a partial view (not lifted) and under no_grad."""
    q, k, cos, sin = _make(2, 4, 4, 2, 32, 16, 2, 1, dtype)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin, impl="triton")
    for qq, kk in ((q.contiguous(), k.contiguous()), (q.clone(), k.clone())):
        with torch.no_grad():
            oq, ok = apply_rotary_pos_emb(qq, kk, cos, sin, inplace=True, impl="triton")
        assert oq is qq and ok is kk
        assert torch.equal(oq, want_q) and torch.equal(ok, want_k)
    wide = torch.zeros(2, 4, 4, 40, dtype=dtype)  # q is a slice of the last dim: not a whole-base view
    wide[..., :32] = q.transpose(1, 2)
    lin = (wide * 1).requires_grad_()
    qv = lin.detach().requires_grad_(False)[..., :32].transpose(1, 2)
    kk = k.clone()
    oq, ok = apply_rotary_pos_emb(qv, kk, cos, sin, inplace=True, impl="triton")
    assert torch.equal(oq, want_q) and torch.equal(ok, want_k)


def test_inplace_partial_view_grads():
    """In place on a slice view (no whole-base lift: autograd's CopySlices path): grads w.r.t. the
    leaf equal float64 (1e-5) and the untouched columns get their identity gradient."""
    leaf = torch.randn(2, 3, 4, 20, requires_grad=True)
    lin = leaf * 1
    q = lin[..., :16].transpose(1, 2)
    k = torch.randn(2, 3, 2, 16).transpose(1, 2).requires_grad_()
    _, _, cos, sin = _make(2, 3, 4, 2, 16, 16, 2, 1, torch.float32)
    q0 = q.detach().clone()
    k_in = k * 1
    oq, ok = apply_rotary_pos_emb(q, k_in, cos, sin, inplace=True, impl="triton")
    gq, gk = torch.randn_like(oq), torch.randn_like(ok)
    ((oq * gq).sum() + (ok * gk).sum() + lin[..., 16:].sum()).backward()
    _, _, dq, dk = _reference(q0, k, cos, sin, 1, gq, gk)
    assert_close_rel(leaf.grad[..., :16], dq.transpose(1, 2), 1e-5, "d_q")
    assert torch.equal(leaf.grad[..., 16:], torch.ones(2, 3, 4, 4))
    assert_close_rel(k.grad, dk, 1e-5, "d_k")


def test_inplace_autograd_errors():
    """inplace=True on a leaf that requires grad, on a view of one, or on a tensor another op saved
    raises autograd's RuntimeError (never a silently wrong gradient); q/k sharing memory or with
    overlapping elements raise ValueError naming q and k; a non-bool inplace raises TypeError."""
    q, k, cos, sin = _make(1, 3, 2, 1, 8, 8, 1, 1, torch.float32)
    leaf_q, leaf_k = q.clone().requires_grad_(), k.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        apply_rotary_pos_emb(leaf_q, leaf_k, cos, sin, inplace=True, impl="triton")
    leaf_lin = torch.randn(1, 3, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf"):
        apply_rotary_pos_emb(leaf_lin.view(1, 3, 2, 8).transpose(1, 2), k.clone(), cos, sin,
                             inplace=True, impl="triton")
    base = torch.randn(1, 3, 16, requires_grad=True)
    lin = base * 1
    saved = (lin * lin).sum()  # mul saves lin
    apply_rotary_pos_emb(lin.view(1, 3, 2, 8).transpose(1, 2), k.clone(), cos, sin, inplace=True, impl="triton")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()
    qkv = torch.randn(1, 3, 3, 8)
    with pytest.raises(ValueError, match="q and k must not share memory"):
        apply_rotary_pos_emb(qkv[:, :, :2].transpose(1, 2), qkv[:, :, 2:].transpose(1, 2), cos, sin,
                             inplace=True, impl="triton")
    with pytest.raises(ValueError, match="overlapping"):
        apply_rotary_pos_emb(q[:, :1].expand(1, 2, 3, 8), k.clone(), cos, sin, inplace=True, impl="triton")
    with pytest.raises(TypeError, match="inplace must be a bool"):
        apply_rotary_pos_emb(q, k, cos, sin, inplace=1)


@pytest.mark.gpu
@pytest.mark.parametrize("repeated_tables", [False, True])
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_rope_inplace_llama3_8b_shape_gpu(inplace_backward, repeated_tables):
    """Llama-3-8B shapes in place through the HF view/transpose layout (bf16): outputs and leaf grads
    within 1e-2 of float64 (also with the gradients rotated in their own buffers, and reading half
    of each cos/sin row)."""
    torch.manual_seed(0)
    seq = 4096
    leaf_q = torch.randn(1, seq, 32 * 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    leaf_k = torch.randn(1, seq, 8 * 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k = _hf_views(leaf_q * 1, leaf_k * 1, 32, 8, 128, 1)
    q0, k0 = q.detach().clone(), k.detach().clone()
    cos, sin = _cos_sin(torch.arange(seq, device="cuda")[None], 128, torch.bfloat16)
    oq, ok = apply_rotary_pos_emb(q, k, cos, sin, inplace=True, inplace_backward=inplace_backward,
                                  repeated_tables=repeated_tables, impl="triton")
    gq, gk = torch.randn_like(oq), torch.randn_like(ok)
    ((oq * gq).sum() + (ok * gk).sum()).backward()
    rq, rk, dq, dk = _reference(q0, k0, cos, sin, 1, gq, gk)
    assert_close_rel(oq, rq, 1e-2, "q_embed")
    assert_close_rel(ok, rk, 1e-2, "k_embed")
    assert_close_rel(leaf_q.grad, dq.transpose(1, 2).reshape(leaf_q.shape), 1e-2, "d_q")
    assert_close_rel(leaf_k.grad, dk.transpose(1, 2).reshape(leaf_k.shape), 1e-2, "d_k")


@pytest.fixture
def loads_first():
    """RoPETuning.loads_first on: one tile per tensor, q's and k's loads before any store."""
    from liger_losses.kernels import rope as rope_mod

    with rope_mod.ROPE_TUNING.override(loads_first=True):
        yield


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_loads_first_matches_float64(case, dtype, loads_first):
    """The LOADS_FIRST variant of the Triton kernel (the default): out of place, every case above (partial rotary's
    pass-through copy, more heads than the tiled variant's tile, the [B, T, H, D] layout), within fp32 1e-5 / bf16 1e-2
    of float64."""
    bsz, seq, n_qh, n_kh, head_dim, rot, cos_batch, ud = CASES[case]
    q, k, cos, sin = _make(bsz, seq, n_qh, n_kh, head_dim, rot, cos_batch, ud, dtype)
    _run_and_check(q, k, cos, sin, ud, "triton", dtype)


@pytest.mark.parametrize("case", ["gqa", "partial_rotary", "many_heads"])
def test_loads_first_in_place_equals_tiled(case):
    """In place, the LOADS_FIRST variant gives bitwise the tiled variant's outputs and gradients
    (the same per-element fp32 math, only the order of loads and stores differs)."""
    from liger_losses.kernels import rope as rope_mod

    bsz, seq, n_qh, n_kh, head_dim, rot, cos_batch, ud = CASES[case]
    _, _, cos, sin = _make(bsz, seq, n_qh, n_kh, head_dim, rot, cos_batch, ud, torch.float32)
    leaf_q = torch.randn(bsz, seq, n_qh * head_dim).requires_grad_()
    leaf_k = torch.randn(bsz, seq, n_kh * head_dim).requires_grad_()
    gq = torch.randn(bsz, n_qh, seq, head_dim) if ud == 1 else torch.randn(bsz, seq, n_qh, head_dim)
    gk = torch.randn(bsz, n_kh, seq, head_dim) if ud == 1 else torch.randn(bsz, seq, n_kh, head_dim)

    def run():
        q, k = _hf_views(leaf_q * 1, leaf_k * 1, n_qh, n_kh, head_dim, ud)
        oq, ok = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=ud, inplace=True, impl="triton")
        grads = torch.autograd.grad((oq, ok), (leaf_q, leaf_k), (gq, gk))
        return oq.detach().clone(), ok.detach().clone(), *grads

    with rope_mod.ROPE_TUNING.override(loads_first=False):
        tiled = run()
    with rope_mod.ROPE_TUNING.override(loads_first=True):
        first = run()
    for a, b in zip(first, tiled):
        assert torch.equal(a, b)


@pytest.mark.parametrize("grad_layout", ["q", "contiguous"])
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_inplace_backward_buffers(inplace_backward, grad_layout):
    """inplace=True, gradients given (``grad_outputs``) laid out like q (what SDPA's backward returns)
    or contiguous [B, H, T, D]: the gradients w.r.t. the projections are within fp32 1e-5 of float64
    either way. The caller's gradient buffers are left untouched unless ``inplace_backward=True``
    and they are laid out like q (then they hold the rotated gradient: the backward allocated
    nothing); a contiguous gradient is copied into the carrier's layout first and rotated in that
    private copy, so it stays untouched even with ``inplace_backward``."""
    bsz, seq, n_qh, n_kh, head_dim = 2, 5, 4, 2, 16
    _, _, cos, sin = _make(bsz, seq, n_qh, n_kh, head_dim, head_dim, 2, 1, torch.float32)
    leaf_q = torch.randn(bsz, seq, n_qh * head_dim, requires_grad=True)
    leaf_k = torch.randn(bsz, seq, n_kh * head_dim, requires_grad=True)
    q, k = _hf_views(leaf_q * 1, leaf_k * 1, n_qh, n_kh, head_dim, 1)
    q_before, k_before = q.detach().clone(), k.detach().clone()
    oq, ok = apply_rotary_pos_emb(q, k, cos, sin, inplace=True, inplace_backward=inplace_backward, impl="triton")
    if grad_layout == "q":
        gq = torch.randn(bsz, seq, n_qh, head_dim).transpose(1, 2)
        gk = torch.randn(bsz, seq, n_kh, head_dim).transpose(1, 2)
    else:
        gq, gk = torch.randn(bsz, n_qh, seq, head_dim), torch.randn(bsz, n_kh, seq, head_dim)
    gq_given, gk_given = gq.clone(), gk.clone()
    dq_leaf, dk_leaf = torch.autograd.grad((oq, ok), (leaf_q, leaf_k), (gq, gk))
    _, _, dq, dk = _reference(q_before, k_before, cos, sin, 1, gq_given, gk_given)
    assert_close_rel(dq_leaf, dq.transpose(1, 2).reshape(dq_leaf.shape), TOL[torch.float32], "d_q")
    assert_close_rel(dk_leaf, dk.transpose(1, 2).reshape(dk_leaf.shape), TOL[torch.float32], "d_k")
    overwritten = inplace_backward and grad_layout == "q"
    assert torch.equal(gq, gq_given) is not overwritten
    assert torch.equal(gk, gk_given) is not overwritten
    if overwritten:
        assert_close_rel(gq, dq, TOL[torch.float32], "d_q in the given buffer")


def test_inplace_backward_argument_errors():
    q, k, cos, sin = _make(1, 3, 2, 1, 8, 8, 1, 1, torch.float32)
    with pytest.raises(ValueError, match="inplace_backward"):
        apply_rotary_pos_emb(q, k, cos, sin, inplace_backward=True)
    with pytest.raises(TypeError, match="inplace_backward"):
        apply_rotary_pos_emb(q.clone(), k.clone(), cos, sin, inplace=True, inplace_backward=1)


def test_loads_first_warps_rule():
    """Warps of the LOADS_FIRST tile: 2 for a Qwen2-0.5B token (16 x 32 q elements per half), 4 for
    Llama-3.2-1B's (32 x 32) and Llama-3-8B's (32 x 64), 8 from 4096 elements; num_warps overrides."""
    from liger_losses.kernels import rope as rope_mod

    warps = lambda rot, n_qh, n_kh: rope_mod._config(rot, rot, n_qh, n_kh, True)[6]  # noqa: E731
    assert (warps(64, 14, 2), warps(64, 32, 8), warps(128, 32, 8), warps(128, 64, 8)) == (2, 4, 4, 8)
