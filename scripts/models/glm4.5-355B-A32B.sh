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
