"""Experiment (GPU): the cost of first-index argmax hits in the two row kernels.

Question: token accuracy counts a label as a hit when it is the row's first maximal column (as
``torch.argmax`` and TRL's ``mean_token_accuracy``), not when it merely ties the maximum. The logits
tile kernel (``kernels/logits_tile.py``) keeps a scalar per block (the maximum of the blocks wholly
before the label's) and re-reads the label block's prefix once; the frozen head's block kernel
(``kernels/online_block.py``) keeps ``zpre``, the maximum of the columns before the label, re-reading
the prefix only in the label's block. What do they cost against the kernels before, alone (L2
flushed, ``do_bench`` median)? (The first measurement, in ``benchmark/NOTES.md``, timed earlier
variants: a per-lane first-argmax column in the block kernel cost 16% of it.)

Times, for the tree on ``PYTHONPATH`` (``--one``), in microseconds:

- ``tile``: ``logits_tile`` on a ``[2048, 128256]`` bf16 tile, cross-entropy with the gradient
  into a second buffer (``0.02 * randn`` head on ``randn`` hidden states: logits of std ~1.3);
- ``tile_entropy``: the same with the entropy (one more per-lane sum, as the SFT trainer's);
- ``block``: ``online_block`` on a ``[512, 16032]`` bf16 block (a later block: the state read);

and, with ``--compare old=TREE new=TREE``, runs itself once per tree in alternating subprocesses over
``--rounds`` and prints each key's median (min..max) and new / old.

    python -m benchmark.experiments.diag_argmax_ties --compare old=old_tree new=. [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

V, BLOCK_COLS = 128256, 16032


def _one() -> dict:
    import torch
    import triton.testing

    import liger_losses
    from liger_losses.kernels.logits_tile import logits_tile
    from liger_losses.kernels.online_block import OnlineState, online_block

    g = torch.Generator(device="cuda").manual_seed(0)
    out = {"package": os.path.dirname(liger_losses.__file__)}
    x0 = (torch.randn(2048, V, device="cuda", generator=g) * 1.3).to(torch.bfloat16)
    labels = torch.randint(0, V, (2048,), device="cuda", generator=g)
    grad = torch.empty_like(x0)  # the gradient written beside the logits: every call sees the same logits
    for key, ent in (("tile", False), ("tile_entropy", True)):
        out[key] = 1000 * triton.testing.do_bench(
            lambda ent=ent: logits_tile(x0, labels, mode="ce", grad=True, need_entropy=ent, out=grad),
            warmup=20, rep=300)
    blk0 = (torch.randn(512, BLOCK_COLS, device="cuda", generator=g) * 1.3).to(torch.bfloat16)
    blk_labels = torch.randint(0, V, (512,), device="cuda", generator=g)
    state = OnlineState.empty(512, "cuda")
    acc = torch.zeros(512, 4096, device="cuda")
    blk = blk0.clone()
    online_block(blk, blk_labels, 0, state, None, first=True)
    out["block"] = 1000 * triton.testing.do_bench(
        lambda: online_block(blk, blk_labels, BLOCK_COLS, state, acc, first=False), warmup=20, rep=300)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", action="store_true", help="time the tree on PYTHONPATH, print JSON")
    ap.add_argument("--compare", nargs="+", default=None, metavar="NAME=TREE")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.one or not args.compare:
        print(json.dumps(_one()))
        return
    trees = dict(item.split("=", 1) for item in args.compare)
    here = os.getcwd()
    runs = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(tree), here,
                                                               os.environ.get("PYTHONPATH", "")]))
            # run as a script, not with -m: -m puts the working directory ahead of the tree on sys.path
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--one"],
                                 env=env, capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(f"tree {name} failed:\n{res.stderr[-3000:]}")
            rec = json.loads(res.stdout.strip().splitlines()[-1])
            package = rec.pop("package")
            if not package.startswith(os.path.abspath(tree)):
                raise SystemExit(f"tree {name}: imported {package}, not the tree's package")
            runs[name].append(rec)
    names = list(trees)
    for key in runs[names[0]][0]:
        meds = {}
        for name in names:
            vals = [r[key] for r in runs[name]]
            meds[name] = statistics.median(vals)
            print(f"{key:14s} {name:6s} {meds[name]:9.1f} us ({min(vals):.1f}..{max(vals):.1f})")
        if len(names) == 2:
            print(f"{key:14s} {names[1]} / {names[0]} = {meds[names[1]] / meds[names[0]]:.3f}")


if __name__ == "__main__":
    main()
