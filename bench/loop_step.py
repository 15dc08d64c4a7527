"""Per-step timing of the real loop (train.py): Ray, the smg router, the embedded engine, FSDP2.

Builds a model (tiny, or a Qwen3 architecture with random bf16 weights and the tiny tokenizer) and the
tiny arithmetic task, runs a few GRPO steps with a reward that needs no trained model (even first
token), and reports the mean time per step split into rollout / train / weight update, plus the
trainer's tokens/s. Writes bench/results/loop_step-<machine>-<model>.json with --out.

    python bench/loop_step.py --model qwen3-0.6b --steps 4 --out            # GPU: trainer GPU 0, engine GPU 1
    python bench/loop_step.py --model tiny --steps 4 --cpu                  # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from statistics import mean

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "ray"))  # the even-first-token reward plugin

from bench.common import write_result  # noqa: E402
from bench.engine_decode import build_checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rollout-batch-size", type=int, default=32)
    parser.add_argument("--n-samples-per-prompt", type=int, default=8)
    parser.add_argument("--max-response-len", type=int, default=256)
    parser.add_argument("--colocate", action="store_true", help="trainer and engine share one device")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more train.py flags")
    parser.add_argument("--out", action="store_true")
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests", "ray"), os.environ.get("PYTHONPATH", "")])

    from slime.arguments import parse_args
    from slime.utils.tiny_task import build_task_data
    from train import train

    with tempfile.TemporaryDirectory() as root:
        model_dir = build_checkpoint(args.model, os.path.join(root, "model"))
        data = build_task_data(os.path.join(root, "data"), num_train=256, num_eval=8, num_sft=8)
        run_dir = os.path.join(root, "run")
        flags = ["--train-backend", "fsdp", "--rollout-backend", "embedded", "--actor-num-gpus-per-node", "1",
                 "--rollout-num-gpus", "1", "--hf-checkpoint", model_dir, "--prompt-data", data["train"],
                 "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
                 "--custom-rm-path", "loop_plugins.even_first_token_reward",
                 "--rollout-batch-size", str(args.rollout_batch_size), "--n-samples-per-prompt", str(args.n_samples_per_prompt),
                 "--rollout-max-response-len", str(args.max_response_len), "--num-rollout", str(args.steps),
                 "--num-steps-per-rollout", "1", "--lr", "1e-6", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384",
                 "--run-dir", run_dir, *(["--colocate", "--sglang-mem-fraction-static", "0.3"] if args.colocate else []),
                 *args.extra]
        train(parse_args(flags))
        records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    perf = [r for r in records if r["kind"] == "perf" and "perf/step_time" in r][1:]  # the first step warms up
    trains = [r for r in records if r["kind"] == "train"][1:]
    metrics = {key: mean(r[key] for r in perf) for key in ("perf/rollout_time", "perf/train_time",
                                                          "perf/update_weights_time", "perf/step_time")}
    metrics["perf/actor_train_tok_per_s"] = mean(r.get("perf/actor_train_tok_per_s", 0.0) for r in trains)
    metrics["train/train_rollout_logprob_abs_diff"] = mean(r.get("train/train_rollout_logprob_abs_diff", 0.0) for r in trains)
    write_result("loop_step", {"model": args.model, "steps": args.steps, "rollout_batch_size": args.rollout_batch_size,
                               "n_samples_per_prompt": args.n_samples_per_prompt, "max_response_len": args.max_response_len,
                               "colocate": args.colocate, "extra": args.extra}, metrics,
                 os.path.join(REPO, "bench", "results") if args.out else None)


if __name__ == "__main__":
    main()
