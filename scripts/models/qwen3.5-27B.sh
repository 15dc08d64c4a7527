# qwen3.5-27B (Qwen3.5-27B, language model of the multimodal checkpoint): Megatron model-shape flags (values of the published Hugging Face config.json).
# Source: https://huggingface.co/Qwen/Qwen3.5-27B/blob/main/config.json (text_config)
# Gated-DeltaNet linear attention in 3 of every 4 layers, gated softmax attention in the 4th, zero-centred
# norms: the Megatron backend does not build these layers (it refuses the flags at start and says so);
# train this model with --train-backend fsdp, which reads the same shape from --hf-checkpoint's config.json.
# Usage: source scripts/models/qwen3.5-27B.sh; python train.py ${MODEL_ARGS[@]} --hf-checkpoint ... .
# slime checks them against --hf-checkpoint at start-up and names any field that differs.
MODEL_ARGS=(
   --swiglu
   --num-layers 64
   --hidden-size 5120
   --ffn-hidden-size 17408
   --num-attention-heads 24
   --group-query-attention
   --num-query-groups 4
   --kv-channels 256
   --use-rotary-position-embeddings
   --rotary-percent 0.25
   --disable-bias-linear
   --qk-layernorm
   --normalization RMSNorm
   --apply-layernorm-1p
   --norm-epsilon 1e-6
   --rotary-base 10000000
   --vocab-size 248320
   --untie-embeddings-and-output-weights
   --use-gated-attention
   --experimental-attention-variant gated_delta_net
   --linear-attention-freq 4
   --linear-conv-kernel-dim 4
   --linear-key-head-dim 128
   --linear-value-head-dim 128
   --linear-num-key-heads 16
   --linear-num-value-heads 48
)
