# Source (checked 2026-12-01): https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json, read
# through public copies of it (the model page itself is not in the search index); DeepSeek-V3-Base, -0324 and R1
# have the same shape: hidden 7168, 61 layers (first_k_dense_replace 3), 128 heads,
# q/kv LoRA 1536/512, qk_nope/rope/v 128/64/128, 256 routed + 1 shared experts of 2048, top-8 of 8 groups keep 4,
# routed_scaling_factor 2.5, YaRN factor 40 (beta 32/1, mscale 1/1, from 4096), rms_norm_eps 1e-6, vocab 129280.
# Published total: 671B + the 14B MTP module (not built here). Every value below matched; nothing changed.
# deepseek-v3 (also DeepSeek-V3-0324 / R1: the same shape): Megatron model-shape flags (values of the
# published Hugging Face config.json). MLA with q/kv LoRA and YaRN, 256 routed experts + 1 shared,
# sigmoid routing with an expert bias over 8 groups (4 kept), 3 dense first layers.
# Usage: source scripts/models/deepseek-v3.sh; python train.py ${MODEL_ARGS[@]} --hf-checkpoint ... .
# slime checks them against --hf-checkpoint at start-up and names any field that differs.
MODEL_ARGS=(
   --swiglu
   --num-layers 61
   --hidden-size 7168
   --ffn-hidden-size 18432
   --num-attention-heads 128
   --num-query-groups 128
   --kv-channels 128
   --use-rotary-position-embeddings
   --disable-bias-linear
   --qk-layernorm
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --rotary-base 10000
   --vocab-size 129280
   --untie-embeddings-and-output-weights
   --multi-latent-attention
   --q-lora-rank 1536
   --kv-lora-rank 512
   --qk-head-dim 128
   --qk-pos-emb-head-dim 64
   --v-head-dim 128
   --rotary-scaling-factor 40
   --mscale 1.0
   --mscale-all-dim 1.0
   --num-experts 256
   --moe-layer-freq "([0]*3+[1]*58)"
   --moe-ffn-hidden-size 2048
   --moe-shared-expert-intermediate-size 2048
   --moe-router-topk 8
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-topk-scaling-factor 2.5
   --moe-router-num-groups 8
   --moe-router-group-topk 4
   --moe-router-dtype fp32
   --moe-router-load-balancing-type none
   --moe-aux-loss-coeff 0
   --moe-token-dispatcher-type alltoall
)
