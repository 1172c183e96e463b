"""Experiment (CPU): registers and spills of our Triton kernels at their default launch configurations,
compiled offline for an H100/H200 (sm_90) with the ptxas that ships in the triton wheel -- no GPU.

Question: a kernel's register count decides how many programs an SM runs at once (bytes in flight,
L2 reuse), and a spill (``STACK`` > 0: local-memory traffic) silently costs bandwidth. Can a change
that adds live state be caught on the CPU, before a GPU run?

Verdict: yes. The offline counts matched the H200's wherever both were read (triton 3.6 on the GPU;
the numbers move a little between triton versions). Found with it: the RMSNorm backward default at
H=4096 (4-row tiles with prefetch, 16 warps) spills 40 B per thread and still times fastest; the CE
tile compiles liger-kernel's 32768 / 32-warp shape to 64 registers (a 16-byte spill under triton
3.6 since the first-index accuracy's scalars, 168 bytes under 3.9; 16384 / 32 does not spill); the shared gated
kernels take 32 registers forward and 36-47 backward, no spills.

Status: a re-usable tool; run it after changing a kernel's live state.

Each case is compiled like a real launch: bf16 tensors, 16-byte aligned pointers and strides
divisible by 16 (as the 8B shapes give), constexprs and warps from the kernels' tuning slots at the
8B shapes (H=4096, V=128256, 32/8 heads of 128, intermediate 14336).

    python -m benchmark.experiments.diag_registers [--json] [--defaults]

(``--defaults``: the default configurations only; ``tests/kernels/test_sm90_compile.py`` runs it so that
a kernel the interpreter accepts but the compiler refuses fails on the CPU.)

Output per case: name, registers per thread, spill stack bytes per thread, warps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret (set before importing triton)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from liger_losses.kernels import (  # noqa: E402
    divergence_kernel,
    divergence_tile,
    gated,
    geglu,
    label_stats,
    layer_norm,
    logits_tile,
    logp_entropy_grad,
    norm_common,
    online_block,
    online_finish,
    rms_norm,
    rope,
    scale,
    swiglu,
)
from liger_losses.kernels.utils import row_tile  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
H, V, I_SIZE, N_TOKENS = 4096, 128256, 14336, 16384
N_QH, N_KH, HEAD_DIM = 32, 8, 128
NOT_DIVISIBLE = {"ignore_index"}  # int arguments whose real values are not multiples of 16 (-100)


def _jit(kernel):
    """The JITFunction behind a launch.FastKernel wrapper (or the kernel itself)."""
    return getattr(kernel, "jit_fn", kernel)


def compile_case(kernel, *, constexprs: dict, num_warps: int, pointers: dict | None = None,
                 floats: tuple = (), default_ptr: str = "*bf16", maxnreg: int | None = None) -> dict:
    """Compile ``kernel`` for sm_90; runtime params: pointers (``*_ptr`` or named in
    ``pointers``) aligned, ints i32 divisible by 16 (but ``NOT_DIVISIBLE``), ``floats`` fp32."""
    fn = _jit(kernel)
    pointers = pointers or {}
    signature, attrs = {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            continue
        if p.name in pointers or p.name.endswith("_ptr"):
            signature[p.name] = pointers.get(p.name, default_ptr)
        elif p.name in floats:
            signature[p.name] = "fp32"
            continue
        else:
            signature[p.name] = "i32"
            if p.name in NOT_DIVISIBLE:
                continue
        attrs[(i,)] = [["tt.divisibility", 16]]
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: constexprs missing: {missing}")
    consts = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    options = {"num_warps": num_warps}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(src, target=TARGET, options=options)
    return dict(num_warps=num_warps, **_resources(compiled.asm["cubin"]))


def _resources(cubin: bytes) -> dict:
    """REG and STACK of the cubin's kernel, read with the wheel's cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    fields = dict(tok.split(":", 1) for tok in line.split() if ":" in tok)
    return {"regs": int(fields["REG"]), "stack": int(fields["STACK"])}


def _logits_case(block: int, warps: int, vec_sums: bool, **flags) -> dict:
    pointers = {n: "*fp32" for n in ("SCALE", "CW", "LOSS", "LSE", "LOGP", "ENT", "LSUM", "SQ")}
    pointers.update(X="*bf16", G="*bf16", LABELS="*i64", CORRECT="*i8")
    knobs = logits_tile.LOGITS_TILE_TUNING.current
    const = dict(MODE_CE=True, WRITE_GRAD=True, SCALE_PER_ROW=True, HAS_SOFTCAP=False, HAS_CW=False,
                 NEED_ENT=False, NEED_LSUM=False, NEED_SQ=False, BLOCK=block, VEC_SUMS=vec_sums,
                 STAGES1=knobs.pass1_stages, STAGES2=knobs.pass2_stages, REVERSED=knobs.pass2_reversed)
    maxnreg = flags.pop("maxnreg", knobs.maxnreg)
    const.update(flags)
    return compile_case(logits_tile._logits_tile_kernel, constexprs=const, num_warps=warps, pointers=pointers,
                        maxnreg=maxnreg,
                        floats=("scale_value", "logit_scale", "inv_temp", "softcap", "eps", "z_w"))


def _divergence_case(**flags) -> dict:
    knobs = divergence_tile.DIVERGENCE_TILE_TUNING.current
    block, warps = divergence_tile._block_settings(V, knobs)
    const = dict(MODE=divergence_tile.divergence_mode("jsd", 0.5), TOPK=False, TAIL=False, HAS_LABELS=False,
                 SEP_RAW=False, WRITE_GRAD=True, ROW_SCALE=True, BLOCK=block, BLOCK_K=2,
                 STAGES=knobs.loop_stages, LANE_SUMS=knobs.lane_sums, REVERSED=knobs.pass2_reversed)
    warps = flags.pop("num_warps", warps)
    maxnreg = flags.pop("maxnreg", knobs.maxnreg)
    const.update(flags)
    return compile_case(divergence_kernel._divergence_tile_kernel, constexprs=const, num_warps=warps, maxnreg=maxnreg,
                        pointers={n: "*fp32" for n in ("scale_ptr", "loss_ptr", "div_ptr", "ce_ptr", "ent_ptr",
                                                       "correct_ptr", "tk_lp_ptr")} | {"labels_ptr": "*i64",
                                                                                      "tk_idx_ptr": "*i64"},
                        floats=("scale_value", "inv_t", "one_m_beta", "log_1m_beta", "log_beta", "w_hard", "w_soft"))


# the OnlineState rows and the accumulator, as both frozen-head kernels take them
_ONLINE_STATE_PTRS = ("ref_ptr", "se_ptr", "ze_ptr", "zs_ptr", "zm_ptr", "zy_ptr", "dy_ptr", "zp_ptr", "acc_ptr")


def _online_block_case(first: bool, softcap: bool = False) -> dict:
    knobs = online_block.ONLINE_BLOCK_TUNING.current
    pointers = {n: "*fp32" for n in _ONLINE_STATE_PTRS} | {"lab_ptr": "*i64"}
    return compile_case(online_block._online_block_kernel, num_warps=knobs.num_warps, pointers=pointers,
                        constexprs=dict(FIRST=first, HAS_SOFTCAP=softcap, NEED_ZEXP=True, NEED_ZSUM=False,
                                        BLOCK=knobs.block_cap, BLOCK_H=1024),
                        floats=("logit_scale", "inv_temp", "softcap", "tau"))


def _online_finish_case() -> dict:
    outputs = ("wmean_ptr", "scale_ptr", "loss_ptr", "lse_ptr", "logp_ptr", "ent_ptr")
    pointers = {n: "*fp32" for n in _ONLINE_STATE_PTRS + outputs} | {"lab_ptr": "*i64", "rows_ptr": "*i64",
                                                                     "hit_ptr": "*i8"}
    return compile_case(online_finish._online_finish_kernel, num_warps=4, pointers=pointers,
                        constexprs=dict(MODE_CE=True, HAS_EPS=False, NEED_ENTROPY=True, SCALE_PTR=True, SCATTER=True,
                                        BLOCK_H=1024),
                        floats=("scale_value", "inv_V", "eps", "z_w", "dz_dx"))


def default_cases() -> dict:
    """name -> thunk compiling one default launch configuration."""
    cases = {}
    block_d, warps_d = divergence_tile._block_settings(V, divergence_tile.DIVERGENCE_TILE_TUNING.current)
    cases[f"divergence_tile jsd {block_d}/{warps_d}"] = _divergence_case
    cases[f"divergence_tile jsd+labels {block_d}/{warps_d}"] = lambda: _divergence_case(HAS_LABELS=True)
    logits_knobs = logits_tile.LOGITS_TILE_TUNING.current
    block_v, warps_v = logits_tile._block_settings(V, logits_knobs)
    vec = block_v <= logits_knobs.vec_sums_max_block
    for name, flags in (("ce", {}), ("ce+entropy", {"NEED_ENT": True}),
                        ("logp+entropy", {"MODE_CE": False, "NEED_ENT": True}),
                        ("ce+softcap", {"HAS_SOFTCAP": True}), ("stats only", {"WRITE_GRAD": False})):
        cases[f"logits_tile {name} {block_v}/{warps_v}"] = (lambda f=flags: _logits_case(block_v, warps_v, vec, **f))

    block_o = online_block.ONLINE_BLOCK_TUNING.current
    for first in (True, False):
        cases[f"online_block {'first' if first else 'later'} {block_o.block_cap}/{block_o.num_warps}"] = (
            lambda f=first: _online_block_case(f))
    cases[f"online_block later+softcap {block_o.block_cap}/{block_o.num_warps}"] = (
        lambda: _online_block_case(False, softcap=True))
    cases["online_finish ce+entropy, scattered rows"] = _online_finish_case
    # the branches the cases above leave out: top-k teachers, class weights with label smoothing
    cases[f"divergence_tile top-k+tail+labels {block_d}/{warps_d}"] = lambda: _divergence_case(
        TOPK=True, TAIL=True, HAS_LABELS=True, SEP_RAW=True, BLOCK_K=64)
    cases[f"logits_tile ce+class weights+smoothing {block_v}/{warps_v}"] = (
        lambda: _logits_case(block_v, warps_v, vec, HAS_CW=True, NEED_LSUM=True, HAS_SOFTCAP=True))
    lg = logp_entropy_grad.LOGP_ENTROPY_GRAD_TUNING.current
    lg_block = min(triton.next_power_of_2(V), lg.block_cap)
    cases[f"logp_entropy_grad {lg_block}"] = lambda: compile_case(
        logp_entropy_grad._logp_entropy_grad_kernel, num_warps=lg.num_warps or (8 if lg_block >= 4096 else 4),
        pointers={"X": "*bf16", "LABELS": "*i64", "LSE": "*fp32", "ENT": "*fp32", "GL": "*fp32", "GE": "*fp32"},
        constexprs=dict(HAS_SOFTCAP=True, HAS_GE=True, BLOCK=lg_block),
        floats=("logit_scale", "inv_temp", "softcap"))
    ls = label_stats.LABEL_STATS_TUNING.current
    cases["label_stats"] = lambda: compile_case(
        label_stats._label_stats_kernel, num_warps=ls.num_warps,
        pointers={"LABELS": "*i64", "CW": "*fp32", "BAD": "*i32", "SCALE": "*fp32"},
        constexprs=dict(HAS_CW=True, BLOCK=ls.block))
    sc = scale.SCALE_TUNING.current
    cases["scale_unless_one"] = lambda: compile_case(
        scale._scale_unless_one_kernel, num_warps=sc.num_warps, pointers={"scale_ptr": "*fp32"},
        constexprs=dict(BLOCK=sc.block))

    for mod, kernel, extra in ((rms_norm, "_rms_norm", dict(CASTING=0)), (layer_norm, "_layer_norm", {})):
        knobs = (rms_norm.RMS_NORM_TUNING if mod is rms_norm else layer_norm.LAYER_NORM_TUNING).current
        bm, bn, w = row_tile(H, N_TOKENS, knobs.fwd_tile_elems, knobs.max_rows_per_tile)
        fwd = dict(extra, HAS_WEIGHT=True, BLOCK_M=bm, BLOCK_N=bn, PDL=True)
        if mod is layer_norm:
            fwd["HAS_BIAS"] = True
        cases[f"{kernel}_fwd {bm}x{bn}/{w}"] = (
            lambda k=getattr(mod, kernel + "_fwd_kernel"), c=fwd, w=w:
            compile_case(k, constexprs=c, num_warps=w, pointers={"mean_ptr": "*fp32", "rstd_ptr": "*fp32"},
                         floats=("eps", "offset")))
        for h, tile in ((H, knobs.bwd_tile_elems), (896, knobs.bwd_small_h_tile_elems)):
            bm, bn, w = row_tile(h, N_TOKENS, tile, knobs.max_rows_per_tile)
            bwd = dict(extra, HAS_WEIGHT=True, COMPUTE_DX=True, COMPUTE_DW=True, BLOCK_M=bm, BLOCK_N=bn,
                       TILE_ACC=h <= knobs.bwd_small_h, PREFETCH=knobs.bwd_prefetch, PDL=True)
            if mod is layer_norm:
                bwd["COMPUTE_DB"] = True
            cases[f"{kernel}_bwd H={h} {bm}x{bn}/{w}"] = (
                lambda k=getattr(mod, kernel + "_bwd_kernel"), c=bwd, w=w:
                compile_case(k, constexprs=c, num_warps=w,
                             pointers={n: "*fp32"
                                       for n in ("mean_ptr", "rstd_ptr", "dw_partial_ptr", "db_partial_ptr")},
                             floats=("offset",)))
    sums = norm_common.SUM_TUNING.current
    cases["sum_partials"] = lambda: compile_case(
        norm_common._sum_partials_kernel, num_warps=4, default_ptr="*fp32",
        constexprs=dict(BLOCK_R=sums.tile_elems // sums.block_cols,  # >= 132 rows: one tile
                        BLOCK_C=sums.block_cols, PDL=True))

    half, half_block, pass_dims, pass_block, bhq, bhk, w, lf = rope._config(HEAD_DIM, HEAD_DIM, N_QH, N_KH, True)
    for backward in (False, True):
        cases[f"rope {'bwd' if backward else 'fwd'} heads {bhq}/{bhk}/{w}{' loads first' if lf else ''}"] = (
            lambda b=backward: compile_case(
                rope._rope_kernel, num_warps=w,
                constexprs=dict(HALF=half, HALF_BLOCK=half_block, PASS=pass_dims, PASS_BLOCK=pass_block,
                                BLOCK_HQ=bhq, BLOCK_HK=bhk, BACKWARD=b, LOADS_FIRST=lf, REPEAT_TABLES=True,
                                HEAD_STRIDE=HEAD_DIM, PDL=True)))
    for slot, name, act in ((swiglu.SWIGLU_TUNING, "swiglu", 0), (geglu.GEGLU_TUNING, "geglu", 1)):
        knobs = slot.current
        for part in ("fwd", "bwd"):
            extra = {"ACT": act} if part == "fwd" else {"ACT": act, "WRITE_PROD": False}
            cases[f"{name}_{part} {knobs.block_size}/{knobs.num_warps}"] = (
                lambda k=getattr(gated, f"gated_{part}_kernel"), g=knobs, e=extra:
                compile_case(k, constexprs=dict(e, BLOCK=g.block_size), num_warps=g.num_warps))
    return cases


def alternative_cases() -> dict:
    """Configurations worth timing on a GPU (not defaults): CE tile at liger-kernel's shape, RMSNorm
    backward with 2-row tiles (the 4-row default spills a little yet timed fastest on the H200)."""
    bm, bn, w = row_tile(H, N_TOKENS, 8192, rms_norm.RMS_NORM_TUNING.current.max_rows_per_tile)
    return {
        "divergence_tile jsd 2048/8 lane sums": lambda: _divergence_case(BLOCK=2048, num_warps=8, LANE_SUMS=True),
        "divergence_tile jsd 4096/8 lane sums": lambda: _divergence_case(BLOCK=4096, num_warps=8, LANE_SUMS=True),
        "rope fwd loads first 32/8/8": lambda: compile_case(
            rope._rope_kernel, num_warps=8,
            constexprs=dict(HALF=HEAD_DIM // 2, HALF_BLOCK=HEAD_DIM // 2, PASS=0, PASS_BLOCK=1,
                            BLOCK_HQ=N_QH, BLOCK_HK=N_KH, BACKWARD=False, LOADS_FIRST=True, REPEAT_TABLES=True,
                            HEAD_STRIDE=HEAD_DIM, PDL=True)),
        "logits_tile ce 32768/32 (per-block sums)": lambda: _logits_case(32768, 32, False, STAGES1=None, STAGES2=None),
        "logits_tile ce 16384/32 (per-block sums)": lambda: _logits_case(16384, 32, False, STAGES1=None, STAGES2=None),
        "logits_tile ce 4096/8 (not pipelined)": lambda: _logits_case(4096, 8, True, STAGES1=None, STAGES2=None),
        "logits_tile ce 4096/8, loops pipelined 3/3": lambda: _logits_case(4096, 8, True, STAGES1=3, STAGES2=3),
        "logits_tile ce 8192/16, loops pipelined 3/3": lambda: _logits_case(8192, 16, False, STAGES1=3, STAGES2=3),
        # register caps (diag_tile_occupancy.py): programs per SM = 65536 / (32 * warps * regs)
        "logits_tile ce 2048/4 maxnreg 128": lambda: _logits_case(2048, 4, True, maxnreg=128),
        "logits_tile ce 4096/8 maxnreg 128": lambda: _logits_case(4096, 8, True, maxnreg=128),
        "logits_tile ce 8192/8 maxnreg 255": lambda: _logits_case(8192, 8, False, maxnreg=255),
        "logits_tile ce 8192/16 maxnreg 128": lambda: _logits_case(8192, 16, False, maxnreg=128),
        "divergence_tile jsd 4096/8 maxnreg 80": lambda: _divergence_case(num_warps=8, maxnreg=80),
        "divergence_tile jsd 4096/8 maxnreg 128": lambda: _divergence_case(num_warps=8, maxnreg=128),
        "divergence_tile jsd 8192/16 maxnreg 128": lambda: _divergence_case(BLOCK=8192, num_warps=16, maxnreg=128),
        f"_rms_norm_bwd H={H} {bm}x{bn}/{w}": lambda: compile_case(
            rms_norm._rms_norm_bwd_kernel, num_warps=w,
            constexprs=dict(CASTING=0, HAS_WEIGHT=True, COMPUTE_DX=True, COMPUTE_DW=True, BLOCK_M=bm, BLOCK_N=bn,
                            TILE_ACC=False, PREFETCH=True, PDL=True),
            pointers={"rstd_ptr": "*fp32", "dw_partial_ptr": "*fp32"}, floats=("offset",)),
    }


def main() -> None:
    as_json = "--json" in sys.argv[1:]
    groups = [("default", default_cases())]
    if "--defaults" not in sys.argv[1:]:
        groups.append(("alternative", alternative_cases()))
    results = {}
    for group, cases in groups:
        for name, thunk in cases.items():
            try:
                results[name] = dict(group=group, **thunk())
            except Exception as exc:  # noqa: BLE001 - report, keep going
                results[name] = dict(group=group, error=f"{type(exc).__name__}: {exc}"[:300])
    if as_json:
        print(json.dumps(results))
        return
    for name, r in results.items():
        if "error" in r:
            print(f"{r['group']:11s} {name:45s} ERROR {r['error']}")
        else:
            print(f"{r['group']:11s} {name:45s} regs {r['regs']:3d}  stack {r['stack']:4d}  warps {r['num_warps']}")


if __name__ == "__main__":
    main()
