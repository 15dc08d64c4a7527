# Source (checked 2026-12-01): https://huggingface.co/zai-org/GLM-4.5-Air/blob/main/config.json (its text is not in
# the search index; read from the config.json of its fine-tune PrimeIntellect/INTELLECT-3, same shape):
# hidden 4096, 46 layers (first_k_dense_replace 1), 96 heads / 8 KV heads of 128, partial rotary 0.5,
# use_qk_norm false, 128 routed + 1 shared experts of
# 1408, top-8, routed_scaling_factor 1.0 (Megatron's default: no flag), rope_theta 1e6, rms_norm_eps 1e-5.
# Published total 106B (the MTP layer not built here). Every value matched.
# glm4.5-air (GLM-4.5-Air, 106B-A12B): Megatron model-shape flags (values of the published Hugging Face
# config.json). As GLM-4.5 without qk-norm: 128 routed experts + 1 shared, one dense first layer.
# Usage: source scripts/models/glm4.5-air.sh; python train.py ${MODEL_ARGS[@]} --hf-checkpoint ... .
# slime checks them against --hf-checkpoint at start-up and names any field that differs.
MODEL_ARGS=(
   --swiglu
   --num-layers 46
   --hidden-size 4096
   --ffn-hidden-size 10944
   --num-attention-heads 96
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --use-rotary-position-embeddings
   --rotary-percent 0.5
   --disable-bias-linear
   --add-qkv-bias
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --rotary-base 1000000
   --vocab-size 151552
   --untie-embeddings-and-output-weights
   --num-experts 128
   --moe-layer-freq "([0]*1+[1]*45)"
   --moe-ffn-hidden-size 1408
   --moe-shared-expert-intermediate-size 1408
   --moe-router-topk 8
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-dtype fp32
   --moe-router-load-balancing-type none
   --moe-aux-loss-coeff 0
   --moe-token-dispatcher-type alltoall
)
