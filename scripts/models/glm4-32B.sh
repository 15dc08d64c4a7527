# glm4-32B (GLM-4-32B-0414): Megatron model-shape flags (values of the published Hugging Face config.json).
# Source: https://huggingface.co/zai-org/GLM-4-32B-0414/blob/main/config.json
# GLM-4 dense: RMSNorm on the attention and MLP outputs too (post-self-attn / post-mlp norms, built by
# slime.backends.megatron_utils.sandwich_norm), interleaved rotary on half of each head.
# Usage: source scripts/models/glm4-32B.sh; python train.py ${MODEL_ARGS[@]} --hf-checkpoint ... .
# slime checks them against --hf-checkpoint at start-up and names any field that differs.
MODEL_ARGS=(
   --swiglu
   --num-layers 61
   --hidden-size 6144
   --ffn-hidden-size 23040
   --num-attention-heads 48
   --group-query-attention
   --num-query-groups 2
   --kv-channels 128
   --use-rotary-position-embeddings
   --rotary-percent 0.5
   --rotary-interleaved
   --disable-bias-linear
   --add-qkv-bias
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --rotary-base 10000
   --vocab-size 151552
   --untie-embeddings-and-output-weights
   --post-self-attn-layernorm
   --post-mlp-layernorm
)
