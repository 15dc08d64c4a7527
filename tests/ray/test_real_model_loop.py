"""Two GRPO steps of the main command's loop (scripts/run-real.sh) on the real model, through train.py: Ray,
the smg router, the embedded engine and FSDP2 on gloo, with SmolLM2-135M-Instruct given as its GGUF file
(the cached HF directory replaces it at start), reasoning-gym's chain_sum prompts in the model's chat
template and reasoning-gym's verifier as the reward. Kept to 2 prompts x 4 samples x <= 16 tokens."""

import json
import os
from pathlib import Path

import pytest
import ray

from slime.rollout.reasoning_gym import make_rows, write_jsonl
from slime.utils import gguf_model
from slime.arguments import parse_args

HERE = Path(__file__).parent
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    python_path = os.pathsep.join([str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": python_path, "TOKENIZERS_PARALLELISM": "false",
                                       "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}})
    yield
    ray.shutdown()


def test_two_grpo_steps_on_smollm2_from_its_gguf(tmp_path):
    from train import train

    rows = make_rows("chain_sum", size=4, seed=0, answer_format="number",
                     config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
    write_jsonl(rows, tmp_path / "train.jsonl")
    args = parse_args([
        "--train-backend", "fsdp", "--rollout-backend", "embedded", "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", "1", "--hf-checkpoint", gguf_model.smollm2_gguf(),
        "--prompt-data", str(tmp_path / "train.jsonl"), "--input-key", "prompt", "--label-key", "label",
        "--metadata-key", "metadata", "--apply-chat-template", "--rm-type", "reasoning_gym",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "16",
        "--num-rollout", "2", "--num-steps-per-rollout", "1", "--lr", "1e-5", "--weight-decay", "0", "--seed", "1",
        # a gradient even when every sample of a group gets the same reward (GRPO's advantages are then all
        # zero), so the second step always checks weights that changed
        "--entropy-coef", "0.01",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "2048", "--run-dir", str(tmp_path / "run")])
    assert args.hf_checkpoint == gguf_model.smollm2_hf_dir()  # the GGUF was replaced by its cached HF directory
    train(args)
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    trains = [r for r in records if r["kind"] == "train"]
    rollouts = [r for r in records if r["kind"] == "rollout"]
    assert len(trains) == len(rollouts) == 2
    assert trains[0]["train/ppo_kl"] == 0.0  # one optimizer step per rollout: the first ratio is exactly 1
    # the trainer's fp32 recomputation of the engine's sampled tokens, at both steps (the second after the
    # first step's weights reached the engine)
    gaps = [r["train/train_rollout_logprob_abs_diff"] for r in trains]
    assert max(gaps) < 1e-4, gaps
    assert all(r["train/grad_norm"] > 0 for r in trains)
    lengths = [r["rollout/response_len/mean"] for r in rollouts]
    assert all(0 < n <= 16 for n in lengths), lengths
