#!/usr/bin/env bash
# The same GRPO workload twice on the CPU: train_async.py (generation of step k+1 overlaps training on
# step k, weights pushed between generations) and train.py with the fully async rollout (generation
# never stops; weights are pushed into running engines; groups more than --max-weight-staleness
# versions old are dropped, the rest corrected by --use-tis). Ends with a side-by-side table.
#   bash examples/fully_async/run.sh        (outputs under outputs/fully-async; OUT=dir, STEPS=n to change)
#   MODEL=smollm2: SmolLM2-135M-Instruct on reasoning-gym's chain_sum (the main command's task: the gym's
#   verifier on the reply's last number), replies up to 64 tokens, lr 1e-5; PROMPTS=n SAMPLES=n to size.
#   PYTHON=/path/to/python runs in an environment you installed yourself (no setup step).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
if [ -n "${PYTHON:-}" ]; then  # an environment you installed yourself: no setup step
  py="$PYTHON"
else
  bash scripts/setup-env.sh core
  py=.venv/bin/python
fi
export TOKENIZERS_PARALLELISM=false RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
source examples/model.sh
if [ ${#colocate[@]} -gt 0 ]; then
  echo "fully_async: the trainer and the engine run at the same time, each on its own GPU; this machine has one." >&2
  echo "Run it on a machine with two GPUs, or on the CPU (CUDA_VISIBLE_DEVICES= bash examples/fully_async/run.sh)." >&2
  exit 2
fi
out="${OUT:-outputs/fully-async$(smollm2_or -smollm2 '')}"
steps="${STEPS:-10}"
rm -rf "$out" && mkdir -p "$out"

example_model "$out/model"
if [ "${MODEL:-tiny}" = smollm2 ]; then  # a task the pretrained model can be scored on
  $py -m slime.rollout.reasoning_gym --dataset chain_sum --answer-format number --seed 0 --out "$out/data" \
    --config '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}' --num-train 256 --num-eval 16
  task=(--metadata-key metadata --rm-type reasoning_gym --rollout-max-response-len 64 --lr 1e-5)
else
  $py -m slime.utils.tiny_task --out "$out/data" --seed 0 --num-train 64 --num-eval 16 --num-sft 16
  task=(--custom-rm-path examples.fully_async.reward.reward --rollout-max-response-len 4 --lr 3e-2)
fi

common=(--train-backend fsdp --rollout-backend embedded --actor-num-gpus-per-node 1 --rollout-num-gpus 1
        --hf-checkpoint "$out/model" --prompt-data "$out/data/train.jsonl" --input-key prompt --label-key label
        --apply-chat-template "${task[@]}"
        --rollout-batch-size "${PROMPTS:-8}" --n-samples-per-prompt "${SAMPLES:-8}" --rollout-temperature 1.0
        --num-rollout "$steps" --num-steps-per-rollout 1 --adam-beta2 0.99 --weight-decay 0 --seed 1)

echo "== 1/3 train_async.py (one step off policy)"
$py train_async.py "${common[@]}" --run-dir "$out/runs/one_step_off"

echo "== 2/3 train.py with the fully async rollout"
$py train.py "${common[@]}" --rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async \
  --max-weight-staleness 1 --use-tis --run-dir "$out/runs/fully_async"

echo "== 3/3 summary"
$py -m examples.fully_async.summary "$out/runs/one_step_off" "$out/runs/fully_async" | tee "$out/summary.md"
