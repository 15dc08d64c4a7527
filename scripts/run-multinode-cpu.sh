#!/usr/bin/env bash
# Multi-node on one CPU machine: a Ray head (this machine's address) and a worker node (127.0.0.2),
# started with `ray start` (slime.ray.local_cluster), then the quick start's GRPO submitted with
# `ray job submit`: one training rank on each node (gloo across them), two embedded engines and the
# rollout manager wherever the rest fits, weights pushed to both engines after every step. Builds the
# tiny model and task first (no SFT warm start: this shows the placement, not the learning).
#   bash scripts/run-multinode-cpu.sh          (outputs under outputs/multinode-cpu; OUT=dir to change)
# On real machines: scripts/run-multinode.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup-env.sh dev,cluster  # the tests' packages and ray[default] (the job server of the head node)
py=.venv/bin/python
export TOKENIZERS_PARALLELISM=false RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
out="$(cd "$(dirname "${OUT:-outputs/multinode-cpu}")" 2>/dev/null && pwd || pwd)/$(basename "${OUT:-outputs/multinode-cpu}")"
rm -rf "$out" && mkdir -p "$out"
ray_dir="$(mktemp -d /tmp/slime-ray-XXXXXX)"  # Ray's socket paths must stay short
trap 'rm -rf "$ray_dir"' EXIT

$py -m slime.utils.tiny_model --out "$out/model" --size tiny --seed 0
$py -m slime.utils.tiny_task --out "$out/data" --seed 0 --max-operand 10 --num-train 64 --num-eval 32 --num-sft 8

$py -m slime.ray.local_cluster --temp-dir "$ray_dir" --head-cpus 3 --workers 1 --worker-cpus 2 -- \
  --train-backend fsdp --rollout-backend embedded \
  --actor-num-nodes 2 --actor-num-gpus-per-node 1 --rollout-num-gpus 2 --hf-checkpoint "$out/model" \
  --prompt-data "$out/data/train.jsonl" --input-key prompt --label-key label --apply-chat-template \
  --custom-rm-path examples.tiny_cpu.reward.reward --rollout-batch-size 8 --n-samples-per-prompt 4 \
  --rollout-max-response-len 6 --num-rollout "${STEPS:-6}" --num-steps-per-rollout 1 --lr 5e-4 \
  --check-weight-update-equal --save "$out/ckpt" --load "$out/ckpt" --save-interval 2 --run-dir "$out/run"
