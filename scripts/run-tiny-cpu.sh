#!/usr/bin/env bash
# The CPU quick start: builds a tiny Qwen3 model and an arithmetic task, warm-starts the model with
# slime's SFT path, then runs GRPO with Ray, the smg router, the embedded engine and FSDP2 on gloo,
# evaluating before and during training (greedy accuracy on the 64 RL prompts and on 32 held-out
# problems). Ends with a summary table. About 6 minutes on 2 idle cores once .venv exists.
#   bash scripts/run-tiny-cpu.sh            (outputs under outputs/tiny-cpu; OUT=dir to change)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup-env.sh core
py=.venv/bin/python
export TOKENIZERS_PARALLELISM=false RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-outputs/tiny-cpu}"
rm -rf "$out" && mkdir -p "$out"

echo "== 1/4 building the tiny model and the task data"
$py -m slime.utils.tiny_model --out "$out/model" --size tiny --seed 0
$py -m slime.utils.tiny_task --out "$out/data" --seed 0 --max-operand 10 --num-train 64 --num-eval 32 --num-sft 48

common=(--train-backend fsdp --actor-num-gpus-per-node 1 --seed 1 --lr-decay-style constant --weight-decay 0.0
        --adam-beta2 0.99 --use-dynamic-batch-size --max-tokens-per-gpu 4096)

echo "== 2/4 SFT warm start (slime.rollout.sft_rollout, --debug-train-only)"
$py train.py "${common[@]}" --debug-train-only --hf-checkpoint "$out/model" \
  --rollout-function-path slime.rollout.sft_rollout.generate_rollout \
  --prompt-data "$out/data/sft.jsonl" --input-key messages --rollout-shuffle \
  --loss-type sft_loss --calculate-per-token-loss --disable-compute-advantages-and-returns \
  --rollout-batch-size 16 --num-rollout "${SFT_STEPS:-100}" --lr 3e-3 \
  --save "$out/sft_ckpt" --save-interval 1000 --save-hf "$out/sft_hf" --run-dir "$out/runs/sft"

echo "== 3/4 GRPO (embedded engine behind the smg router, FSDP2 trainer)"
$py train.py "${common[@]}" --rollout-backend embedded --rollout-num-gpus 1 --hf-checkpoint "$out/sft_hf" \
  --prompt-data "$out/data/train.jsonl" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle \
  --custom-rm-path examples.tiny_cpu.reward.reward \
  --rollout-batch-size 16 --n-samples-per-prompt 8 --rollout-max-response-len 6 --rollout-temperature 1.0 \
  --num-rollout "${GRPO_STEPS:-50}" --num-steps-per-rollout 1 --lr 5e-4 --eps-clip 0.2 \
  --eval-prompt-data train_prompts "$out/data/train.jsonl" heldout "$out/data/eval.jsonl" \
  --eval-interval 10 --eval-temperature 0.01 --n-samples-per-eval-prompt 1 \
  --save "$out/grpo_ckpt" --save-interval 10 --run-dir "$out/runs/grpo"

echo "== 4/4 summary"
$py -m slime.utils.run_summary --sft-run "$out/runs/sft" --grpo-run "$out/runs/grpo" --eval-name train_prompts heldout
