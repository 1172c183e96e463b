"""Experiment (paper, no GPU): the LM head's per-GPU memory and communication under full sharding.

Question: with FSDP2 full shard or DeepSpeed ZeRO-3 over N GPUs, what does the fused loss's LM head cost each
GPU per optimizer step -- transient memory while the loss runs, persistent memory, bytes on the wire -- at 8,
64 and 512 GPUs, for a Llama-3-8B head (V=128256, H=4096, untied) and a Llama-3-70B head (V=128256, H=8192)?

Verdict: the transient part does not shrink with N. Every GPU holds the whole bf16 head while the loss runs
(the fused loss needs all V rows for each token's softmax), plus its whole bf16 gradient until the
reduce-scatter, plus one logits tile: 2.6 GB (8B head) and 5.3 GB (70B head) at any N. Only the persistent
fp32 master, Adam moments and fp32 gradient shard (16 bytes a weight, over N) shrink: 1.05 GB at 8 GPUs to
16 MB at 512 for the 8B head. Communication per GPU per step is ~1.05 GB (8B) / 2.1 GB (70B) per all-gather of
the bf16 head plus the same for the bf16 reduce-scatter of its gradient ((N-1)/N of the head each, so
constant in N); ZeRO-3 and FSDP2 with ``reshard_after_forward=True`` on the head gather it twice (forward and
backward), accelerate's FSDP2 layout once (its ``[norm, lm_head]`` group keeps the head from forward to
backward). At an assumed 45 GB/s per GPU across nodes that is 47-70 ms (8B) / 93-140 ms (70B) a step for the
head alone (5-8 / 11-16 ms within one NVLink node), against ~0.15 s / 0.30 s of head GEMMs at 32k tokens per
GPU: hide it behind the layers' compute (prefetch) or keep the head's group within a node (HSDP).

Status: arithmetic only, printed by this script; the GPU runs that check it are listed in the README
("Multi-GPU") and in issue 20.

Model of one step (per GPU; B = bytes; N GPUs; V x H head; T tokens per GPU; ring collectives):

* persistent: fp32 master + Adam m, v + fp32 gradient shard = 16 VH / N B;
* transient while the loss runs: the all-gathered bf16 head 2VH + its full bf16 gradient 2VH (the one-pass
  engine computes it in the forward and holds it until the backward hands it to the reduce-scatter; an fp32
  accumulator, ``accum_dtype=torch.float32``, makes it 4VH) + one logits tile (the engine's default budget,
  ``liger_losses.chunked.planning.tile_budget``: max(256 MiB, half the bf16 head));
* wire: each all-gather receives (N-1)/N x 2VH, the reduce-scatter sends (N-1)/N x 2VH (bf16 reduce; 4VH with
  an fp32 ``reduce_dtype``); gathers per step: 1 (FSDP2 head kept from forward to backward) or 2 (ZeRO-3,
  FSDP2 ``reshard_after_forward=True``);
* time: wire bytes / bus bandwidth, 350 GB/s within an 8-GPU NVLink node, 45 GB/s per GPU across nodes
  (a 400 Gb/s NIC per GPU at ~90%): assumptions, not measurements; head GEMMs 6 T H V FLOPs at 680 TFLOP/s.

    python -m benchmark.experiments.head_comm_on_paper [--tokens-per-gpu 32768]
"""

from __future__ import annotations

import argparse

from liger_losses.chunked.planning import tile_budget

HEADS = {"Llama-3-8B": (128256, 4096), "Llama-3-70B": (128256, 8192)}
GPUS = (8, 64, 512)
NVLINK_GBPS = 350.0  # bus bandwidth within one 8-GPU node (assumed)
NETWORK_GBPS = 45.0  # per GPU across nodes (assumed)
GEMM_TFLOPS = 680.0  # bf16 GEMMs at the H200's power cap (DESIGN.md)
GB = 1e9


def head_row(vocab: int, hidden: int, gpus: int, tokens_per_gpu: int) -> dict:
    """One table row of the model in the module docstring (bytes, seconds)."""
    weights = vocab * hidden
    head_bf16 = 2 * weights
    tile = tile_budget(vocab, hidden, 2)
    ring = (gpus - 1) / gpus
    gather = ring * head_bf16
    reduce = ring * head_bf16
    bandwidth = (NVLINK_GBPS if gpus <= 8 else NETWORK_GBPS) * GB
    return {
        "persistent": 16 * weights / gpus,
        "transient": head_bf16 + head_bf16 + tile,
        "tile": tile,
        "gather": gather,
        "reduce": reduce,
        "wire_1": gather + reduce,
        "wire_2": 2 * gather + reduce,
        "time_1": (gather + reduce) / bandwidth,
        "time_2": (2 * gather + reduce) / bandwidth,
        "gemm": 6 * tokens_per_gpu * hidden * vocab / (GEMM_TFLOPS * 1e12),
    }


def table(tokens_per_gpu: int) -> str:
    lines = [
        "| head | GPUs | persistent / GPU | transient / GPU (head + grad + tile) | all-gather in / GPU "
        "| reduce-scatter out / GPU | wire / step, 1 gather (2 gathers) | comm time, 1 (2) gathers "
        f"| head GEMMs, {tokens_per_gpu} tok/GPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (vocab, hidden) in HEADS.items():
        for gpus in GPUS:
            r = head_row(vocab, hidden, gpus, tokens_per_gpu)
            lines.append(
                f"| {name} ({vocab}x{hidden}) | {gpus} | {r['persistent'] / GB:.3f} GB "
                f"| {r['transient'] / GB:.2f} GB (tile {r['tile'] / GB:.2f}) | {r['gather'] / GB:.2f} GB "
                f"| {r['reduce'] / GB:.2f} GB | {r['wire_1'] / GB:.2f} ({r['wire_2'] / GB:.2f}) GB "
                f"| {r['time_1'] * 1e3:.0f} ({r['time_2'] * 1e3:.0f}) ms | {r['gemm'] * 1e3:.0f} ms |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens-per-gpu", type=int, default=32768, help="valid tokens per GPU per step")
    args = parser.parse_args()
    print(table(args.tokens_per_gpu))
    print(f"\nbandwidth assumed: {NVLINK_GBPS:.0f} GB/s within 8 GPUs (NVLink), {NETWORK_GBPS:.0f} GB/s per GPU "
          f"across nodes; GEMMs at {GEMM_TFLOPS:.0f} TFLOP/s; GB = 1e9 bytes.")


if __name__ == "__main__":
    main()
