"""Let accelerate's FSDP path run on CPU processes (gloo), for the tests only.

``accelerate.state.AcceleratorState`` turns ``ACCELERATE_USE_FSDP=true`` into ``DistributedType.FSDP`` only for
accelerator device types (``MULTI_GPU``, ``MULTI_NPU``, ...): on CPU processes (``MULTI_CPU``) the plugin is
dropped and the model is wrapped in DDP. :func:`enable_fsdp_on_cpu` wraps ``AcceleratorState.__init__`` so that
after it, a ``MULTI_CPU`` state with ``ACCELERATE_USE_FSDP=true`` gets what accelerate gives a GPU state: the
plugin (the one ``Accelerator`` built from the ``FSDP_*`` environment), its mixed precision set from the
state's, and ``distributed_type = FSDP`` (also in ``PartialState``'s shared state). Everything after that --
``fsdp2_prepare_model``, the FSDP2 mixed-precision policy, gradient clipping, TRL's ``prepare_fsdp`` of the
reference model -- is accelerate's and TRL's own code. Call it in the worker process before the trainer.

:func:`launcher_args` parses an accelerate config file the way ``accelerate launch --config_file FILE`` does;
:func:`launcher_fsdp_env` is the FSDP part of the environment that launcher then gives every process (the
``ACCELERATE_USE_FSDP`` and ``FSDP_*`` variables), :func:`launcher_deepspeed_env` the DeepSpeed part (the
``ACCELERATE_*`` variables), so a test runs with exactly what an example config sets.
:func:`enable_deepspeed_on_cpu` does for DeepSpeed what :func:`enable_fsdp_on_cpu` does for FSDP.
"""

from __future__ import annotations

import os


def launcher_args(config_file: str):
    """The launch arguments ``accelerate launch --config_file config_file train.py`` works from (validated)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    return _validate_launch_command(args)[0]


def launcher_fsdp_env(config_file: str) -> dict:
    """``ACCELERATE_USE_FSDP`` and the ``FSDP_*`` variables accelerate's launcher sets for ``config_file``."""
    from accelerate.utils.launch import prepare_multi_gpu_env

    env = prepare_multi_gpu_env(launcher_args(config_file))
    return {k: v for k, v in env.items() if k == "ACCELERATE_USE_FSDP" or k.startswith("FSDP_")}


def launcher_deepspeed_env(config_file: str) -> dict:
    """The ``ACCELERATE_*`` variables accelerate's launcher sets for a DeepSpeed ``config_file`` (one node)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    fields = list(defaults.deepspeed_config) + ["mixed_precision"]  # as `accelerate launch` records them
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = prepare_deepspeed_cmd_env(args)
    return {k: v for k, v in env.items() if k.startswith("ACCELERATE_")}


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


def enable_deepspeed_on_cpu() -> None:
    """Let ``ACCELERATE_USE_DEEPSPEED=true`` work on CPU processes: accelerate's backend choice finds no device
    backend without an accelerator and falls back to one process (``DistributedType.NO``); this makes it choose
    gloo over the launcher's ranks (``MULTI_CPU``), as ``use_cpu`` would, after which accelerate initialises
    DeepSpeed's communication and switches the state to ``DEEPSPEED`` itself. Needs ``DS_ACCELERATOR=cpu``."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend
    if getattr(original, "_deepspeed_on_cpu", False):
        return

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, kind = original(self, cpu=cpu, sagemaker_dp=sagemaker_dp, backend=backend)
        if kind == DistributedType.NO and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" \
                and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return "gloo", DistributedType.MULTI_CPU
        return chosen, kind

    prepare_backend._deepspeed_on_cpu = True
    PartialState._prepare_backend = prepare_backend
