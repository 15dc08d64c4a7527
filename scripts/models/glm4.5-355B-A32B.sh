# Source (checked 2026-12-01): https://huggingface.co/zai-org/GLM-4.5/blob/main/config.json (its page is not in the
# search index; read through NVIDIA Megatron-Bridge's GLM-4.5 card and the configs of GLM-4.6 / GLM-4.7, which keep
# the shape: https://huggingface.co/zai-org/GLM-4.7/blob/main/config.json): hidden 5120, 92 layers
# (first_k_dense_replace 3), 96 heads / 8 KV heads of 128, partial_rotary_factor 0.5, use_qk_norm true,
# attention_bias true, 160 routed + 1 shared experts of 1536, top-8, routed_scaling_factor 2.5, rope_theta 1e6,
# rms_norm_eps 1e-5, vocab 151552. Published total 355B (the MTP layer not built here). Every value matched.
# glm4.5-355B-A32B (GLM-4.5): Megatron model-shape flags (values of the published Hugging Face
# config.json). GQA with partial rotary (half of each head), qkv bias and qk-norm; 160 routed experts
# + 1 shared, sigmoid routing with an expert bias, 3 dense first layers. (Its one MTP layer is not trained.)
# Usage: source scripts/models/glm4.5-355B-A32B.sh; python train.py ${MODEL_ARGS[@]} --hf-checkpoint ... .
# slime checks them against --hf-checkpoint at start-up and names any field that differs.
MODEL_ARGS=(
   --swiglu
   --num-layers 92
   --hidden-size 5120
   --ffn-hidden-size 12288
   --num-attention-heads 96
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --use-rotary-position-embeddings
   --rotary-percent 0.5
   --disable-bias-linear
   --add-qkv-bias
   --qk-layernorm
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --rotary-base 1000000
   --vocab-size 151552
   --untie-embeddings-and-output-weights
   --num-experts 160
   --moe-layer-freq "([0]*3+[1]*89)"
   --moe-ffn-hidden-size 1536
   --moe-shared-expert-intermediate-size 1536
   --moe-router-topk 8
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-topk-scaling-factor 2.5
   --moe-router-dtype fp32
   --moe-router-load-balancing-type none
   --moe-aux-loss-coeff 0
   --moe-token-dispatcher-type alltoall
)
