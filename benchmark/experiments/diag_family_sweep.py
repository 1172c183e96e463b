"""Experiment (CPU): does every causal-LM family of the installed transformers train the same objective under
our trainers as under its own forward?

Question: the TRL adapters never call the model's forward for the loss; they run its backbone and read its LM
head and logit transform (``trl_integration/anatomy.py``). A family that does something else between the last
hidden state and the logits (a scale, a cap, a norm, a prediction transform, a vocabulary cut) would train
another objective, silently. TRL 1.16's own trainer is no reference: its fused LM head reads the same config
attributes.

For each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: a tiny random fp32 model (width 64, 2 layers,
no dropout, head weights of std 0.5, every logit-path config field set away from its default), our
``SFTTrainer(use_liger=True)`` against TRL's on deep copies (``tests/trl_integration/utils.py``), and both
against "truth": the class's own ``forward(...).logits`` on an untouched copy, scored as the token-mean NLL
(plus the router loss where the trainers add it); loss and every gradient to a relative error of 1e-4. Each
family runs in a subprocess (memory-capped); results are JSON lines, one class per family: PASS, MISMATCH
(against truth; "(TRL too)" when TRL's trainer is as wrong), ERROR_INIT / ERROR_STEP (ours raised),
TRL_ERROR, BUILD_ERROR (the tiny config could not be built).

transformers 5.25, TRL 1.16 (results in ``benchmark/NOTES.md``, "The trainers on the families users bring").
~200 families, ~40 min on 2 CPU cores.

    python benchmark/experiments/diag_family_sweep.py all --jobs 2 --out /tmp/families.jsonl
    python benchmark/experiments/diag_family_sweep.py one xlstm [--nopatch]
"""
import copy
import json
import math
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "trl_integration"))

TOL = 1e-4
# non-default values for every logit-path field a config defines, so a missed transform shows
LOGIT_FIELDS = dict(
    logit_scale=0.25, lm_head_multiplier=0.5, logits_scaling=4.0, final_logit_softcapping=5.0,
    logits_soft_cap=5.0, output_logit_soft_cap=5.0, logits_mup_width_multiplier=4.0, lm_head_bias=True,
    mup_enabled=True, output_multiplier=0.5, embedding_multiplier=2.0, residual_multiplier=0.5,
    scale_emb=3.0, embedding_scale=2.0, mup_width_multiplier=4.0, width_multiplier=4.0, dim_model_base=16,
)
GENERIC = dict(
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=128,
    # MoE
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    n_shared_experts=1, n_group=1, topk_group=1, shared_expert_intermediate_size=32, moe_num_experts=4,
    moe_k=2, first_k_dense_replace=1, num_shared_experts=1, moe_topk=2,
    # MLA
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    # misc
    n_layer=2, n_head=4, n_embd=64, d_model=64, num_layers=2, ffn_dim=128, n_positions=128, n_ctx=128,
    decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128, encoder_layers=2,
    encoder_attention_heads=4, encoder_ffn_dim=128, n_inner=128, embedding_size=64, d_ff=128,
    sliding_window=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_expand=2,
    ssm_state_size=16, state_size=16, n_heads=4, d_head=16, rotary_dim=8,
)
# per-family extras (added on top of GENERIC/LOGIT_FIELDS; these win)
FAMILY = {
    "cohere": dict(tie_word_embeddings=True),
    **{k: dict(per_layer_config={}, layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=16,
               vocab_size_per_layer_input=47, num_kv_shared_layers=0)
       for k in ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text", "gemma4_unified_assistant")},
    "gemma4_assistant": dict(per_layer_config={}, layer_types=["sliding_attention", "full_attention"],
                             hidden_size_per_layer_input=0, num_kv_shared_layers=0),
    "gemma3n_text": dict(layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0,
                         hidden_size_per_layer_input=16, vocab_size_per_layer_input=47, altup_num_inputs=2,
                         laurel_rank=8, activation_sparsity_pattern=[0.0, 0.0]),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "mamba2": dict(num_heads=4, head_dim=32, expand=2, n_groups=1),
    "zaya": dict(num_experts_per_tok=1),
    "falcon_h1": dict(mamba_d_ssm=128, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1),
    "reformer": dict(is_decoder=True, axial_pos_shape=[8, 16], axial_pos_embds_dim=[32, 32],
                     attn_layers=["local", "local"],
                     local_attn_chunk_length=8, lsh_attn_chunk_length=8, max_position_embeddings=128),
    "cwm": dict(bos_token_id=1),  # must be an int there
    "phimoe": dict(router_jitter_noise=0.0, input_jitter_noise=0.0),  # random in training: no truth to compare
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


def _defaults(mt):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    try:
        return CONFIG_MAPPING[mt]()
    except Exception:
        return None


def _has(d, k):
    try:
        return hasattr(d, k)
    except Exception:  # per-layer attributes of heterogeneous configs raise on global access
        return k in d.to_dict()


def tiny_model(tok, mt, seed=0):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    d0 = _defaults(mt)
    subs = getattr(d0, "sub_configs", None) or {}
    d = d0.text_config if "text_config" in subs and getattr(d0, "text_config", None) is not None else d0
    kw = dict(vocab_size=len(tok), hidden_size=64, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
              bos_token_id=None)
    set_logit = {}
    for k, v in {**GENERIC, **LOGIT_FIELDS}.items():
        if d is None or (_has(d, k) and not isinstance(getattr(type(d), k, None), property)):
            kw[k] = v
            if k in LOGIT_FIELDS:
                set_logit[k] = v
    if d is not None and isinstance(getattr(d, "bos_token_id", None), int):  # strict int field in some configs
        kw["bos_token_id"] = tok.eos_token_id
    if d is not None:  # no dropout anywhere: the two runs must see the same network
        for k, v in d.to_dict().items():
            if re.search(r"(dropout|pdrop|layerdrop|drop_rate|drop_prob|dropout_prob)", k) and isinstance(v, float):
                kw[k] = 0.0
    if "qk_rope_head_dim" in kw and "head_dim" in kw:  # MLA: the rotary's head_dim is the rope part
        kw["head_dim"] = kw["qk_rope_head_dim"]
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    if d is not None and _has(d, "unpadded_vocab_size"):  # a padded vocabulary the logits are cut back from
        kw["vocab_size"] = len(tok) + 8
        kw["unpadded_vocab_size"] = len(tok)
        set_logit["unpadded_vocab_size"] = len(tok)
    kw.update(FAMILY.get(mt, {}))
    if d is not d0:  # composite (vision/audio-language): the tiny sizes go to the text model
        tk = dict(kw)  # the text config takes the token ids too
        ids = ("pad_token_id", "eos_token_id", "bos_token_id")
        kw = {"text_config": tk, **{k: kw[k] for k in ids if hasattr(d0, k)}}
        tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, depth=1,
                    num_heads=2, embed_dim=32, out_hidden_size=64, num_key_value_heads=2, head_dim=16,
                    hidden_dim=32, num_layers=1)
        for name in subs:
            if name == "text_config":
                continue
            sub = getattr(d0, name, None)
            if sub is not None:
                kw[name] = {k: v for k, v in tiny.items() if _has(sub, k)}
    config = AutoConfig.for_model(mt, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    for m in model.modules():  # hard-coded dropout modules too
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    head = model.get_output_embeddings()
    with torch.no_grad():
        if head is not None and isinstance(getattr(head, "weight", None), torch.Tensor):
            head.weight.normal_(0, 0.5)  # logits of order 1-5: a missed softcap / scale shows
        if getattr(head, "bias", None) is not None:
            torch.nn.init.normal_(head.bias, std=0.5)
        for n, p in (head.named_parameters() if head is not None else []):
            if n not in ("weight", "bias"):  # a learned head parameter (a logit scale...): away from its init
                p.mul_(1 + 0.5 * torch.randn_like(p))
    return model, set_logit


def compare(theirs, ours, pristine):
    from utils import first_batch, grads_of, rel, step0
    batch = first_batch(theirs)
    out = {}
    truth_model = pristine  # an untouched copy: the model's own forward (its real logits) is the ground truth
    try:
        loss_t, m_t = step0(theirs, dict(batch))  # TRL adds keys to the dict it gets
    except Exception as e:
        out = {"trl_msg": f"{type(e).__name__}: {e}"[:400]}
        try:
            loss_o, m_o = step0(ours, dict(batch))
        except Exception as e2:
            return {**out, "cls": "TRL_ERROR+ERROR_STEP", "msg": f"{type(e2).__name__}: {e2}"[:400],
                    "tb": traceback.format_exc()[-2500:]}
        loss_o.backward()
        out["loss_ours"] = float(loss_o)
        out.update(truth(truth_model, batch, loss_o, ours, loss_o, aux_coef(ours)))
        out["cls"] = "TRL_ERROR;ours_vs_truth=" + str(out.get("vs_truth"))
        return out
    try:
        loss_o, m_o = step0(ours, dict(batch))
    except Exception as e:
        return {"cls": "ERROR_STEP", "msg": f"{type(e).__name__}: {e}"[:400], "tb": traceback.format_exc()[-2500:]}
    out["loss_trl"], out["loss_ours"] = float(loss_t), float(loss_o)
    out["loss_rel"] = rel(loss_o, loss_t)
    merr = {}
    for k, v in m_t.items():
        if k not in m_o:
            merr[k] = "missing"
            continue
        merr[k] = abs(m_o[k] - v) if abs(v) < 1e-6 else rel(m_o[k], v)
    out["metrics"] = merr
    out["metrics_trl"] = {k: m_t[k] for k in ("entropy", "mean_token_accuracy") if k in m_t}
    out["metrics_ours"] = {k: m_o[k] for k in ("entropy", "mean_token_accuracy") if k in m_o}
    try:
        loss_t.backward()
        loss_o.backward()
        g_t, g_o = grads_of(theirs.model), grads_of(ours.model)
        gerr = {}
        gmax = max(float(g.norm()) for g in g_t.values())
        out["grad_tiny_skipped"] = []
        for n, g in g_t.items():
            if float(g.norm()) < 1e-6 * gmax and n in g_o and float(g_o[n].norm()) < 1e-5 * gmax:
                out["grad_tiny_skipped"].append(n)  # ~0 in exact math (e.g. attention key biases): noise
                continue
            if n not in g_o:
                gerr[n] = "missing"
            else:
                gerr[n] = float((g_o[n] - g).norm() / g.norm().clamp_min(1e-30))
        extra = sorted(set(g_o) - set(g_t))
        out["grad_extra"] = extra
        out["grad_max"] = max([v for v in gerr.values() if isinstance(v, float)] or [0.0])
        out["grad_worst"] = sorted(((v, n) for n, v in gerr.items() if isinstance(v, float)), reverse=True)[:3]
        out["grad_missing"] = [n for n, v in gerr.items() if v == "missing"]
    except Exception as e:
        return {**out, "cls": "ERROR_BACKWARD", "msg": f"{type(e).__name__}: {e}"[:400],
                "tb": traceback.format_exc()[-1500:]}
    out.update(truth(truth_model, batch, loss_o, ours, loss_t, aux_coef(ours)))
    bad = out["loss_rel"] > TOL or any(v == "missing" or (isinstance(v, float) and not v <= TOL and not math.isnan(v))
                                       for v in merr.values()) \
        or out["grad_max"] > TOL or out["grad_missing"] or extra or not g_t
    out["vs_trl"] = "MISMATCH" if bad else "PASS"
    vt = out.get("vs_truth")
    if vt == "PASS":
        out["cls"] = "PASS" if not bad else "MISMATCH_TRL_ONLY"
    elif vt == "MISMATCH":
        out["cls"] = "MISMATCH" if not out.get("trl_vs_truth_bad") else "MISMATCH(TRL too)"
    else:
        out["cls"] = ("MISMATCH" if bad else "PASS") + "(no truth)"
    return out


def aux_coef(trainer):
    return trainer.router_aux_loss_coef if getattr(trainer, "aux_loss_enabled", False) else 0.0


def truth(model, batch, loss_o, ours, loss_t, coef=0.0):
    """Token-mean NLL from the model's own logits (model(**inputs).logits, shifted labels); compared with our loss
    and our gradients (which were already computed by backward())."""
    import torch
    from utils import grads_of, rel
    res = {}
    try:
        model.train()
        kw = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
        kw["use_cache"] = False
        if coef:
            kw["output_router_logits"] = True
        fwd = type(model).forward(model, **kw)  # the class's forward, not an instance patch
        logits = fwd.logits
        labels = batch["labels"]
        if logits.shape[:2] != labels.shape[:2]:
            return {"vs_truth": "N/A", "truth_msg": f"logits {tuple(logits.shape)} vs labels {tuple(labels.shape)}"}
        lt = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)),
                                               labels[:, 1:].reshape(-1), ignore_index=-100)
        if coef and getattr(fwd, "aux_loss", None) is not None:  # the router loss both trainers add
            lt = lt + coef * fwd.aux_loss
            res["truth_aux"] = float(fwd.aux_loss)
        res["loss_truth"] = float(lt)
        with torch.no_grad():
            lg, lb = logits[:, :-1].float(), labels[:, 1:]
            m = lb != -100
            p = lg.log_softmax(-1)
            ent = -(p.exp() * p).sum(-1)[m].mean()
            res["entropy_truth"] = float(ent)
            res["acc_truth"] = float((lg.argmax(-1) == lb)[m].float().mean())
        res["ours_vs_truth_rel"] = rel(loss_o, lt)
        res["trl_vs_truth_rel"] = rel(loss_t, lt)
        lt.backward()
        g_truth, g_o = grads_of(model), grads_of(ours.model)
        gmax = max(float(g.norm()) for g in g_truth.values())
        errs = {}
        for n, g in g_truth.items():
            if float(g.norm()) < 1e-6 * gmax:
                continue
            if n not in g_o:
                errs[n] = 1.0
                continue
            errs[n] = float((g_o[n] - g).norm() / g.norm().clamp_min(1e-30))
        res["ours_vs_truth_grad_max"] = max(errs.values() or [0.0])
        res["ours_vs_truth_grad_worst"] = sorted(((v, n) for n, v in errs.items()), reverse=True)[:2]
        bad = res["ours_vs_truth_rel"] > TOL or res["ours_vs_truth_grad_max"] > TOL
        res["vs_truth"] = "MISMATCH" if bad else "PASS"
        res["trl_vs_truth_bad"] = res["trl_vs_truth_rel"] > TOL
    except Exception as e:
        res["vs_truth"] = "ERROR"
        res["truth_msg"] = f"{type(e).__name__}: {e}"[:300]
    return res


def run_one(mt, patch=True):
    import torch
    torch.set_num_threads(1)
    from utils import build_tokenizer, make_pair, sft_config, sft_dataset

    from liger_losses.trl_integration import SFTTrainer
    tok = build_tokenizer()
    res = {"model_type": mt, "patch": patch}
    try:
        model, set_logit = tiny_model(tok, mt)
        pristine = copy.deepcopy(model)
        res["logit_fields_set"] = set_logit
        res["arch"] = type(model).__name__
    except Exception as e:
        res.update(cls="BUILD_ERROR", msg=f"{type(e).__name__}: {e}"[:400], tb=traceback.format_exc()[-1500:])
        return res
    tmp = pathlib.Path(tempfile.mkdtemp())
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            theirs = make_pair(SFTTrainer, [model], lambda d: sft_config(d), tmp, lambda: sft_dataset(),
                               liger_kwargs={"liger_patch_model": patch}, processing_class=tok)
        res["unpatched_warning"] = any("layers stay transformers'" in str(w.message) for w in record)
    except Exception as e:
        # distinguish: TRL's own trainer alone?
        try:
            from trl import SFTTrainer as T
            T(copy.deepcopy(model), sft_config(tmp / "x"), train_dataset=sft_dataset(), processing_class=tok)
            trl_ok = True
        except Exception:
            trl_ok = False
        res.update(cls="ERROR_INIT" if trl_ok else "TRL_ERROR", msg=f"{type(e).__name__}: {e}"[:400],
                   tb=traceback.format_exc()[-2500:])
        return res
    theirs, ours = theirs
    res.update(compare(theirs, ours, pristine))
    return res


def main():
    if sys.argv[1] == "one":
        import resource  # a default-size model must not take the machine down
        resource.setrlimit(resource.RLIMIT_AS, (9 << 30, 9 << 30))
        mt = sys.argv[2]
        patch = "--nopatch" not in sys.argv
        warnings.filterwarnings("ignore")
        import logging
        logging.disable(logging.WARNING)
        t = time.time()
        try:
            res = run_one(mt, patch)
        except Exception as e:
            res = {"model_type": mt, "cls": "CRASH", "msg": repr(e)[:400], "tb": traceback.format_exc()[-2000:]}
        res["secs"] = round(time.time() - t, 1)
        print("RESULT " + json.dumps(res, default=str), flush=True)
        return
    from concurrent.futures import ThreadPoolExecutor

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as M
    args = sys.argv[2:]
    jobs = int(args[args.index("--jobs") + 1]) if "--jobs" in args else 2
    out = args[args.index("--out") + 1] if "--out" in args else "family_sweep.jsonl"
    only = args[args.index("--only") + 1].split(",") if "--only" in args else sorted(M)
    timeout = int(args[args.index("--timeout") + 1]) if "--timeout" in args else 240

    def go(mt, patch=True):
        cmd = [sys.executable, __file__, "one", mt] + ([] if patch else ["--nopatch"])
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
            line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
            if line:
                return json.loads(line[-1][7:])
            return {"model_type": mt, "patch": patch, "cls": "CRASH", "msg": (p.stderr or p.stdout)[-800:]}
        except subprocess.TimeoutExpired:
            return {"model_type": mt, "patch": patch, "cls": "TIMEOUT"}

    def both(mt):
        r = go(mt, True)
        settled = ("PASS", "BUILD_ERROR", "TRL_ERROR", "MISMATCH(TRL too)")
        if r.get("cls") not in settled and r.get("unpatched_warning") is False:
            r2 = go(mt, False)
            r["nopatch"] = {k: r2.get(k) for k in ("cls", "msg", "loss_rel", "grad_max")}
        with open(out, "a") as f:
            f.write(json.dumps(r, default=str) + "\n")
        print(mt, r.get("cls"), r.get("msg", "")[:150].replace("\n", " "), r.get("secs"), flush=True)
        return r

    with ThreadPoolExecutor(jobs) as ex:
        list(ex.map(both, only))


if __name__ == "__main__":
    main()
