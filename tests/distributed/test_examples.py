"""The example accelerate configs (examples/accelerate/*.yaml) parse as ``accelerate launch --config_file`` parses
them, and ask for what their comments say: FSDP2 full shard with bf16, DeepSpeed ZeRO-3 and ZeRO-2. (The FSDP2
trainer tests run with the environment accelerate derives from fsdp2.yaml.)"""

import os

import pytest

from tests.distributed.accelerate_cpu import launcher_args, launcher_fsdp_env

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "examples", "accelerate")


def test_fsdp2_config_sets_fsdp2_full_shard():
    """fsdp2.yaml: FSDP version 2, reshard after forward, one group per decoder layer, bf16, 8 processes."""
    pytest.importorskip("accelerate")
    args = launcher_args(os.path.join(EXAMPLES, "fsdp2.yaml"))
    assert args.use_fsdp and args.mixed_precision == "bf16" and args.num_processes == 8
    env = launcher_fsdp_env(os.path.join(EXAMPLES, "fsdp2.yaml"))
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == "true" and env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"


@pytest.mark.parametrize("name, stage", [("zero3.yaml", 3), ("zero2.yaml", 2)])
def test_deepspeed_configs_set_their_zero_stage(name, stage):
    """zero3.yaml / zero2.yaml: DeepSpeed with that ZeRO stage, bf16, 8 processes, no offload."""
    pytest.importorskip("accelerate")
    args = launcher_args(os.path.join(EXAMPLES, name))
    assert args.use_deepspeed and args.zero_stage == stage and args.mixed_precision == "bf16"
    assert args.num_processes == 8 and args.offload_optimizer_device == "none"
