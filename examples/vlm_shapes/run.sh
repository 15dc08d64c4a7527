#!/usr/bin/env bash
# The shapes example end to end on CPU: a tiny random Qwen2.5-VL (slime.utils.tiny_vlm), PIL pictures of
# 1-4 squares, an SFT warm start on the right counts, then GRPO through train.py (Ray, the smg router, the
# embedded engine with the vision tower, FSDP2 on gloo), greedy accuracy on 128 held-out pictures before
# and after GRPO.
#   bash examples/vlm_shapes/run.sh            (outputs under outputs/vlm-shapes/seed$SEED; OUT=dir to change)
#   SEED=.. SFT_STEPS=.. SFT_LR=.. GRPO_STEPS=.. GRPO_LR=.. GRPO_TEMPERATURE=.. FREEZE_VISION=1 (--freeze-vision-tower in GRPO)
# A short SFT at 5e-4 stops partway into learning to count; at 2e-3 the SFT stays at a uniform guess.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py=${PYTHON:-.venv/bin/python}
colocate=()  # one GPU: trainer and engine share it
[ "$($py -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)" = 1 ] && colocate=(--colocate)
export TOKENIZERS_PARALLELISM=false RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
seed=${SEED:-0}
out="${OUT:-outputs/vlm-shapes/seed$seed}"
rm -rf "$out" && mkdir -p "$out"
common=(--train-backend fsdp --actor-num-gpus-per-node 1 --seed "$seed" --lr-decay-style constant
        --weight-decay 0.0 --adam-beta2 0.99 --multimodal-keys '{"image": "images"}'
        --use-dynamic-batch-size --max-tokens-per-gpu 4096)

echo "== 1/4 data and the tiny VLM"
$py -m examples.vlm_shapes.data --out "$out/data" --seed "$seed"
$py -m slime.utils.tiny_vlm --out "$out/model" --arch qwen2_5_vl --seed "$seed"

echo "== 2/4 SFT warm start on the right counts"
$py train.py "${common[@]}" --debug-train-only --hf-checkpoint "$out/model" \
  --rollout-function-path slime.rollout.sft_rollout.generate_rollout \
  --prompt-data "$out/data/sft.jsonl" --input-key messages --rollout-shuffle \
  --loss-type sft_loss --calculate-per-token-loss --disable-compute-advantages-and-returns \
  --rollout-batch-size 32 --num-rollout "${SFT_STEPS:-58}" --lr "${SFT_LR:-5e-4}" \
  --save "$out/sft_ckpt" --save-interval 100000 --save-hf "$out/sft_hf" --run-dir "$out/runs/sft"

echo "== 3/4 GRPO, greedy held-out accuracy before and after"
freeze=()
if [ "${FREEZE_VISION:-0}" = 1 ]; then freeze=(--freeze-vision-tower); fi
$py train.py "${common[@]}" "${freeze[@]}" --rollout-backend embedded --rollout-num-gpus 1 "${colocate[@]}" \
  --hf-checkpoint "$out/sft_hf" --prompt-data "$out/data/train.jsonl" --input-key prompt --label-key label \
  --apply-chat-template --rollout-shuffle --custom-rm-path examples.vlm_shapes.reward.reward \
  --rollout-batch-size 8 --n-samples-per-prompt 8 --rollout-max-response-len 4 --rollout-temperature "${GRPO_TEMPERATURE:-1.0}" \
  --num-rollout "${GRPO_STEPS:-120}" --num-steps-per-rollout 1 --lr "${GRPO_LR:-3e-4}" --eps-clip 0.2 \
  --eval-prompt-data heldout "$out/data/eval.jsonl" --eval-interval "${GRPO_STEPS:-120}" --eval-temperature 0 \
  --n-samples-per-eval-prompt 1 --eval-max-response-len 4 --run-dir "$out/runs/grpo"

echo "== 4/4 summary"
$py -m slime.utils.run_summary --sft-run "$out/runs/sft" --grpo-run "$out/runs/grpo" --eval-name heldout
