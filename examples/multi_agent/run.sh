#!/usr/bin/env bash
# The multi-agent example on the CPU: a solver and a critic (one tiny model, two roles) per prompt.
# Builds the tiny model and the arithmetic data with warm-start conversations for both roles, SFTs
# both formats, then GRPO where each slot is a solver turn and a critic turn trained together
# (sibling samples of one rollout): the solver rewarded for a right answer, the critic for a true verdict,
# balanced over right and wrong solver answers, each role normalised against its own role. Ends with
# per-role scores.
#   bash examples/multi_agent/run.sh   (outputs under outputs/multi-agent; OUT=dir, SFT_STEPS=n, GRPO_STEPS=n, GRPO_PROMPTS=n)
#   MODEL=smollm2: SmolLM2-135M-Instruct instead of the tiny model (SFT and GRPO at lr 1e-5).
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
out="${OUT:-outputs/multi-agent$(smollm2_or -smollm2 '')}"
rm -rf "$out" && mkdir -p "$out"

echo "== 1/4 the model (MODEL=${MODEL:-tiny}) and the data"
example_model "$out/model"
$py -m examples.multi_agent.data --out "$out/data" --seed 0

common=(--train-backend fsdp --actor-num-gpus-per-node 1 --seed 1 --lr-decay-style constant --weight-decay 0.0
        --adam-beta2 0.99 --use-dynamic-batch-size --max-tokens-per-gpu 4096)

echo "== 2/4 SFT warm start of both roles"
$py train.py "${common[@]}" --debug-train-only --hf-checkpoint "$out/model" \
  --rollout-function-path slime.rollout.sft_rollout.generate_rollout \
  --prompt-data "$out/data/sft.jsonl" --input-key messages --rollout-shuffle \
  --loss-type sft_loss --calculate-per-token-loss --disable-compute-advantages-and-returns \
  --rollout-batch-size 16 --num-rollout "${SFT_STEPS:-300}" --lr "$(smollm2_or 1e-5 3e-3)" \
  --save "$out/sft_ckpt" --save-interval 1000 --save-hf "$out/sft_hf" --run-dir "$out/runs/sft"

echo "== 3/4 GRPO, solver and critic per slot"
$py train.py "${common[@]}" --rollout-backend embedded --rollout-num-gpus 1 "${colocate[@]}" --hf-checkpoint "$out/sft_hf" \
  --prompt-data "$out/data/train.jsonl" --input-key prompt --label-key label --rollout-shuffle \
  --custom-generate-function-path examples.multi_agent.generate.generate \
  --custom-reward-post-process-path examples.multi_agent.reward.post_process \
  --rollout-batch-size "${GRPO_PROMPTS:-16}" --n-samples-per-prompt 8 --rollout-max-response-len 4 --rollout-temperature 1.0 \
  --num-rollout "${GRPO_STEPS:-40}" --num-steps-per-rollout 1 --lr "$(smollm2_or 1e-5 5e-4)" --eps-clip 0.2 \
  --eval-prompt-data train_prompts "$out/data/train.jsonl" heldout "$out/data/eval.jsonl" \
  --eval-interval 10 --eval-temperature 0.01 --n-samples-per-eval-prompt 1 \
  --save-debug-rollout-data "$out/dumps/rollout_{rollout_id}.pt" --run-dir "$out/runs/grpo"

echo "== 4/4 per-role scores"
$py -m examples.multi_agent.summary --out "$out" | tee "$out/summary.md"
