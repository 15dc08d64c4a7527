# Source (checked 2026-12-01): https://huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/config.json
# (model_type kimi_k2, DeepseekV3ForCausalLM; the model summary of https://github.com/MoonshotAI/Kimi-K2: 1T total,
# 32B active, 61 layers of which 1 dense, hidden 7168, experts of 2048, 64 heads, 384 experts, 8 selected, 1 shared,
# vocabulary 160K, MLA; the remaining fields as NVIDIA Megatron-Bridge's KimiK2Provider and public copies of the
# config give them): q/kv LoRA 1536/512, qk_nope/rope/v 128/64/128, one expert group, routed_scaling_factor 2.827,
# rope_theta 50000 with YaRN factor 32, beta_fast 1, beta_slow 1, mscale 1/1 from 4096 positions (the -0905 and
# Thinking releases use factor 64: pass --rotary-scaling-factor 64), rms_norm_eps 1e-6, vocab 163840, untied.
# Usage: source scripts/models/kimi-k2.sh; python train.py ${MODEL_ARGS[@]} --hf-checkpoint ... .
# slime checks them against --hf-checkpoint at start-up and names any field that differs.
MODEL_ARGS=(
   --swiglu
   --num-layers 61
   --hidden-size 7168
   --ffn-hidden-size 18432
   --num-attention-heads 64
   --num-query-groups 64
   --kv-channels 128
   --use-rotary-position-embeddings
   --disable-bias-linear
   --qk-layernorm
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --rotary-base 50000
   --vocab-size 163840
   --untie-embeddings-and-output-weights
   --multi-latent-attention
   --q-lora-rank 1536
   --kv-lora-rank 512
   --qk-head-dim 128
   --qk-pos-emb-head-dim 64
   --v-head-dim 128
   --rotary-scaling-factor 32
   --mscale 1.0
   --mscale-all-dim 1.0
   --yarn-beta-fast 1
   --yarn-beta-slow 1
   --num-experts 384
   --moe-layer-freq "([0]*1+[1]*60)"
   --moe-ffn-hidden-size 2048
   --moe-shared-expert-intermediate-size 2048
   --moe-router-topk 8
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-topk-scaling-factor 2.827
   --moe-router-dtype fp32
   --moe-router-load-balancing-type none
   --moe-aux-loss-coeff 0
   --moe-token-dispatcher-type alltoall
)
