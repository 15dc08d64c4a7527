"""``--true-on-policy`` and ``--deterministic-mode`` through the real loop on the CPU (Ray, the embedded
engine, FSDP2 on gloo, the tiny Qwen3): the engine's log-probs are the trainer's bit for bit at every
step, in fp32 and in bf16, and two runs with one seed write the same metrics and the same checkpoint bytes.

Why a broken path fails here: the exactness rests on the shared batch-invariant ops; with the engine's
GEMM left at ``F.linear`` (``batch_invariant.TILE_ROWS = None``, whose 1-row decode steps run a GEMV)
the same comparison gives a non-zero difference (tests/backends/test_batch_invariant.py shows it on the
real engine and trainer code). What the reproducibility rests on: each sample's sampling seed (from
``--rollout-seed`` and its index) and the engine's batch-invariant ops; without them a row's noise and
logits would follow the order requests reach the engine, which the two runs do not share (their
``rollout/prefix_cache_hit_rate`` differs for that reason).
"""

import json
import os
from pathlib import Path

import pytest
import ray

from slime.arguments import parse_args

HERE = Path(__file__).parent
pytestmark = pytest.mark.timeout(600)
TIMING = ("time", "throughput", "tflops", "busy_fraction", "per_second", "tokens_per_s", "timestamp", "wall")
# how many prompt tokens came from another request's prefill: it follows when a group's requests reach the
# engine (together or one after another), which changes no token and no log-prob
SCHEDULING = ("rollout/prefix_cache_hit_rate",)


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    python_path = os.pathsep.join([str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": python_path, "TOKENIZERS_PARALLELISM": "false",
                                       "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}})
    yield
    ray.shutdown()


def exact_args(model_dir, data, run_dir, *extra, steps=2):
    return parse_args([
        "--train-backend", "fsdp", "--rollout-backend", "embedded", "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", "1", "--hf-checkpoint", model_dir, "--prompt-data", data["train"],
        "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", "loop_plugins.even_token_fraction_reward",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
        "--global-batch-size", "16", "--micro-batch-size", "5",
        "--num-rollout", str(steps), "--lr", "3e-2", "--weight-decay", "0", "--seed", "3",
        "--save", str(Path(run_dir) / "ckpt"), "--save-interval", str(steps),
        "--run-dir", str(run_dir), *map(str, extra)])


def run(args):
    from train import train

    train(args)
    return [json.loads(line) for line in open(Path(args.run_dir) / "metrics.jsonl")]


def without_timings(records):
    """Every value but the ``perf/`` ones (timings, throughput, and the engine's scheduling counts, which follow
    the order requests reach it: decode steps, prefill forwards) and :data:`SCHEDULING`."""
    return [{k: v for k, v in r.items() if not k.startswith("perf/") and k not in SCHEDULING
             and not any(t in k for t in TIMING)} for r in records]


def saved_state(run_dir, tmp_path):
    """Every value of the last DCP checkpoint (model weights and optimizer state) by key path, tensors as
    bytes: what a resumed run would load (the files also hold rng states and metadata)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp = sorted((Path(run_dir) / "ckpt").glob("iter_*/dcp"))[-1]
    out = tmp_path / f"{Path(run_dir).name}.pt"
    dcp_to_torch_save(str(dcp), str(out))
    flat = {}

    def walk(value, path):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}/{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{path}/{i}")
        else:
            flat[path] = value.cpu().numpy().tobytes() if isinstance(value, torch.Tensor) else value

    walk(torch.load(out, weights_only=False), "")
    assert any(path.startswith("/model/") for path in flat), sorted(flat)[:5]
    return flat


def values(records, key):
    return [r[key] for r in records if r.get("kind") == "train" and key in r]


def test_true_on_policy_is_exact_in_bf16(tiny_model_dir, tiny_task_data, tmp_path):
    """A bf16 engine (--embedded-engine-dtype bfloat16) and a bf16 trainer (--fsdp-mixed-precision bf16: fp32
    parameters, bf16 compute): the same zero gap. (The engine in fp32 against the bf16 trainer is refused at start:
    the gap of two dtypes, ~0.03 nats a token on this model.)"""
    records = run(exact_args(tiny_model_dir, tiny_task_data, tmp_path / "bf16", "--true-on-policy",
                             "--fsdp-mixed-precision", "bf16", "--embedded-engine-dtype", "bfloat16"))
    diff, ppo_kl = values(records, "train/train_rollout_logprob_abs_diff"), values(records, "train/ppo_kl")
    assert diff == [0.0, 0.0] and ppo_kl == [0.0, 0.0], (diff, ppo_kl)


def test_true_on_policy_is_exact_and_a_deterministic_run_repeats(tiny_model_dir, tiny_task_data, tmp_path):
    first = run(exact_args(tiny_model_dir, tiny_task_data, tmp_path / "a", "--true-on-policy", "--deterministic-mode"))
    diff = values(first, "train/train_rollout_logprob_abs_diff")
    ppo_kl = values(first, "train/ppo_kl")
    assert len(diff) == len(ppo_kl) == 2, (diff, ppo_kl)
    assert diff == [0.0, 0.0] and ppo_kl == [0.0, 0.0], (diff, ppo_kl)
    second = run(exact_args(tiny_model_dir, tiny_task_data, tmp_path / "b", "--true-on-policy", "--deterministic-mode"))
    differ = [(r.get("kind"), k, r.get(k), q.get(k)) for r, q in zip(without_timings(first), without_timings(second))
              for k in sorted(set(r) | set(q)) if r.get(k) != q.get(k)]
    assert len(first) == len(second) and not differ, [k for _, k, _, _ in differ]
    a, b = saved_state(tmp_path / "a", tmp_path), saved_state(tmp_path / "b", tmp_path)
    assert a.keys() == b.keys() and [k for k in a if a[k] != b[k]] == []
