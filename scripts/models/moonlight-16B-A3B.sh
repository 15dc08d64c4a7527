# Source (checked 2026-12-01): https://huggingface.co/moonshotai/Moonlight-16B-A3B/blob/main/config.json
# (model_type deepseek_v3; its fields as quoted verbatim by public tests of other projects, the model page itself
# not being readable here; the shape agrees with NVIDIA NeMo's model card: 27 layers, hidden
# 2048, 16 heads): hidden 2048, intermediate 11264, 27 layers (first_k_dense_replace 1), 16 heads, no query LoRA
# (q_lora_rank null), kv_lora_rank 512, qk_nope/rope/v 128/64/128, 64 routed + 2 shared experts of 1408, top-6
# of one group, routed_scaling_factor 2.446, rope_theta 50000 without rope_scaling, rms_norm_eps 1e-5, vocab
# 163840, untied. Published total "16B" (15.96B by this shape).
# Usage: source scripts/models/moonlight-16B-A3B.sh; python train.py ${MODEL_ARGS[@]} --hf-checkpoint ... .
# slime checks them against --hf-checkpoint at start-up and names any field that differs.
MODEL_ARGS=(
   --swiglu
   --num-layers 27
   --hidden-size 2048
   --ffn-hidden-size 11264
   --num-attention-heads 16
   --num-query-groups 16
   --kv-channels 128
   --use-rotary-position-embeddings
   --disable-bias-linear
   --qk-layernorm
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --rotary-base 50000
   --vocab-size 163840
   --untie-embeddings-and-output-weights
   --multi-latent-attention
   --kv-lora-rank 512
   --qk-head-dim 128
   --qk-pos-emb-head-dim 64
   --v-head-dim 128
   --num-experts 64
   --moe-layer-freq "([0]*1+[1]*26)"
   --moe-ffn-hidden-size 1408
   --moe-shared-expert-intermediate-size 2816
   --moe-router-topk 6
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-topk-scaling-factor 2.446
   --moe-router-dtype fp32
   --moe-router-load-balancing-type none
   --moe-aux-loss-coeff 0
   --moe-token-dispatcher-type alltoall
)
