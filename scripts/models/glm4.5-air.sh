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
