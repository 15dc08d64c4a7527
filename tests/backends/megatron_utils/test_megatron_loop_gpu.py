"""The real loop with the Megatron trainer on GPU: Ray, the smg router, the embedded engine, GRPO.

Marked ``gpu`` (skipped without CUDA or Megatron-Core). Runbook: see test_megatron_gpu.py; this
test also needs Ray and the router on the machine (``ray==2.60.0 jsonschema referencing rpds-py
jsonschema-specifications smg==1.13.0 setproctitle`` — smg imports setproctitle — and the server
packages fastapi, uvicorn, starlette, pydantic, pydantic-core, annotated-types, typing-inspection).
Ray's wheel is large (bench/GPU_RUNBOOK.md); the colocated test takes
~1.5 min once installed. Checks what a user looks at: ppo_kl is exactly 0 at every rollout's first optimizer step,
the trainer's recomputed log-probs match the engine's at the first step, and the reward rises.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

from slime.arguments import parse_args

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]
RAY_TESTS = Path(__file__).resolve().parents[2] / "ray"
sys.path.insert(0, str(RAY_TESTS))
pytest.importorskip("ray")
from test_loop import LEARNING_LR, SYNC_STEPS  # noqa: E402  (the FSDP loop tests' reward, lr and steps)


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    pytest.importorskip("megatron.core")
    ray = pytest.importorskip("ray")
    python_path = os.pathsep.join([str(RAY_TESTS), str(RAY_TESTS.parents[1]), os.environ.get("PYTHONPATH", "")])
    ray.init(include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": python_path, "TOKENIZERS_PARALLELISM": "false",
                                       "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                       "NVSHMEM_DISABLE_NVLS": "1", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}})
    yield
    ray.shutdown()


def _args(model_dir, data, run_dir, *extra, steps=SYNC_STEPS):
    return parse_args([
        "--train-backend", "megatron", "--rollout-backend", "embedded", "--actor-num-gpus-per-node", "1",
        "--hf-checkpoint", model_dir, "--prompt-data", data["train"],
        "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", "loop_plugins.even_token_fraction_reward",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "4",
        "--num-rollout", str(steps), "--num-steps-per-rollout", "1", "--lr", str(LEARNING_LR), "--adam-beta2", "0.99",
        "--weight-decay", "0", "--seed", "1", "--run-dir", str(run_dir), *map(str, extra)])


def _check(run_dir, steps):
    from test_loop import MIN_RISE, by_kind, read_metrics, rise

    records = read_metrics(run_dir)
    ppo_kl = by_kind(records, "train", "train/ppo_kl")
    assert len(ppo_kl) == steps and all(v == 0.0 for v in ppo_kl), ppo_kl  # one optimizer step per rollout
    diff = by_kind(records, "train", "train/train_rollout_logprob_abs_diff")
    assert diff and diff[0] < 0.05, f"trainer (bf16 autocast) vs engine (bf16) log-probs differ by {diff[0]}"
    rewards = by_kind(records, "rollout", "rollout/raw_reward/mean")
    assert len(rewards) == steps and rise(rewards) >= MIN_RISE, f"reward did not rise by {MIN_RISE}: {rewards}"


def test_grpo_colocated_one_gpu(tiny_model_dir, tiny_task_data, tmp_path):
    from train import train

    train(_args(tiny_model_dir, tiny_task_data, tmp_path / "run", "--colocate"))
    _check(tmp_path / "run", SYNC_STEPS)


def test_grpo_disaggregated_two_gpus(tiny_model_dir, tiny_task_data, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from train import train

    train(_args(tiny_model_dir, tiny_task_data, tmp_path / "run", "--rollout-num-gpus", "1"))
    _check(tmp_path / "run", SYNC_STEPS)
