# qwen2.5-1.5B: Megatron model-shape flags (values of the published Hugging Face config.json).
# Usage: source scripts/models/qwen2.5-1.5B.sh; python train.py ${MODEL_ARGS[@]} --hf-checkpoint ... .
# slime checks them against --hf-checkpoint at start-up and names any field that differs.
MODEL_ARGS=(
   --swiglu
   --num-layers 28
   --hidden-size 1536
   --ffn-hidden-size 8960
   --num-attention-heads 12
   --group-query-attention
   --num-query-groups 2
   --kv-channels 128
   --use-rotary-position-embeddings
   --disable-bias-linear
   --add-qkv-bias
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --rotary-base 1000000
   --vocab-size 151936
)
