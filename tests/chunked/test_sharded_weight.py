"""A sharded LM head (a ``DTensor`` weight, as under tensor parallelism or FSDP2 outside its
forward) through the chunked engine, on the CPU with the gloo backend.

The engine gathers the full weight in one place (``gather_weight``) and hands autograd a gradient
laid out like the weight (``weight_grad_like``). With the hidden states replicated on every rank,
each rank's gradient shard must equal its rows of the full gradient of an unsharded float64 run
(fp32 tolerance 1e-5), and the loss must match on every rank.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

V, H, B, T = 48, 8, 2, 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g)
    h = torch.randn(B, T, H, generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, :2] = -100
    w64 = w.double().requires_grad_(True)
    h64 = h.double().requires_grad_(True)
    logits = (h64 @ w64.t()).reshape(-1, V)
    loss = torch.nn.functional.cross_entropy(logits, y.reshape(-1), ignore_index=-100)
    loss.backward()
    return w, h, y, float(loss), w64.grad, h64.grad


def _worker(rank: int, world: int, port: int, placement: str, queue) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        from liger_losses import fused_linear_cross_entropy

        mesh = init_device_mesh("cpu", (world,))
        w, h, y, ref_loss, ref_gw, ref_gh = _reference(seed=7)
        place = [Shard(0)] if placement == "shard" else [Replicate()]
        weight = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, place))
        hidden = h.clone().requires_grad_(True)
        loss = fused_linear_cross_entropy(weight, hidden, y, impl="torch")
        loss.backward()
        local = weight.grad.to_local().double()
        rows = V // world
        want = ref_gw[rank * rows:(rank + 1) * rows] if placement == "shard" else ref_gw
        err_w = float((local - want).norm() / want.norm())
        err_h = float((hidden.grad.double() - ref_gh).norm() / ref_gh.norm())
        queue.put((rank, abs(float(loss) - ref_loss) / abs(ref_loss), err_w, err_h,
                   tuple(type(p).__name__ for p in weight.grad.placements)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("placement", ["shard", "replicate"])
def test_dtensor_weight_two_ranks(placement):
    """Two gloo ranks, weight Shard(0) over the vocabulary (or Replicate): loss and hidden grad
    equal the unsharded float64 reference (<= 1e-5), and each rank's weight-grad shard equals its
    rows of the full reference gradient (<= 1e-5), with the weight's placement."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, placement, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    want_place = ("Shard",) if placement == "shard" else ("Replicate",)
    for rank, err_loss, err_w, err_h, place in results:
        assert err_loss <= 1e-5, (rank, err_loss)
        assert err_w <= 1e-5, (rank, err_w)
        assert err_h <= 1e-5, (rank, err_h)
        assert place == want_place
