"""Experiment (GPU): why is the fused MLP tail slower inside a training step than alone?

Question: ``gated_down_proj`` (the MLP's product ``act(gate) * up`` never saved) is within +-1% of the
unfused MLP alone, checkpointed mode included (``bench_mlp_tail``), and takes 864 MiB (DPO) / 416 MiB
(SFT) off a Llama-3.2-1B trainer step's peak -- yet the step is 2.5-4% slower (``bench_trainer``,
``results/trainer_b8_fused_mlp.csv``). Where does the time go? This runs the model's step without TRL.

Verdict so far (H200, 16 x 2048 tokens): not the blocking and not the clocks. Step times: unfused 561 ms,
fused in one block (the unfused MLP's GEMMs exactly, only the product unsaved) 591 ms (+5.2%), blocks
of 2^25 594 ms (+5.7%). In the profile every layer GEMM is 5-10% slower in the fused steps, even the
q/o projections the tail does not touch (423 vs 393 us) and gate/up forward (1653 vs 1567 us). SM
clock (1511-1538 MHz), power (692 W, the cap) and temperature, sampled every 200 ms, are equal across
variants; ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` leaves the slowdown at 5.6-6.0%. A clue:
the unfused step's ``[32768, 8192] @ [8192, 2048]`` GEMMs averaged 1113 us (988 TFLOP/s, above what the
power cap allows on random operands) against 1557-1631 us fused -- operands of different sparsity run
at different speeds at the cap (``diag_gemm_power``), or the profiler groups two different GEMMs there.

Status: open. Next: time that GEMM alone on the step's real inputs; Nsight per-kernel clocks. The
tail stays off by default (``mlp={"fuse_down_proj": False}``, kernels/mlp.py).

A Llama-3.2-1B-shaped model (benchmark/trainer_data.py, bf16, random init), patched with
``apply_liger_kernels``, gradient checkpointing (non-reentrant) and bf16 autocast as TRL runs it,
a batch of ``--batch`` x ``--seq`` random tokens as labels: forward (chunked cross-entropy in the
patched forward), backward, gradients set to None -- no optimizer, no trainer. Variants:

    unfused      mlp knob fuse_down_proj=False (the default)
    fused-whole  fuse_down_proj=True, gated_down knobs chunk_elems = forward_chunk_elems = 2^62 (one
                 block: the unfused MLP's GEMMs exactly, the product not saved)
    fused-2^25   fuse_down_proj=True with both gated_down buffers at 2^25 elements (token chunks /
                 column blocks)

Per variant: median ms per step over ``--steps`` (CUDA-synchronised wall time) and the peak
allocated above the model. With ``--profile``: per variant one profiled step, GEMMs grouped by
input shapes (``aten::mm``/``aten::addmm``, CUDA time and calls), the total CUDA time of the step's
kernels against its wall time (the idle share), and the host time of our autograd Functions.

    python -m benchmark.experiments.diag_mlp_tail_model [--batch 8 --seq 2048 --steps 5 --profile]
    python -m benchmark.experiments.diag_mlp_tail_model --tiny      # CPU smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

VARIANTS = {"unfused": (False, None), "fused-whole": (True, 1 << 62), "fused-2^25": (True, 1 << 25)}


def variant_tuning(fuse: bool, chunk):
    """The knobs of one variant for a ``with`` block: the MLP's fused-tail switch and, unless
    ``chunk`` is None (the defaults), both of ``gated_down``'s buffer sizes."""
    import liger_losses.kernels.gated_down  # noqa: F401 - registers the gated_down slot
    import liger_losses.kernels.mlp  # noqa: F401 - registers the mlp slot
    from liger_losses.kernels.tuning import tuning

    buffers = {} if chunk is None else {"chunk_elems": chunk, "forward_chunk_elems": chunk}
    return tuning(mlp={"fuse_down_proj": fuse}, gated_down=buffers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="variants run in turn this many times")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny model, 1 step)")
    args = ap.parse_args()

    from benchmark.trainer_data import LLAMA_3_2_1B, TINY, build_model
    from liger_losses.patching import apply_liger_kernels

    tiny = args.tiny
    device = "cpu" if tiny else "cuda"
    shape = TINY if tiny else LLAMA_3_2_1B
    batch, seq, steps = (2, 32, 1) if tiny else (args.batch, args.seq, args.steps)
    model = build_model(shape, device=device, dtype=torch.bfloat16, seed=0)
    apply_liger_kernels(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), generator=gen).to(device)

    def step():
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss

    def sync():
        if not tiny:
            torch.cuda.synchronize()

    results: dict = {name: [] for name in VARIANTS}
    peaks: dict = {}
    for _ in range(1 if tiny else args.rounds):
        for name, (fuse, chunk) in VARIANTS.items():
            with variant_tuning(fuse, chunk):
                step()
                step() if not tiny else None
                sync()
                if not tiny:
                    torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated() if not tiny else 0
                print(f"{name} timed steps from {time.time():.2f}", flush=True)  # to line up with nvidia-smi samples
                for _ in range(steps):
                    t0 = time.perf_counter()
                    step()
                    sync()
                    results[name].append((time.perf_counter() - t0) * 1e3)
                peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**20 if not tiny else float("nan")
                print(f"{name} timed steps to {time.time():.2f}", flush=True)
    ref = statistics.median(results["unfused"])
    print(f"{batch} x {seq} tokens, {'tiny' if tiny else 'Llama-3.2-1B shape'}: "
          "ms per step (median) and peak above the model")
    for name, ms in results.items():
        med = statistics.median(ms)
        print(f"  {name:12s} {med:8.1f} ms  ({med / ref:.3f}x unfused)  peak {peaks[name]:8.0f} MiB   "
              f"all: {' '.join(f'{t:.1f}' for t in ms)}")

    if args.profile and not tiny:
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        for name, (fuse, chunk) in VARIANTS.items():
            with variant_tuning(fuse, chunk):
                step()
                sync()
                with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
                    t0 = time.perf_counter()
                    step()
                    sync()
                    wall = (time.perf_counter() - t0) * 1e3
            events = prof.key_averages(group_by_input_shape=True)
            try:
                kernel_ms = sum(e.device_time_total for e in prof.events()
                                if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
            except Exception:  # noqa: BLE001 - profiler API differences between torch versions
                kernel_ms = float("nan")
            print(f"\n== {name}: profiled step wall {wall:.1f} ms, CUDA kernels {kernel_ms:.1f} ms")
            gemms = [e for e in events if e.key in ("aten::mm", "aten::addmm", "aten::addmm_")]
            gemms.sort(key=lambda e: -e.device_time_total)
            for e in gemms[:24]:
                print(f"  {e.key:12s} calls {e.count:4d}  cuda {e.device_time_total / 1e3:8.2f} ms  "
                      f"avg {e.device_time_total / max(e.count, 1):8.1f} us  shapes {e.input_shapes}")
            ours = [e for e in prof.key_averages() if "Function" in e.key]
            ours.sort(key=lambda e: -e.cpu_time_total)
            for e in ours[:8]:
                print(f"  host {e.key:36s} calls {e.count:4d}  self cpu {e.self_cpu_time_total / 1e3:7.2f} ms  "
                      f"cuda {e.device_time_total / 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
