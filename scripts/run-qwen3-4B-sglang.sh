#!/usr/bin/env bash
# GRPO on Qwen3-4B with real SGLang engines (one node, 8 GPUs, colocated), in the style of the seed's
# run-qwen3-4B.sh. Needs a GPU machine with `pip install -e '.[sglang]'` (SGLang 0.5.23, the tested
# version; docs/sglang.md). Paths come from the environment:
#   HF_CKPT=/models/Qwen3-4B PROMPT_DATA=/data/dapo-math-17k.jsonl EVAL_DATA=/data/aime-2024.jsonl \
#   SAVE_DIR=/ckpt/qwen3-4b-grpo bash scripts/run-qwen3-4B-sglang.sh [extra flags]
# Ray: a running cluster is used when RAY_ADDRESS is set, otherwise slime starts Ray on this node.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
: "${HF_CKPT:?set HF_CKPT to the Qwen3-4B Hugging Face directory}"
: "${PROMPT_DATA:?set PROMPT_DATA to the training prompts (.jsonl or .parquet)}"
SAVE_DIR="${SAVE_DIR:-$root/outputs/qwen3-4b-sglang}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"

source scripts/models/qwen3-4B.sh  # model shape, checked against --hf-checkpoint at start-up

CKPT_ARGS=(--hf-checkpoint "$HF_CKPT" --save "$SAVE_DIR" --save-interval 20)

ROLLOUT_ARGS=(
   --prompt-data "$PROMPT_DATA" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
   --rollout-max-response-len 8192 --rollout-temperature 1.0
   --global-batch-size 256 --balance-data
)

EVAL_ARGS=()
if [ -n "${EVAL_DATA:-}" ]; then
   EVAL_ARGS=(--eval-interval 20 --eval-prompt-data aime "$EVAL_DATA" --n-samples-per-eval-prompt 16
              --eval-max-response-len 16384 --eval-top-p 0.7)
fi

PERF_ARGS=(--use-dynamic-batch-size --max-tokens-per-gpu 9216)

GRPO_ARGS=(
   --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl
   --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98)

# Every SGLang server flag passes through as --sglang-<flag> (checked against the installed SGLang);
# slime sets the model path, TP size, ports, GPU ids and the memory saver itself.
SGLANG_ARGS=(
   --rollout-backend sglang --rollout-num-gpus-per-engine 2
   --sglang-mem-fraction-static 0.7
   --sglang-cuda-graph-max-bs-decode 256
)

python train.py \
   --train-backend fsdp --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate \
   "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${PERF_ARGS[@]}" \
   "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${SGLANG_ARGS[@]}" "$@"
