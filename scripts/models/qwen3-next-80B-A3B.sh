# qwen3-next-80B-A3B (Qwen3-Next-80B-A3B; 512 experts + 1 gated shared): Megatron model-shape flags (values of the published Hugging Face config.json).
# Source: https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json
# Gated-DeltaNet linear attention in 3 of every 4 layers, gated softmax attention in the 4th, zero-centred
# norms: the Megatron backend does not build these layers (it refuses the flags at start and says so);
# train this model with --train-backend fsdp, which reads the same shape from --hf-checkpoint's config.json.
# Usage: source scripts/models/qwen3-next-80B-A3B.sh; python train.py ${MODEL_ARGS[@]} --hf-checkpoint ... .
# slime checks them against --hf-checkpoint at start-up and names any field that differs.
MODEL_ARGS=(
   --swiglu
   --num-layers 48
   --hidden-size 2048
   --ffn-hidden-size 5120
   --num-attention-heads 16
   --group-query-attention
   --num-query-groups 2
   --kv-channels 256
   --use-rotary-position-embeddings
   --rotary-percent 0.25
   --disable-bias-linear
   --qk-layernorm
   --normalization RMSNorm
   --apply-layernorm-1p
   --norm-epsilon 1e-6
   --rotary-base 10000000
   --vocab-size 151936
   --untie-embeddings-and-output-weights
   --use-gated-attention
   --experimental-attention-variant gated_delta_net
   --linear-attention-freq 4
   --linear-conv-kernel-dim 4
   --linear-key-head-dim 128
   --linear-value-head-dim 128
   --linear-num-key-heads 16
   --linear-num-value-heads 32
   --num-experts 512
   --moe-ffn-hidden-size 512
   --moe-shared-expert-intermediate-size 512
   --moe-shared-expert-gate
   --moe-router-topk 10
   --moe-router-dtype fp32
   --moe-router-load-balancing-type none
   --moe-aux-loss-coeff 0
   --moe-token-dispatcher-type alltoall
)
