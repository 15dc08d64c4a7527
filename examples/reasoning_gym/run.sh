#!/usr/bin/env bash
# The CPU quick start on reasoning-gym's data: the same loop as scripts/run-tiny-cpu.sh (tiny Qwen3 model,
# SFT warm start, then GRPO with Ray, the smg router, the embedded engine and FSDP2 on gloo), but the
# problems, the warm-start answers and the reward all come from reasoning-gym (PyPI): its chain_sum
# generator (two one-digit terms, + or -) and its own verifier (--rm-type reasoning_gym).
#   bash examples/reasoning_gym/run.sh      (outputs under outputs/reasoning-gym; OUT=dir to change)
#   DATASET=.. CONFIG='{..}' SFT_STEPS=.. GRPO_STEPS=.. to change the task and the two phases.
#   MODEL=smollm2: SmolLM2-135M-Instruct instead (no warm start: it reads the gym's question as it is and
#   is scored on the last number of its reply; terms of one or two digits, where it starts near 10-20%; lr 1e-5,
#   replies up to 64 tokens; GRPO_PROMPTS/SAMPLES to size).
#   PYTHON=/path/to/python runs in an environment you installed yourself (no setup step).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
if [ -n "${PYTHON:-}" ]; then  # an environment you installed yourself: no setup step
  py="$PYTHON"
else
  bash scripts/setup-env.sh dev  # reasoning-gym is in the dev extra (and in the reasoning-gym one)
  py=.venv/bin/python
fi
export TOKENIZERS_PARALLELISM=false RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
source examples/model.sh
out="${OUT:-outputs/reasoning-gym$(smollm2_or -smollm2 '')}"
rm -rf "$out" && mkdir -p "$out"
sft_steps="${SFT_STEPS:-$(smollm2_or 0 150)}"

echo "== 1/4 the model (MODEL=${MODEL:-tiny}), and reasoning-gym's problems (train / held-out / warm start)"
example_model "$out/model"
$py -m slime.rollout.reasoning_gym --dataset "${DATASET:-chain_sum}" \
  --config "${CONFIG:-{\"min_terms\": 2, \"max_terms\": 2, \"min_digits\": 1, \"max_digits\": $(smollm2_or 2 1)\}}" \
  --out "$out/data" --num-train 64 --num-eval 32 --num-sft 96 --answer-format "$(smollm2_or number plain)" --seed 0

common=(--train-backend fsdp --actor-num-gpus-per-node 1 --seed 1 --lr-decay-style constant --weight-decay 0.0
        --adam-beta2 0.99)

grpo_from="$out/model"
if [ "$sft_steps" != 0 ]; then
echo "== 2/4 SFT warm start on the gym's answers"
grpo_from="$out/sft_hf"
$py train.py "${common[@]}" --debug-train-only --hf-checkpoint "$out/model" \
  --rollout-function-path slime.rollout.sft_rollout.generate_rollout \
  --prompt-data "$out/data/sft.jsonl" --input-key messages --rollout-shuffle \
  --loss-type sft_loss --calculate-per-token-loss --disable-compute-advantages-and-returns \
  --rollout-batch-size 16 --num-rollout "$sft_steps" --lr 3e-3 \
  --save "$out/sft_ckpt" --save-interval 1000 --save-hf "$out/sft_hf" --run-dir "$out/runs/sft"
else
echo "== 2/4 no warm start (SFT_STEPS=0)"
fi

echo "== 3/4 GRPO, rewarded by the gym's verifier"
$py train.py "${common[@]}" --rollout-backend embedded --rollout-num-gpus 1 "${colocate[@]}" --hf-checkpoint "$grpo_from" \
  --prompt-data "$out/data/train.jsonl" --input-key prompt --label-key label --metadata-key metadata \
  --apply-chat-template --rollout-shuffle --rm-type reasoning_gym \
  --rollout-batch-size "${GRPO_PROMPTS:-16}" --n-samples-per-prompt "${SAMPLES:-8}" \
  --rollout-max-response-len "$(smollm2_or 64 6)" --rollout-temperature 1.0 \
  --num-rollout "${GRPO_STEPS:-50}" --num-steps-per-rollout 1 --lr "$(smollm2_or 1e-5 5e-4)" --eps-clip 0.2 \
  --eval-prompt-data train_prompts "$out/data/train.jsonl" heldout "$out/data/eval.jsonl" \
  --eval-interval "${EVAL_INTERVAL:-10}" --eval-temperature 0.01 --n-samples-per-eval-prompt 1 \
  --eval-max-response-len "$(smollm2_or 64 6)" --run-dir "$out/runs/grpo"

echo "== 4/4 summary"
$py -m slime.utils.run_summary $([ "$sft_steps" != 0 ] && echo --sft-run "$out/runs/sft") --grpo-run "$out/runs/grpo" \
  --eval-name train_prompts heldout
