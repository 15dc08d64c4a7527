# qwen3-4B: Megatron model-shape flags (values of the published Hugging Face config.json).
# Usage: source scripts/models/qwen3-4B.sh; python train.py ${MODEL_ARGS[@]} --hf-checkpoint ... .
# slime checks them against --hf-checkpoint at start-up and names any field that differs.
MODEL_ARGS=(
   --swiglu
   --num-layers 36
   --hidden-size 2560
   --ffn-hidden-size 9728
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --use-rotary-position-embeddings
   --disable-bias-linear
   --qk-layernorm
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --rotary-base 1000000
   --vocab-size 151936
)
