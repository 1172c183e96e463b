"""A stand-in for DeepSpeed ZeRO-3's parameter partitioning, for tests where ``deepspeed`` cannot run.

It reproduces, on gloo ranks, the parts of ZeRO-3 (``deepspeed/runtime/zero``, 0.19) a fused head depends on:

* a partitioned parameter is an ``nn.Parameter`` with ``ds_id``, ``ds_shape`` (the full shape) and ``ds_status``
  (an enum whose ``.name`` is ``"NOT_AVAILABLE"`` or ``"AVAILABLE"``); while partitioned its ``data`` is empty
  and each rank keeps its rows in ``ds_tensor``;
* ``deepspeed.zero.GatheredParameters(params, modifier_rank=None)`` all-gathers the rows into ``data`` for the
  duration of the context and partitions them again on exit; nested contexts over one parameter raise, as
  DeepSpeed's do;
* inside the engine's forward, reading a partitioned parameter as a module attribute gathers it and registers
  it with the running module (ZeRO-3's ``ZeROOrderedDict.__getitem__`` and external parameters): the module
  releases it after its forward and gathers it again when the backward reaches the module's outputs (ZeRO-3's
  pre-backward hook), releasing it when the backward ends;
* the gradient reaches DeepSpeed through a hook on the parameter's gradient accumulator, created while the
  parameter was whole (ZeRO-3's ``create_reduce_and_remove_grad_hooks``): the hook reads the full ``param.grad``,
  reduces it over ranks (mean) into this rank's rows and sets ``param.grad = None``.

``install()`` puts a module named ``deepspeed`` with that ``zero.GatheredParameters`` into ``sys.modules`` (only in
a worker process, and after transformers is imported: transformers probes for a real deepspeed at import);
``partition(param, owner, root, rank, world)`` partitions ``param`` (owned by the module ``owner``; ``root`` is the
module whose forward plays the engine's); the reduced rows land in ``param.ds_grad_rows`` and the gathers and
hook calls are counted in ``param.ds_calls``.
"""

from __future__ import annotations

import enum
import sys
import types


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1
    NOT_AVAILABLE = 2


def _gather(param) -> None:
    import torch
    import torch.distributed as dist

    if param.ds_status is ZeroParamStatus.AVAILABLE:
        return
    rows = [torch.empty_like(param.ds_tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, param.ds_tensor)
    param.data = torch.cat(rows).reshape(param.ds_shape)
    param.ds_status = ZeroParamStatus.AVAILABLE
    param.ds_calls["gather"] += 1


def _release(param) -> None:
    import torch

    param.data = torch.empty(0, dtype=param.ds_tensor.dtype)
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE


class GatheredParameters:
    """``deepspeed.zero.GatheredParameters`` for read-only use (``modifier_rank=None``)."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if modifier_rank is not None:
            raise NotImplementedError("the stand-in serves read-only gathers (modifier_rank=None)")
        params = [params] if not isinstance(params, (list, tuple)) else list(params)
        self.params = [p for p in params if hasattr(p, "ds_id")]
        self.enabled = enabled

    def __enter__(self):
        if not self.enabled:
            return
        if any(getattr(p, "ds_context_depth", 0) for p in self.params):
            raise RuntimeError("Nested GatheredParameters contexts cannot overlap parameters")
        for p in self.params:
            _gather(p)
            p.ds_context_depth = 1

    def __exit__(self, *exc):
        if self.enabled:
            for p in self.params:
                p.ds_context_depth = 0
                _release(p)


def install() -> None:
    module = types.ModuleType("deepspeed")
    module.zero = types.SimpleNamespace(GatheredParameters=GatheredParameters)
    sys.modules["deepspeed"] = module


class _Engine:
    """The forward/backward bookkeeping of ZeRO-3 for one root module (``in_forward``, external parameters)."""

    def __init__(self, root):
        import torch
        from torch.utils._pytree import tree_leaves

        self.in_forward = False
        self.external = []

        def pre(module, args):
            self.in_forward = True

        def post(module, args, output):
            self.in_forward = False
            fetched = list(self.external)
            for p in fetched:
                _release(p)
            armed = []

            def pre_backward(grad):
                if not armed:  # once per backward, at the first output the gradient reaches
                    armed.append(True)
                    for p in fetched:
                        _gather(p)
                    torch.autograd.Variable._execution_engine.queue_callback(lambda: [_release(p) for p in fetched])
                return grad

            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(pre_backward)
            return output

        root.register_forward_pre_hook(pre)
        root.register_forward_hook(post)


class _GatheringParameters(dict):
    """A module's ``_parameters`` that gathers a partitioned parameter read during the engine's forward."""

    def __init__(self, engine, items):
        super().__init__(items)
        self.engine = engine

    def __getitem__(self, key):
        param = super().__getitem__(key)
        if param is not None and getattr(param, "ds_status", None) is ZeroParamStatus.NOT_AVAILABLE \
                and self.engine.in_forward:
            if param not in self.engine.external:
                self.engine.external.append(param)
            _gather(param)
        return param


def partition(param, owner, root, rank: int, world: int) -> None:
    """Partition ``param`` (a parameter of the module ``owner``, full now) over ``world`` ranks by rows, with
    ``root``'s forward as the engine's; arm the gradient hook."""
    import torch.distributed as dist

    rows = param.shape[0] // world
    param.ds_id = 0
    param.ds_shape = param.shape
    param.ds_tensor = param.data[rank * rows:(rank + 1) * rows].clone()
    param.ds_calls = {"gather": 0, "grad_hook": 0}
    param.ds_status = ZeroParamStatus.AVAILABLE
    grad_acc = param.expand_as(param).grad_fn.next_functions[0][0]  # made while the parameter is whole

    def reduce_partition_and_remove_grads(*_):
        grad = param.grad.detach().clone()
        assert tuple(grad.shape) == tuple(param.ds_shape), (grad.shape, param.ds_shape)
        dist.all_reduce(grad)
        param.ds_grad_rows = grad[rank * rows:(rank + 1) * rows] / world
        param.ds_calls["grad_hook"] += 1
        param.grad = None

    param.ds_grad_acc = grad_acc  # keep the node (and its hook) alive, as ZeRO-3 keeps its grad_accs
    grad_acc.register_hook(reduce_partition_and_remove_grads)
    engine = getattr(root, "_ds_standin_engine", None) or _Engine(root)
    root._ds_standin_engine = engine
    owner._parameters = _GatheringParameters(engine, owner._parameters)
    _release(param)
