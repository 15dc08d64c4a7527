"""Flags that one training backend reads and the other does not, refused at start under the other.

A flag set away from its default for a backend that would ignore it fails ``parse_args`` with what to
use instead: asking the FSDP backend for tensor parallelism must not train with TP=1 silently.
``tests/test_no_silent_flags.py`` checks per backend that every flag either backend's code path
does not read is listed here (or refused for both).
"""

from __future__ import annotations

_PARALLEL = ("FSDP2 shards every parameter over all ranks (data parallelism only); tensor, pipeline, expert and "
             "sequence parallelism need --train-backend megatron")
_RECOMPUTE = "use --gradient-checkpointing (activation checkpointing of every decoder layer) with --train-backend fsdp"
_OPTIMIZER = ("Megatron's distributed-optimizer options; with --train-backend fsdp, --offload-train moves the "
              "optimizer state to host memory between steps")
_ARCHITECTURE = ("--train-backend fsdp builds the model from --hf-checkpoint's config.json; drop the Megatron "
                 "model flags (or use --train-backend megatron)")
_CHECKPOINT = ("--train-backend fsdp resumes from the latest checkpoint under --load; use --no-load-optim "
               "--no-load-rng to start the optimizer afresh")
_MEGATRON_HOOK = ("a Megatron-Core hook or switch; --train-backend fsdp trains the Hugging Face model at "
                  "--hf-checkpoint")

_MEGATRON_ONLY_GROUPS: dict[str, tuple[str, ...]] = {
    _PARALLEL: ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size",
                "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "sequence_parallel"),
    _RECOMPUTE: ("recompute_granularity", "recompute_method", "recompute_num_layers"),
    _OPTIMIZER: ("optimizer_cpu_offload", "overlap_cpu_optimizer_d2h_h2d", "use_precision_aware_optimizer"),
    _ARCHITECTURE: (
        "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention", "num_query_groups",
        "kv_channels", "seq_length", "position_embedding_type", "rotary_base", "rotary_percent", "normalization",
        "norm_epsilon", "swiglu", "disable_bias_linear", "add_qkv_bias", "qk_layernorm",
        "untie_embeddings_and_output_weights", "vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by",
        "attention_dropout", "hidden_dropout", "spec",
        "num_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_score_function", "moe_grouped_gemm",
        "moe_token_dispatcher_type", "moe_aux_loss_coeff", "moe_router_load_balancing_type", "moe_router_pre_softmax",
        "moe_shared_expert_gate", "moe_layer_freq", "moe_router_dtype", "moe_router_enable_expert_bias",
        "moe_router_bias_update_rate", "moe_router_topk_scaling_factor", "moe_router_num_groups",
        "moe_router_group_topk", "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_permute_fusion",
        "moe_enable_deepep",
        "use_rope_scaling", "rope_scaling_factor", "rotary_interleaved", "multi_latent_attention", "q_lora_rank",
        "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rotary_scaling_factor", "mscale",
        "mscale_all_dim", "yarn_beta_fast", "yarn_beta_slow", "yarn_original_max_position_embeddings", "rope_type",
        "use_gated_attention", "linear_attention_freq", "post_self_attn_layernorm", "post_mlp_layernorm",
        "apply_layernorm_1p", "mtp_num_layers",
        # Megatron's kernel-fusion switches (--no-*-fusion) and its NaN check
        "apply_rope_fusion", "masked_softmax_fusion", "gradient_accumulation_fusion", "bias_swiglu_fusion",
        "bias_dropout_fusion", "bias_gelu_fusion", "check_for_nan_in_loss_and_grad"),
    _CHECKPOINT: ("ckpt_step", "ref_ckpt_step", "finetune", "megatron_config_path"),
    _MEGATRON_HOOK: ("custom_model_provider_path", "custom_megatron_init_path",
                     "custom_megatron_before_log_prob_hook_path", "enable_experimental"),
}

#: dest -> what to use with ``--train-backend fsdp`` instead
MEGATRON_ONLY: dict[str, str] = {dest: hint for hint, dests in _MEGATRON_ONLY_GROUPS.items() for dest in dests}

#: dest -> what to use with ``--train-backend megatron`` instead
FSDP_ONLY: dict[str, str] = {
    "fsdp_mixed_precision": "the Megatron backend computes in bf16 under autocast with fp32 parameters (--fp16 for fp16)",
    "fsdp_attn_implementation": "the Megatron backend's layers (Megatron-Core's layer spec, --spec) choose the attention",
    "fsdp_compile": "an FSDP option; the Megatron backend does not compile layers",
    "gradient_checkpointing": "use --recompute-granularity full --recompute-method uniform with --train-backend megatron",
    "log_probs_chunk_size": "an FSDP option; the Megatron backend computes log-probs from vocab-parallel logits",
}


def refuse_other_backend_flags(args, flags: dict[str, tuple[str, object]]) -> None:
    """Raise naming every flag set away from its default that the chosen ``--train-backend`` would ignore;
    ``flags`` maps each dest to its option string and the parser's default."""
    other = {"fsdp": MEGATRON_ONLY, "megatron": FSDP_ONLY}.get(args.train_backend, {})
    problems = []
    for dest, hint in other.items():
        flag, default = flags[dest]
        value = getattr(args, dest, default)
        if value != default:
            problems.append(f"{flag} {value!r} ({hint})")
    if problems:
        raise ValueError(f"--train-backend {args.train_backend} does not read " + "; ".join(problems))
