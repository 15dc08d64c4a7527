# llama3.1-8B: Megatron model-shape flags (values of the published Hugging Face config.json).
# Usage: source scripts/models/llama3.1-8B.sh; python train.py ${MODEL_ARGS[@]} --hf-checkpoint ... .
# slime checks them against --hf-checkpoint at start-up and names any field that differs.
MODEL_ARGS=(
   --swiglu
   --num-layers 32
   --hidden-size 4096
   --ffn-hidden-size 14336
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --rotary-base 500000
   --vocab-size 128256
   --untie-embeddings-and-output-weights
   --use-rope-scaling
   --rope-scaling-factor 8.0
)
