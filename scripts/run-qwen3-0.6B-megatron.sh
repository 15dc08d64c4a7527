#!/usr/bin/env bash
# GRPO on Qwen3-0.6B with the Megatron-Core trainer, like the seed's run-qwen3-*.sh examples.
# One node: 4 GPUs train (data parallel), 4 GPUs generate (disaggregated); set COLOCATE=1 to share
# all GPUs between training and generation. Needs megatron-core (pip install -e '.[megatron]').
#   MODEL=/root/Qwen3-0.6B DATA=/root/dapo-math-17k.jsonl bash scripts/run-qwen3-0.6B-megatron.sh
#   PP=2 bash scripts/run-qwen3-0.6B-megatron.sh      # two pipeline stages per model replica (TP=2, CP=2 alike)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/models/qwen3-0.6B.sh

MODEL="${MODEL:-/root/Qwen3-0.6B}"
DATA="${DATA:-/root/dapo-math-17k/dapo-math-17k.jsonl}"
SAVE="${SAVE:-/root/Qwen3-0.6B_slime}"
ENGINE="${ENGINE:-embedded}"   # embedded (slime's engine) or sglang

CKPT_ARGS=(
   --hf-checkpoint "$MODEL"
   # weights come straight from the HF directory; a torch_dist copy made with
   # tools/convert_hf_to_torch_dist.py works the same: --ref-load /root/Qwen3-0.6B_torch_dist
   --ref-load "$MODEL"
   --load "$SAVE"
   --save "$SAVE"
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 300 --rollout-batch-size 32 --n-samples-per-prompt 8
   --rollout-max-response-len 4096 --rollout-temperature 1.0
   --global-batch-size 256 --balance-data
)

PERF_ARGS=(
   # TP=2 / PP=2 split the model over 2 GPUs (tensor / pipeline stages); CP=2 splits every sample over
   # 2 GPUs (long responses: each GPU then holds up to --max-tokens-per-gpu of a 2 x 9216-token micro-batch)
   --tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-1}" --context-parallel-size "${CP:-1}"
   --use-dynamic-batch-size --max-tokens-per-gpu 9216
)

GRPO_ARGS=(
   --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl
   --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
   --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
)

PLACEMENT_ARGS=(--actor-num-nodes 1 --actor-num-gpus-per-node 4 --rollout-num-gpus 4 --rollout-num-gpus-per-engine 1)
if [ "${COLOCATE:-0}" = 1 ]; then
   PLACEMENT_ARGS=(--actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate --rollout-num-gpus-per-engine 1)
fi

python train.py \
   --train-backend megatron --rollout-backend "$ENGINE" \
   "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${PERF_ARGS[@]}" "${GRPO_ARGS[@]}" \
   "${OPTIMIZER_ARGS[@]}" "${PLACEMENT_ARGS[@]}" \
   --sglang-mem-fraction-static 0.7 \
   "$@"
