# qwen3-30B-A3B: Megatron model-shape flags (values of the published Hugging Face config.json).
# Usage: source scripts/models/qwen3-30B-A3B.sh; python train.py ${MODEL_ARGS[@]} --hf-checkpoint ... .
# slime checks them against --hf-checkpoint at start-up and names any field that differs.
MODEL_ARGS=(
   --swiglu
   --num-layers 48
   --hidden-size 2048
   --ffn-hidden-size 6144
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 4
   --kv-channels 128
   --use-rotary-position-embeddings
   --disable-bias-linear
   --qk-layernorm
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --rotary-base 1000000
   --vocab-size 151936
   --untie-embeddings-and-output-weights
   --num-experts 128
   --moe-ffn-hidden-size 768
   --moe-router-topk 8
   --moe-router-score-function softmax
   --moe-router-load-balancing-type none
   --moe-aux-loss-coeff 0
   --moe-token-dispatcher-type alltoall
)
