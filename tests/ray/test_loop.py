"""The real loop on CPU: Ray, the smg router, the embedded engine, FSDP2 on gloo, the tiny model.

Every scenario checks what a user would look at: the first step's invariants (``ppo_kl == 0``, the
trainer's recomputed log-probs match the engine's) and that the reward rises over a few steps.
One Ray instance serves the whole module (starting Ray costs ~20 s on two cores).
"""

import json
import os
from pathlib import Path

import pytest
import ray

from slime.utils.arguments import parse_args

HERE = Path(__file__).parent
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    python_path = os.pathsep.join([str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": python_path, "TOKENIZERS_PARALLELISM": "false",
                                       "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}})
    yield
    ray.shutdown()


def grpo_args(model_dir, data, run_dir, *extra, steps=5, seed=1):
    return parse_args([
        "--train-backend", "fsdp", "--rollout-backend", "embedded", "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", "1", "--hf-checkpoint", model_dir, "--prompt-data", data["train"],
        "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", "loop_plugins.even_first_token_reward",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "4",
        "--num-rollout", str(steps), "--num-steps-per-rollout", "1", "--lr", "5e-2", "--adam-beta2", "0.99",
        "--weight-decay", "0", "--seed", str(seed), "--run-dir", str(run_dir), *map(str, extra)])


def read_metrics(run_dir):
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


def by_kind(records, kind, key):
    """Values of ``key`` in records of ``kind`` (any kind when None), in logging order."""
    return [r[key] for r in records if (kind is None or r["kind"] == kind) and key in r]


def rise(rewards):
    """Mean reward of the last two steps minus the first step's (64 samples a step: the std of one
    step's mean is about 0.06, so a rise of 0.12 is not noise)."""
    return (rewards[-1] + rewards[-2]) / 2 - rewards[0]


def check_learning(run_dir, min_rise=0.12):
    records = read_metrics(run_dir)
    rewards = by_kind(records, "rollout", "rollout/raw_reward/mean")
    ppo_kl = by_kind(records, "train", "train/ppo_kl")
    assert ppo_kl and ppo_kl[0] == 0.0
    diff = by_kind(records, "train", "train/train_rollout_logprob_abs_diff")
    assert diff and diff[0] < 1e-3, f"trainer vs engine log-probs differ by {diff[:1]} at the first step"
    assert rise(rewards) >= min_rise, f"reward did not rise: {rewards}"
    return records


def run_train(args):
    from train import train

    train(args)


def rewards_of(run_dir):
    return by_kind(read_metrics(run_dir), "rollout", "rollout/raw_reward/mean")


def run_until_it_learns(train_fn, make_args, tmp_path, min_rise=0.12):
    """GRPO at lr 5e-2 on the tiny model occasionally wobbles (about one CI run in ten saw a rise
    under 0.12 in one of these tests): a run that did not learn is repeated once with another seed,
    and that one must learn. Returns the run directory of the last attempt."""
    for seed in (1, 2):
        run_dir = tmp_path / f"run-seed{seed}"
        train_fn(make_args(run_dir, seed))
        if rise(rewards_of(run_dir)) >= min_rise:
            break
    return run_dir


def test_sync_disaggregated_distributed_weights(tiny_model_dir, tiny_task_data, tmp_path):
    run_dir = run_until_it_learns(run_train, lambda run_dir, seed: grpo_args(
        tiny_model_dir, tiny_task_data, run_dir, "--check-weight-update-equal", seed=seed), tmp_path)
    records = check_learning(run_dir)
    assert by_kind(records, "perf", "perf/update_weights_time")


def test_sync_colocated_tensor_weights(tiny_model_dir, tiny_task_data, tmp_path):
    run_train(grpo_args(tiny_model_dir, tiny_task_data, tmp_path / "run", "--colocate"))
    check_learning(tmp_path / "run")


def test_async_one_step_off_policy(tiny_model_dir, tiny_task_data, tmp_path):
    from train_async import train_async

    run_dir = run_until_it_learns(train_async, lambda run_dir, seed: grpo_args(
        tiny_model_dir, tiny_task_data, run_dir, steps=7, seed=seed), tmp_path)
    rewards = rewards_of(run_dir)
    assert len(rewards) == 7 and rise(rewards) >= 0.12, rewards  # one step off-policy: learns a step later


def test_async_keep_old_actor_pi_old_is_the_rollout_policy(tiny_model_dir, tiny_task_data, tmp_path):
    """train_async.py with --keep-old-actor: rollout k+1 comes from the weights before the update on
    rollout k, and π_old is computed with exactly those weights, so |log π_old − log μ| stays at
    float noise at every step (the current actor is already one update ahead: ppo_kl ≠ 0)."""
    from train_async import train_async

    train_async(grpo_args(tiny_model_dir, tiny_task_data, tmp_path / "run", "--keep-old-actor", steps=2))
    records = read_metrics(tmp_path / "run")
    diff = by_kind(records, "train", "train/train_rollout_logprob_abs_diff")
    ppo_kl = by_kind(records, "train", "train/ppo_kl")
    assert len(diff) == 2 and max(diff) < 1e-4, diff
    assert ppo_kl[0] == 0.0 and ppo_kl[1] > 0.0, ppo_kl


def test_disk_weight_updates(tiny_model_dir, tiny_task_data, tmp_path):
    run_train(grpo_args(tiny_model_dir, tiny_task_data, tmp_path / "run", "--update-weight-transport", "disk",
                        "--update-weight-disk-dir", tmp_path / "weights"))
    check_learning(tmp_path / "run")
    versions = sorted(os.listdir(tmp_path / "weights"))
    assert versions == ["weight_v000005"], versions  # older versions are removed unless asked to keep them


def test_disk_delta_weight_updates(tiny_model_dir, tiny_task_data, tmp_path):
    from slime.backends.update_weight.weight_files import read_version

    local = tmp_path / "host" / "checkpoint"
    run_train(grpo_args(tiny_model_dir, tiny_task_data, tmp_path / "run", "--update-weight-transport", "disk",
                        "--update-weight-mode", "delta", "--update-weight-disk-dir", tmp_path / "weights",
                        "--update-weight-local-checkpoint-dir", local, "--check-weight-update-equal", steps=3))
    # the engines generate with exactly the trainer's weights after every version, not just the first
    diffs = by_kind(read_metrics(tmp_path / "run"), "train", "train/train_rollout_logprob_abs_diff")
    assert len(diffs) == 3 and max(diffs) < 1e-3, diffs
    assert json.loads((local / "slime_weight_version.json").read_text())["version"] == 3
    # lr 5e-2 moves every fp32 weight, so a model's worth of deltas soon piles up and a full version
    # follows; the versions before the newest full one are deleted
    kinds = [read_version(str(tmp_path / "weights" / name)).kind for name in sorted(os.listdir(tmp_path / "weights"))]
    assert kinds == ["delta"] * 4 or (kinds[0] == "full" and set(kinds[1:]) <= {"delta"} and len(kinds) < 4), kinds


def test_debug_rollout_only_then_train_only_replay(tiny_model_dir, tiny_task_data, tmp_path):
    dump = str(tmp_path / "dump" / "{rollout_id}.pt")
    run_train(grpo_args(tiny_model_dir, tiny_task_data, tmp_path / "gen", "--debug-rollout-only",
                        "--save-debug-rollout-data", dump, steps=2))
    assert sorted(os.listdir(tmp_path / "dump")) == ["0.pt", "1.pt"]
    train_dump = str(tmp_path / "train" / "{rollout_id}.pt")
    for name in ("a", "b"):
        run_train(grpo_args(tiny_model_dir, tiny_task_data, tmp_path / name, "--load-debug-rollout-data", dump,
                            "--save-debug-train-data", train_dump, steps=2))
    losses_a = by_kind(read_metrics(tmp_path / "a"), "train", "train/pg_loss")
    losses_b = by_kind(read_metrics(tmp_path / "b"), "train", "train/pg_loss")
    assert len(losses_a) == 2 and losses_a == losses_b
    # the train dump (format 2) joins the rollout dump on sample_index <-> Sample.index
    import torch

    from slime.observability.rollout_data_utils import load_debug_rollout_data

    train_payload = torch.load(train_dump.format(rollout_id=1), weights_only=False)
    rollout_samples = load_debug_rollout_data(dump, rollout_id=1)
    assert train_payload["format_version"] == 2 and train_payload["rollout_id"] == 1
    assert [s["sample_index"] for s in train_payload["samples"]] == sorted(s.index for s in rollout_samples)
    first = train_payload["samples"][0]
    assert first["advantages"].shape == first["log_probs"].shape == (first["response_lengths"],)


def test_sft_path(tiny_model_dir, tiny_task_data, tmp_path):
    args = parse_args([
        "--train-backend", "fsdp", "--actor-num-gpus-per-node", "1", "--debug-train-only",
        "--hf-checkpoint", tiny_model_dir, "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
        "--prompt-data", tiny_task_data["sft"], "--input-key", "messages", "--loss-type", "sft_loss",
        "--calculate-per-token-loss", "--disable-compute-advantages-and-returns", "--rollout-batch-size", "16",
        "--num-rollout", "8", "--lr", "5e-3", "--save", str(tmp_path / "ckpt"), "--save-interval", "100",
        "--save-hf", str(tmp_path / "hf"), "--run-dir", str(tmp_path / "run")])
    run_train(args)
    losses = by_kind(read_metrics(tmp_path / "run"), "train", "train/loss")
    assert len(losses) == 8 and losses[-1] < losses[0] * 0.8, losses
    assert (tmp_path / "hf" / "model.safetensors").exists()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "7"


def test_kill_and_resume_continues_data_and_metrics(tiny_model_dir, tiny_task_data, tmp_path):
    dump = str(tmp_path / "dump" / "{rollout_id}.pt")
    common = ("--save", tmp_path / "ckpt", "--save-interval", "1", "--load", tmp_path / "ckpt",
              "--save-debug-rollout-data", dump, "--rollout-shuffle")
    run_train(grpo_args(tiny_model_dir, tiny_task_data, tmp_path / "run", *common, steps=2))  # "killed" after step 1
    run_train(grpo_args(tiny_model_dir, tiny_task_data, tmp_path / "run", *common, steps=4))  # resumed
    reference_dump = str(tmp_path / "ref" / "{rollout_id}.pt")
    run_train(grpo_args(tiny_model_dir, tiny_task_data, tmp_path / "ref_run", "--save-debug-rollout-data", reference_dump,
                        "--rollout-shuffle", "--debug-rollout-only", steps=4))
    from slime.observability.rollout_data_utils import load_debug_rollout_data

    for rollout_id in range(4):
        resumed = load_debug_rollout_data(dump, rollout_id=rollout_id)
        reference = load_debug_rollout_data(reference_dump, rollout_id=rollout_id)
        assert [s.prompt for s in resumed] == [s.prompt for s in reference]
        assert [s.index for s in resumed] == [s.index for s in reference]
    steps = [r["step"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert steps == [0, 1, 2, 3]


def test_killed_engine_is_detected_restarted_and_resynced(tiny_model_dir, tiny_task_data, tmp_path):
    """Engine 0 is SIGKILLed in the middle of rollout step 1: its requests are retried on engine 1
    through the router, the step completes with every sample, engine 0 is restarted before the next
    weight update and receives the current weights (the trainer's recomputed log-probs still match
    the engines' at step 2, whichever engine served a sample)."""
    run_train(grpo_args(tiny_model_dir, tiny_task_data, tmp_path / "run", "--rollout-num-gpus", "2",
                        "--use-fault-tolerance", "--router-policy", "round_robin",
                        "--custom-generate-function-path", "loop_plugins.generate_and_kill_engine_once",
                        "--save-debug-rollout-data", tmp_path / "dump" / "{rollout_id}.pt", steps=3))
    from slime.observability.rollout_data_utils import load_debug_rollout_data
    from slime.utils.types import Sample

    records = read_metrics(tmp_path / "run")
    assert by_kind(records, None, "perf/engines_restarted") == [0, 1, 0]
    for rollout_id in range(3):
        samples = load_debug_rollout_data(str(tmp_path / "dump" / "{rollout_id}.pt"), rollout_id=rollout_id)
        assert len(samples) == 64 and len({s.index for s in samples}) == 64
        assert all(s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED) for s in samples), rollout_id
    diffs = by_kind(records, "train", "train/train_rollout_logprob_abs_diff")
    assert len(diffs) == 3 and max(diffs) < 1e-3, diffs


def test_ppo_with_critic(tiny_model_dir, tiny_task_data, tmp_path):
    """PPO through the loop: a critic group (its own FSDP2 rank) computes the values both trainers use,
    and trains on the returns while the actor trains. (That the critic fits a fixed target is tested in
    tests/backends/fsdp_utils; here the target moves with the policy, so only the plumbing is asserted.)"""
    run_train(grpo_args(tiny_model_dir, tiny_task_data, tmp_path / "run", "--advantage-estimator", "ppo",
                        "--critic-lr", "1e-2", "--num-steps-per-rollout", "2", steps=4))
    records = read_metrics(tmp_path / "run")
    value_loss = by_kind(records, "train", "train/critic-value_loss")
    assert len(value_loss) == 4 and all(0 < v < float("inf") for v in value_loss), value_loss
    values = by_kind(records, "train", "rollout/values")
    assert len(values) == 4 and len(set(values)) > 1, values  # the critic's predictions move as it trains
    assert len(by_kind(records, "train", "train/pg_loss")) == 4
