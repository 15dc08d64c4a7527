"""A ~1B MoE with multi-latent attention (DeepSeek-V3 architecture, ``bench/engine_decode.py``'s
``deepseek-v3-1b``: 0.93B parameters, random bf16 weights, the tiny tokenizer) through the loop on
one GPU: train.py, Ray, the router, the embedded engine (MLA over its compressed-latent cache) and
the FSDP2 trainer, colocated, a few GRPO steps; then the engine's decode rate on the same checkpoint.

Marked ``gpu``. Needs Ray and the router on the machine (see tests/backends/megatron_utils/
test_megatron_loop_gpu.py for the packages). Run on one H200::

    python -m pytest tests/ray/test_moe_mla_gpu.py -x -q -s

It prints one JSON line per part (``moe_mla_loop``, ``moe_mla_decode``) for docs/megatron.md's table.
Checks: ``ppo_kl`` exactly 0 at every step (one optimizer step per rollout), the trainer's bf16
log-probs within 0.05 of the engine's at the first step, and the engine samples after each update.
The loop runs with routing replay (R3, ``--use-rollout-routing-replay``): the engine returns the
experts it routed every token to and the FSDP trainer replays them. Without R3 the first-step gap
measured 0.066-0.072 per token on the H200 (top-k choices that differ between engine and trainer in
bf16; dense Qwen3 0.6B: 0.008).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800)]
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STEPS = 4


def _bench_module():
    spec = importlib.util.spec_from_file_location("engine_decode", ROOT / "bench" / "engine_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def moe_mla_dir(tmp_path_factory):
    return _bench_module().build_checkpoint("deepseek-v3-1b", str(tmp_path_factory.mktemp("dsv3_1b")))


def test_moe_mla_1b_through_the_loop_on_one_gpu(moe_mla_dir, tiny_task_data, tmp_path):
    ray = pytest.importorskip("ray")
    sys.path.insert(0, str(HERE))
    from test_loop import by_kind, read_metrics

    from slime.arguments import parse_args
    from train import train

    python_path = os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")])
    ray.init(include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": python_path, "TOKENIZERS_PARALLELISM": "false",
                                       "NCCL_NVLS_ENABLE": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}})
    try:
        args = parse_args([
            "--train-backend", "fsdp", "--rollout-backend", "embedded", "--colocate", "--actor-num-gpus-per-node", "1",
            "--rollout-num-gpus", "1", "--hf-checkpoint", moe_mla_dir, "--prompt-data", tiny_task_data["train"],
            "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
            "--custom-rm-path", "loop_plugins.even_token_fraction_reward", "--rollout-batch-size", "16",
            "--n-samples-per-prompt", "8", "--rollout-max-response-len", "64", "--num-rollout", str(STEPS),
            "--num-steps-per-rollout", "1", "--lr", "1e-5", "--seed", "1", "--run-dir", str(tmp_path / "run"),
            "--use-rollout-routing-replay"])
        train(args)
    finally:
        ray.shutdown()
    records = read_metrics(tmp_path / "run")
    ppo_kl = by_kind(records, "train", "train/ppo_kl")
    diff = by_kind(records, "train", "train/train_rollout_logprob_abs_diff")
    result = {"part": "moe_mla_loop", "routing_replay": "R3", "steps": STEPS, "ppo_kl": ppo_kl, "train_rollout_logprob_abs_diff": diff,
              "rollout_time": by_kind(records, "perf", "perf/rollout_time"),
              "train_time": by_kind(records, "perf", "perf/train_time"),
              "engine_decode_steps": by_kind(records, "rollout", "perf/engine_decode_steps"),
              "engine_decode_time": by_kind(records, "rollout", "perf/engine_decode_time")}
    print(json.dumps(result))
    assert len(ppo_kl) == STEPS and all(v == 0.0 for v in ppo_kl), ppo_kl
    assert diff and diff[0] < 0.05, diff  # with R3; 0.066-0.072 without
    assert len(by_kind(records, "rollout", "rollout/raw_reward/mean")) == STEPS


def test_moe_mla_1b_engine_decode_rate(moe_mla_dir, tmp_path):
    out = tmp_path / "engine_decode-deepseek-v3-1b.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_decode.py"), "--model-path", moe_mla_dir,
                           "--device", "cuda", "--num-requests", "128", "--prompt-len", "256", "--max-new-tokens", "512",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())["metrics"]
    print(json.dumps({"part": "moe_mla_decode", **{k: result.get(k) for k in (
        "engine_output_tokens_per_s", "decode_output_tokens_per_s", "hf_generate_output_tokens_per_s", "speedup_vs_hf",
        "engine_busy_fraction", "roofline_fraction")}}))
    assert result["engine_output_tokens_per_s"] > 0
