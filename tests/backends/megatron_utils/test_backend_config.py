"""MegatronBackend's CPU-checkable behaviour: role overrides and refusals with clear messages."""

import pytest

from slime.backends.megatron_utils import model as mm
from slime.backends.megatron_utils.backend import MegatronBackend
from slime.backends.megatron_utils.setup import apply_megatron_config
from tests.parsed_args import default_args


def _args(**kw):
    return default_args(**{"train_backend": "megatron", "lr": 1e-6, **kw})


def test_megatron_config_path_overrides_per_role(tmp_path):
    path = tmp_path / "roles.yaml"
    path.write_text("actor:\n  lr: 2.0e-6\n  --tensor-model-parallel-size: 2\ncritic:\n  lr: 1.0e-5\n")
    args = _args(megatron_config_path=str(path))
    actor, critic = apply_megatron_config(args, "actor"), apply_megatron_config(args, "critic")
    assert (actor.lr, actor.tensor_model_parallel_size) == (2e-6, 2)
    assert (critic.lr, critic.tensor_model_parallel_size) == (1e-5, 1)
    assert args.lr == 1e-6  # the shared args are not modified


def test_megatron_config_path_errors_name_the_problem(tmp_path):
    bad_key = tmp_path / "bad_key.yaml"
    bad_key.write_text("actor:\n  no_such_flag: 1\n")
    with pytest.raises(ValueError, match="actor.no_such_flag is not a flag"):
        apply_megatron_config(_args(megatron_config_path=str(bad_key)), "actor")
    bad_role = tmp_path / "bad_role.yaml"
    bad_role.write_text("policy:\n  lr: 1\n")
    with pytest.raises(ValueError, match="'actor' and/or 'critic'.*policy"):
        apply_megatron_config(_args(megatron_config_path=str(bad_role)), "actor")


def test_unsupported_layouts_are_refused_before_any_gpu_work():
    # context parallelism is supported, but not with a loss over every position's logits or routing replay
    with pytest.raises(NotImplementedError, match="--context-parallel-size > 1 with --loss-type custom_loss"):
        MegatronBackend(_args(context_parallel_size=2, loss_type="custom_loss"))
    with pytest.raises(NotImplementedError, match="--context-parallel-size > 1 with MoE routing replay"):
        MegatronBackend(_args(context_parallel_size=2, loss_type="policy_loss", use_routing_replay=True))
    with pytest.raises(NotImplementedError, match="--virtual-pipeline-model-parallel-size 2"):
        MegatronBackend(_args(virtual_pipeline_model_parallel_size=2))
    with pytest.raises(NotImplementedError, match="--rollout-top-p 0.9"):
        MegatronBackend(_args(rollout_top_p=0.9))
    if not mm.have_sequence_parallel_norm():
        with pytest.raises(NotImplementedError, match="--sequence-parallel without Transformer Engine"):
            MegatronBackend(_args(tensor_model_parallel_size=2, sequence_parallel=True))
    with pytest.raises(ValueError, match="role must be 'actor' or 'critic', got 'policy'"):
        MegatronBackend(_args(), role="policy")
    # pipeline parallelism and the critic are accepted now: what stops them here is the missing GPU
    with pytest.raises(RuntimeError, match="needs CUDA"):
        MegatronBackend(_args(pipeline_model_parallel_size=2))
    with pytest.raises(RuntimeError, match="needs CUDA"):
        MegatronBackend(_args(context_parallel_size=2))
    with pytest.raises(RuntimeError, match="needs CUDA"):
        MegatronBackend(_args(), role="critic")
