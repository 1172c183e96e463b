"""Run a function on 2 CPU processes joined by torch.distributed's gloo backend (the tests' launcher).

``run_on_ranks(target, *args, world=2, init_process_group=True)`` spawns ``world`` processes; process
``r`` gets the environment a launcher (``torchrun`` / ``accelerate launch``) gives it -- ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` -- and calls
``target(rank, world, *args)``; with ``init_process_group`` the gloo group is made first (accelerate makes
its own otherwise). Returns the ``world`` return values ordered by rank; a worker's exception is re-raised
here with its traceback. ``target`` must be a module-level function (spawn pickles it by name).

The workers run the engine's pure-PyTorch path (``TRITON_INTERPRET=0``, no CUDA): Triton's CPU interpreter
computes ``tl.dot`` on bf16 wrongly, and the sharding logic under test does not depend on the kernel.
``skip_unless_gloo_fsdp2()`` skips a test where gloo or ``torch.distributed.fsdp.fully_shard`` is missing.
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest


def skip_unless_gloo_fsdp2() -> None:
    """``pytest.skip`` unless torch has gloo and FSDP2's ``fully_shard``/``MixedPrecisionPolicy``."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available")
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
    except ImportError:
        pytest.skip("torch.distributed.fsdp.fully_shard (FSDP2) is not available")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, init_pg, target, args, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), TRITON_INTERPRET="0",
        CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if init_pg:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        queue.put((rank, True, target(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(target, *args, world: int = 2, init_process_group: bool = True, timeout: float = 300.0):
    """``[target(r, world, *args) for r in ranks]``, each in its own gloo process (see the module docstring)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, init_process_group, target, args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in procs:
            rank, ok, value = queue.get(timeout=timeout)
            (results.__setitem__(rank, value) if ok else errors.append(f"rank {rank}:\n{value}"))
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("a rank failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world)]
