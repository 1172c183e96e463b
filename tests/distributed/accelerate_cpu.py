"""Let accelerate's FSDP path run on CPU processes (gloo), for the tests only.

``accelerate.state.AcceleratorState`` turns ``ACCELERATE_USE_FSDP=true`` into ``DistributedType.FSDP`` only for
accelerator device types (``MULTI_GPU``, ``MULTI_NPU``, ...): on CPU processes (``MULTI_CPU``) the plugin is
dropped and the model is wrapped in DDP. :func:`enable_fsdp_on_cpu` wraps ``AcceleratorState.__init__`` so that
after it, a ``MULTI_CPU`` state with ``ACCELERATE_USE_FSDP=true`` gets what accelerate gives a GPU state: the
plugin (the one ``Accelerator`` built from the ``FSDP_*`` environment), its mixed precision set from the
state's, and ``distributed_type = FSDP`` (also in ``PartialState``'s shared state). Everything after that --
``fsdp2_prepare_model``, the FSDP2 mixed-precision policy, gradient clipping, TRL's ``prepare_fsdp`` of the
reference model -- is accelerate's and TRL's own code. Call it in the worker process before the trainer.
"""

from __future__ import annotations

import os


def enable_fsdp_on_cpu() -> None:
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    original = AcceleratorState.__init__
    if getattr(original, "_fsdp_on_cpu", False):
        return

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if self.distributed_type == DistributedType.MULTI_CPU and \
                os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            plugin = fsdp_plugin if fsdp_plugin is not None else FullyShardedDataParallelPlugin()
            if self._mixed_precision != "no":
                plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = plugin
            self.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    init._fsdp_on_cpu = True
    AcceleratorState.__init__ = init
