"""Flag definitions, one function per group of docs/INTERFACES.md §4.3 (defaults and help next to each flag).

``add_slime_arguments`` holds slime's own flags; ``add_training_arguments`` the training flags that
Megatron's parser names (parallelism, optimizer, checkpoint, model shape), defined here so the same
spellings work with the FSDP backend and without Megatron installed.
"""

from __future__ import annotations

import argparse



# Flags upstream slime's scripts pass that slime does not implement. They parse, so a script passing
# the default still runs; a non-default value is refused at start-up (validate_args) with this hint.
REFUSED_FLAGS: dict[str, str] = {
    "--distributed-backend": "slime picks the backend itself (nccl on CUDA, gloo on CPU); drop the flag",
    "--release-train": "trainer actors are not destroyed during rollout; use --colocate (offloads the trainer) instead",
    "--model-name": "weights are converted by the HF config's architecture; drop the flag",
    "--rollout-data-transport": "rollout data always travels through the Ray object store; drop the flag",
    "--http-proxy": "engines and the router are reached directly; set HTTP(S)_PROXY in the environment if needed",
    "--use-distributed-post": "requests are sent from the rollout process; raise --sglang-server-concurrency instead",
    "--log-probs-max-tokens-per-gpu": "the log-prob pass packs micro-batches by --max-tokens-per-gpu; set that instead",
    "--data-pad-size-multiplier": "packed sequences are not padded to a multiple; drop the flag",
    "--use-stateless-adam": "only --optimizer adam/sgd are implemented",
    "--recompute-loss-function": "use --recompute-granularity / --gradient-checkpointing for activation memory",
    "--opd-teacher-load": "a teacher inside the trainer is not implemented; use --use-opd --opd-type sglang with the "
                          "teacher served at --rm-url",
    "--opd-teacher-ckpt-step": "a teacher inside the trainer is not implemented; use --use-opd --opd-type sglang",
    "--no-save-rng": "RNG state is always saved with a checkpoint; drop the flag",
    "--ckpt-format": "checkpoints use one format per backend (Megatron: torch_dist, FSDP: DCP); drop the flag",
    "--freeze-indexer": "there is no sparse-attention indexer; use --freeze-params-name-list",
    "--allgather-cp": "context parallelism splits sequences one way; drop the flag",
    "--qwen-gdn-backend": "--train-backend fsdp runs transformers' gated-DeltaNet kernels (flash-linear-attention's "
                          "when installed, else torch's); drop the flag",
    "--megatron-deepgemm-forward-layers": "DeepGEMM kernels are not used; drop the flag",
    "--megatron-deepgemm-forward-modules": "DeepGEMM kernels are not used; drop the flag",
    "--megatron-deepgemm-moe-forward-layers": "DeepGEMM kernels are not used; drop the flag",
    "--megatron-deepgemm-moe-forward-modules": "DeepGEMM kernels are not used; drop the flag",
    "--enable-mtp-training": "multi-token-prediction layers are not trained; drop the flag",
    "--mtp-loss-scaling-factor": "multi-token-prediction layers are not trained; drop the flag",
    "--wandb-always-use-train-step": "W&B steps are rollout ids; drop the flag",
    "--memory-recorder": "only the torch recorder is implemented (--record-memory-history, CUDA)",
    "--rollout-buffer-url": "the rollout-buffer service is not supported; write a --rollout-function-path or "
                            "--data-source-path plugin instead",
    "--fetch-trajectory-retry-times": "the rollout-buffer service is not supported",
    "--min-batch-collection-ratio": "the rollout-buffer service is not supported",
    "--rollout-task-type": "the rollout-buffer service is not supported",
    "--attention-backend": "the trainer's attention is chosen per backend: --fsdp-attn-implementation (FSDP), "
                           "Megatron-Core's layer spec (--spec); the engine's is --sglang-attention-backend",
    "--ci-test": "upstream's CI guards are not implemented; slime's tests live in tests/",
    "--ci-disable-kl-checker": "upstream's CI guards are not implemented",
    "--ci-train-rollout-logprob-abs-diff-threshold": "upstream's CI guards are not implemented",
    "--ci-save-grad-norm": "upstream's CI guards are not implemented",
    "--ci-load-grad-norm": "upstream's CI guards are not implemented",
    "--fp8-format": "FP8 training needs Transformer Engine's FP8 layers and is not wired in; train in bf16 (the default)",
    "--fp8-recipe": "FP8 training needs Transformer Engine's FP8 layers and is not wired in; train in bf16 (the default)",
    "--fp8-param-gather": "FP8 training needs Transformer Engine's FP8 layers and is not wired in; train in bf16",
    "--recompute-modules": "use --recompute-granularity/--recompute-method/--recompute-num-layers",
}


def _megatron_lm_refusal(dest: str, group: str) -> str | None:
    """What is missing for a Megatron-LM model flag slime does not pass on; None for the TransformerConfig
    fields it passes to Megatron-Core as they are."""
    fp8 = "FP8/FP4 training needs Transformer Engine's low-precision layers and is not wired in; train in bf16"
    by_prefix = [
        (("fp8_", "fp4", "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
          "reuse_grad_buf_for_mxfp8"), fp8),
        (("mtp_",), "multi-token-prediction layers are not built; drop the flag"),
        (("dsa_",), "DSA sparse-attention layers (GLM-5, DeepSeek-V3.2) are not built (no HF mapping); use a "
                    "softmax-attention model"),
        (("mamba_", "is_hybrid_model", "use_mamba_mem_eff_path"), "Mamba hybrid layers are not built"),
        (("inference_", "flash_decode", "nccl_all_reduce_for_prefill", "symmetric_ar_type", "mlp_chunks_for_prefill",
          "moe_pad_experts_for_cuda_graph_inference", "cache_mla_latents"),
         "an option of Megatron's inference engine; rollouts run on SGLang or the embedded engine"),
        (("use_kitchen", "kitchen_"), "NVIDIA Kitchen quantization is not wired in"),
        (("mrope_section",), "multimodal (M-)RoPE is not built"),
        (("moe_enable_routing_replay",), "use --use-routing-replay (R2) or --use-rollout-routing-replay (R3)"),
        (("transformer_impl",), "slime picks the layer spec itself (Transformer Engine's when installed, else the "
                                "local spec); pass --spec MODULE FUNCTION to choose one"),
        (("tensor_parallel_num_weight_shards", "expert_tensor_parallel_num_weight_shards",
          "pipeline_model_parallel_comm_backend", "hierarchical_context_parallel_sizes", "hybrid_context_parallel",
          "max_seqlen_per_dp_cp_rank"),
         "a process-group option of Megatron-LM's initialize_model_parallel; slime builds the groups from the "
         "--*-parallel-size flags"),
        (("tp_comm_",), "TP communication overlap needs Transformer Engine's userbuffers, which slime does not set up"),
        (("cross_entropy_",), "log-probs come from slime's own kernels on the response rows, not Megatron's LM loss"),
        (("account_for_", "microbatch_group_size_per_vp_stage"),
         "the pipeline split is --decoder-first/last-pipeline-num-layers (the HF weight mapping follows it); "
         "virtual pipeline stages are refused"),
        (("enable_cuda_graph", "cuda_graph_", "external_cuda_graph", "delay_offload_until_cuda_graph"),
         "CUDA graphs need fixed shapes; slime's micro-batches vary in length"),
        (("moe_flex_dispatcher_", "moe_hybridep_", "moe_ncclep_", "moe_permute_fusion_into_hybridep"),
         "the flex token dispatcher is used only through --moe-enable-deepep (DeepEP); HybridEP and NCCL-EP are "
         "not wired in"),
        (("qk_clip",), "QK-clip is applied by Megatron-LM's own training loop, not by Megatron-Core's layers"),
        (("softmax_type", "apply_residual_connection_post_layernorm", "glu_linear_offset", "activation_func_clamp_value",
          "qk_l2_norm", "moe_latent_size", "use_mup", "mup_", "moe_apply_probs_on_input",
          "moe_shared_expert_glu_interleave_size", "moe_mlp_glu_interleave_size", "moe_single_grouped_",
          "use_grouped_gemm_for_", "moe_router_force_"),
         "changes the network (or its weight layout) away from the HF architecture that the weight mapping and the "
         "engines implement"),
    ]
    for prefixes, reason in by_prefix:
        if dest.startswith(prefixes):
            return reason
    # (the gated-DeltaNet / gated-attention fields, experimental_attention_variant, linear_* and
    # attention_output_gate, parse: the Megatron backend refuses them when it starts, setup.refuse_unsupported)
    if group == "transformer configuration":
        return None
    return {
        "encoder_num_layers": "decoder-only models: use --num-layers", "decoder_num_layers": "use --num-layers",
        "window_size": "sliding-window attention is not mapped from HF configs",
        "window_attn_skip_freq": "sliding-window attention is not mapped from HF configs",
        "yarn_correction_range_round_to_int": "Megatron-Core's MLA YaRN rounds as DeepSeek's does; drop the flag",
        "relative_attention_num_buckets": "relative position embeddings (T5) are not built: RoPE only",
        "relative_attention_max_distance": "relative position embeddings (T5) are not built: RoPE only",
        "rotary_seq_len_interpolation_factor": "use --rotary-scaling-factor (YaRN) or --use-rope-scaling (Llama 3.1)",
        "no_rope_freq": "layers without RoPE are not mapped from HF configs",
        "openai_gelu": "activations other than SwiGLU/GELU are not mapped from HF configs",
        "squared_relu": "activations other than SwiGLU/GELU are not mapped from HF configs",
        "quick_geglu": "activations other than SwiGLU/GELU are not mapped from HF configs",
        "onnx_safe": "an option of Megatron-LM's BERT/ONNX export; drop the flag",
        "bert_binary_head": "an option of Megatron-LM's BERT model; drop the flag",
        "moe_use_upcycling": "upcycling a dense checkpoint is not implemented; convert the model first",
        "moe_upcycling_granularity": "upcycling a dense checkpoint is not implemented",
        "mla_down_proj_fusion": "the fused MLA down projection needs Transformer Engine's fused layers; drop the flag",
        "grad_reduce_in_bf16": "gradients are reduced in fp32 (DistributedDataParallelConfig); drop the flag",
        "loss_scale": "fp16 loss scaling is not configurable; train in bf16 (the default)",
        "initial_loss_scale": "fp16 loss scaling is not configurable; train in bf16 (the default)",
        "min_loss_scale": "fp16 loss scaling is not configurable; train in bf16 (the default)",
        "loss_scale_window": "fp16 loss scaling is not configurable; train in bf16 (the default)",
        "hysteresis": "fp16 loss scaling is not configurable; train in bf16 (the default)",
        "fp16_lm_cross_entropy": "log-probs are computed in fp32 from the logits; drop the flag",
        "te_precision_config_file": "per-module Transformer Engine precision configs are not wired in",
    }.get(dest, "not implemented by slime")


def _add_megatron_lm_refusals() -> None:
    from slime.utils.megatron_lm_flags import MEGATRON_LM_FLAGS

    refused_dests = set()
    for strings, dest, _kind, _type, _nargs, _choices, _default, group in MEGATRON_LM_FLAGS:
        reason = _megatron_lm_refusal(dest, group)
        # one entry per destination (--x / --no-x pairs share one): the check compares the value with the default
        if reason is not None and dest != "add_position_embedding" and dest not in refused_dests:
            REFUSED_FLAGS[strings[0]] = reason
            refused_dests.add(dest)


_add_megatron_lm_refusals()


# the reference model of --kl-coef / --use-kl-loss, said where each flag is described
_REFERENCE_HELP = (" The reference model is --ref-load; under --train-backend fsdp without an HF --ref-load it is "
                   "the --hf-checkpoint weights as loaded at start, kept frozen (also when --load resumes the actor); "
                   "the Megatron backend needs --ref-load.")


def megatron_lm_passthrough_dests() -> tuple[str, ...]:
    """TransformerConfig fields whose Megatron-LM flag slime passes to Megatron-Core when it is set."""
    from slime.utils.megatron_lm_flags import MEGATRON_LM_FLAGS

    return tuple(dest for strings, dest, *_rest, group in MEGATRON_LM_FLAGS
                 if group == "transformer configuration" and strings[0] not in REFUSED_FLAGS)


def _refused_help(flag: str, help: str | None = None) -> str:
    text = f"{help} " if help else ""
    return f"{text}[Accepted for upstream scripts, refused unless left at its default: {REFUSED_FLAGS[flag]}.]"


def mark_refused_flags(parser: argparse.ArgumentParser) -> None:
    """Append the refusal and its alternative to each refused flag's ``--help`` text."""
    for action in parser._actions:
        flag = next((o for o in action.option_strings if o in REFUSED_FLAGS), None)
        if flag is not None:
            action.help = _refused_help(flag, action.help)


def _bool_pair(group, name: str, default, help: str, dest: str | None = None) -> None:
    """``--name`` / ``--no-name`` with a tri-state default (None = resolved later)."""
    dest = dest or name.replace("-", "_")
    group.add_argument(f"--{name}", dest=dest, action="store_true", default=default, help=help)
    group.add_argument(f"--no-{name}", dest=dest, action="store_false", help=f"Disable --{name}.")


def add_slime_arguments(parser: argparse.ArgumentParser) -> None:
    _add_mode_args(parser)
    _add_cluster_args(parser)
    _add_rollout_args(parser)
    _add_data_args(parser)
    _add_eval_args(parser)
    _add_reward_args(parser)
    _add_algorithm_args(parser)
    _add_opd_args(parser)
    _add_weight_update_args(parser)
    _add_checkpoint_args(parser)
    _add_customization_args(parser)
    _add_logging_args(parser)
    _add_debug_args(parser)
    _add_rollout_buffer_args(parser)
    _add_ci_args(parser)
    _add_sglang_owned_args(parser)
    _add_embedded_engine_args(parser)


def _add_mode_args(parser) -> None:
    g = parser.add_argument_group("mode")
    g.add_argument("--train-backend", choices=["megatron", "fsdp"], default="megatron",
                   help="Training backend: Megatron-Core (GPU) or PyTorch FSDP2 (CPU and GPU).")
    g.add_argument("--rollout-backend", choices=["sglang", "embedded"], default="sglang",
                   help="Inference engine: SGLang servers, or slime's embedded engine (CPU and GPU).")
    g.add_argument("--debug-rollout-only", action="store_true", default=False, help="Generate only; no trainer.")
    g.add_argument("--debug-train-only", action="store_true", default=False, help="Train only; no engines.")
    g.add_argument("--load-debug-rollout-data", type=str, default=None,
                   help="Path template ({rollout_id}) of saved rollout dumps to train on; implies --debug-train-only.")


def _add_cluster_args(parser) -> None:
    g = parser.add_argument_group("cluster, resources and colocation")
    g.add_argument("--actor-num-nodes", type=int, default=1, help="Nodes for the training actor.")
    g.add_argument("--actor-num-gpus-per-node", type=int, default=8,
                   help="GPUs per node for training (training processes per node on a CPU machine).")
    g.add_argument("--rollout-num-gpus", type=int, default=None,
                   help="Total GPUs for inference engines (engines on a CPU machine); 0 = router only.")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1, help="GPUs per engine (engine TP size).")
    g.add_argument("--num-gpus-per-node", type=int, default=8, help="GPUs per node used to place rollout engines.")
    g.add_argument("--colocate", action="store_true", default=False,
                   help="Training and inference share devices; implies offloading.")
    g.add_argument("--offload", action="store_true", default=False, help="Shorthand for --offload-train --offload-rollout.")
    _bool_pair(g, "offload-train", None, "Move the trainer off the device between training phases.")
    _bool_pair(g, "offload-rollout", None, "Release engine memory (weights, KV) during training.")
    g.add_argument("--distributed-backend", type=str, default="nccl",
                   help="torch.distributed backend (gloo is used automatically on CPU).")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10, help="Collective timeout.")
    g.add_argument("--release-train", action="store_true", default=False,
                   help="Destroy trainer actors during rollout (Megatron, disk weight sync).")
    g.add_argument("--train-env-vars", type=str, default="{}", help="JSON object of extra env vars for trainers.")
    g.add_argument("--cpu-only", action="store_true", default=False,
                   help="Run every component on CPU even when CUDA is present (GPU counts then mean processes).")


def _add_rollout_args(parser) -> None:
    g = parser.add_argument_group("rollout generation")
    g.add_argument("--hf-checkpoint", type=str, default=None,
                   help="HF checkpoint: engine start point and tokenizer. A GGUF file (or a directory holding one) is "
                        "dequantized once into a cached HF directory (slime.utils.gguf_model).")
    g.add_argument("--model-name", type=str, default=None, help="Model family name for weight conversion.")
    g.add_argument("--rollout-function-path", type=str, default="slime.rollout.sglang_rollout.generate_rollout",
                   help="Rollout function.")
    g.add_argument("--rollout-temperature", type=float, default=1.0, help="Sampling temperature (> 0).")
    g.add_argument("--rollout-top-p", type=float, default=1.0,
                   help="Top-p. When != 1 the engine returns each position's kept nucleus and the trainer "
                        "renormalises its log-probs over it.")
    g.add_argument("--rollout-top-k", type=int, default=-1, help="Top-k (-1 = disabled).")
    g.add_argument("--rollout-max-context-len", type=int, default=None, help="Max prompt + response length.")
    g.add_argument("--rollout-max-prompt-len", type=int, default=None, help="Drop longer prompts at load time.")
    g.add_argument("--rollout-max-response-len", type=int, default=None, help="Max new tokens per generation.")
    g.add_argument("--rollout-skip-special-tokens", action="store_true", default=False,
                   help="Detokenize without special tokens.")
    g.add_argument("--rollout-stop", type=str, nargs="+", default=None, help="Stop strings.")
    g.add_argument("--rollout-stop-token-ids", type=int, nargs="+", default=None, help="Stop token ids.")
    g.add_argument("--rollout-shuffle", action="store_true", default=False, help="Shuffle prompts each epoch.")
    g.add_argument("--rollout-seed", type=int, default=42, help="Seed for shuffling and sampling seeds.")
    g.add_argument("--over-sampling-batch-size", type=int, default=None,
                   help="Prompt groups fetched per sampling round (default: --rollout-batch-size).")
    g.add_argument("--dynamic-sampling-filter-path", type=str, default=None, help="Group filter.")
    g.add_argument("--partial-rollout", action="store_true", default=False,
                   help="Recycle unfinished groups into the data source and continue them later.")
    g.add_argument("--mask-offpolicy-in-partial-rollout", action="store_true", default=False,
                   help="Zero the loss mask of the older-policy part of a continued sample.")
    g.add_argument("--max-weight-staleness", type=int, default=None,
                   help="Fully asynchronous rollout: drop a prompt group whose oldest token was generated more "
                        "than N weight versions before the engines' current one (default: keep every group; "
                        "--use-tis corrects what is kept).")
    g.add_argument("--custom-generate-function-path", type=str, default=None, help="Per-sample generator.")
    g.add_argument("--rollout-sample-hook-path", type=str, action="append", default=[],
                   help="Post-generation sample hook; repeatable.")
    g.add_argument("--buffer-filter-path", type=str, default=None, help="Buffer filter.")
    g.add_argument("--rollout-data-postprocess-path", type=str, default=None, help="Trainer-side hook.")
    g.add_argument("--rollout-data-transport", choices=["object-store", "nixl"], default="object-store",
                   help="How rollout data travels to the trainer.")
    g.add_argument("--rollout-external-engine-addrs", type=str, nargs="+", default=None,
                   help="Pre-launched engines (host:port ...) instead of launching engines.")
    g.add_argument("--http-proxy", type=str, default=None, help="Proxy for HTTP requests to engines.")
    g.add_argument("--use-distributed-post", action="store_true", default=False,
                   help="Fan HTTP POSTs out through a pool of Ray actors.")
    g.add_argument("--use-fault-tolerance", action="store_true", default=False,
                   help="Probe every engine (GET /health_generate) while a rollout or eval runs; an engine that "
                        "hangs or dies is killed, restarted, given the current weights and put back behind the "
                        "router, and the requests that failed on it are retried. Dead engines are also restarted "
                        "before each weight update.")
    g.add_argument("--rollout-health-check-interval", type=float, default=30.0,
                   help="Seconds between two health probes of an engine (needs --use-fault-tolerance).")
    g.add_argument("--rollout-health-check-timeout", type=float, default=30.0,
                   help="Seconds an engine has to answer a health probe before it is treated as hung and "
                        "restarted (needs --use-fault-tolerance).")
    g.add_argument("--rollout-health-check-first-wait", type=float, default=0,
                   help="Seconds after an engine comes up (start or restart) before its first health probe; "
                        "raise it when engines compile or warm up slowly (needs --use-fault-tolerance).")


def _add_data_args(parser) -> None:
    g = parser.add_argument_group("data, batching and steps")
    g.add_argument("--prompt-data", type=str, default=None, help="Training prompts (.jsonl/.parquet, optional @[a:b]).")
    g.add_argument("--input-key", type=str, default="input", help="Field holding the prompt.")
    g.add_argument("--label-key", type=str, default=None, help="Field holding the label.")
    g.add_argument("--metadata-key", type=str, default="metadata", help="Field holding per-sample metadata.")
    g.add_argument("--tool-key", type=str, default="tools", help="Field holding a tool-schema list.")
    g.add_argument("--multimodal-keys", type=str, default=None, help="JSON: media type -> data field.")
    g.add_argument("--apply-chat-template", action="store_true", default=False, help="Render prompts with the chat template.")
    g.add_argument("--apply-chat-template-kwargs", type=str, default="{}", help="JSON kwargs for the chat template.")
    g.add_argument("--disable-rollout-global-dataset", dest="rollout_global_dataset", action="store_false", default=True,
                   help="Do not load --prompt-data into the built-in data source.")
    g.add_argument("--data-source-path", type=str, default="slime.rollout.data_source.RolloutDataSourceWithBuffer",
                   help="Data source class.")
    g.add_argument("--num-rollout", type=int, default=None, help="Number of rollout steps.")
    g.add_argument("--num-epoch", type=int, default=None, help="Derive --num-rollout from the dataset size.")
    g.add_argument("--start-rollout-id", type=int, default=None, help="First rollout step (default: from checkpoint).")
    g.add_argument("--rollout-batch-size", type=int, required=True, help="Prompt groups per rollout step.")
    g.add_argument("--n-samples-per-prompt", type=int, default=1, help="Responses per prompt (GRPO group size).")
    g.add_argument("--global-batch-size", type=int, default=None, help="Rollouts per optimizer step.")
    g.add_argument("--num-steps-per-rollout", type=int, default=None, help="Optimizer steps per rollout step.")
    g.add_argument("--micro-batch-size", type=int, default=1, help="Fixed micro-batch size (without dynamic batching).")
    g.add_argument("--use-dynamic-batch-size", action="store_true", default=False, help="Pack micro-batches by tokens.")
    g.add_argument("--max-tokens-per-gpu", type=int, default=None, help="Token budget per micro-batch.")
    g.add_argument("--log-probs-max-tokens-per-gpu", type=int, default=None, help="Token budget for log-prob passes.")
    g.add_argument("--balance-data", action="store_true", default=False, help="Balance tokens across DP ranks.")
    g.add_argument("--balance-by-flops", action="store_true", default=False,
                   help="Balance DP shards (implies --balance-data) and micro-batches (needs "
                        "--use-dynamic-batch-size) by each sample's "
                        "training-FLOPs estimate (attention grows with length squared, the output head with the "
                        "response) instead of its token count; --max-tokens-per-gpu still caps tokens.")
    g.add_argument("--loss-mask-type", choices=["qwen", "qwen3", "qwen3_5", "distill_qwen"], default="qwen",
                   help="Chat-format family for SFT loss masks.")
    g.add_argument("--data-pad-size-multiplier", type=int, default=128, help="Packed-sequence padding multiple.")
    g.add_argument("--rollout-sample-filter-path", type=str, default=None, help="Sets remove_sample.")
    g.add_argument("--rollout-all-samples-process-path", type=str, default=None, help="Sees all groups.")


def _add_eval_args(parser) -> None:
    g = parser.add_argument_group("evaluation")
    g.add_argument("--eval-function-path", type=str, default=None,
                   help="Eval function (default: the rollout function; the default rollout when that is the fully async one).")
    g.add_argument("--eval-interval", type=int, default=None, help="Evaluate every N rollout steps.")
    g.add_argument("--eval-prompt-data", type=str, nargs="+", default=None, help="name path [name path ...].")
    g.add_argument("--eval-config", type=str, default=None, help="YAML/JSON eval config.")
    g.add_argument("--skip-eval-before-train", action="store_true", default=False, help="No eval at step 0.")
    g.add_argument("--eval-input-key", type=str, default=None)
    g.add_argument("--eval-label-key", type=str, default=None)
    g.add_argument("--eval-tool-key", type=str, default=None)
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=1, help="Responses per eval prompt.")
    g.add_argument("--eval-temperature", type=float, default=None)
    g.add_argument("--eval-top-p", type=float, default=None)
    g.add_argument("--eval-top-k", type=int, default=None)
    g.add_argument("--eval-max-response-len", type=int, default=None)
    g.add_argument("--eval-max-prompt-len", type=int, default=None)
    g.add_argument("--eval-min-new-tokens", type=int, default=None)
    g.add_argument("--eval-max-context-len", type=int, default=None)


def _add_reward_args(parser) -> None:
    g = parser.add_argument_group("reward")
    g.add_argument("--rm-type", type=str, default=None, help="Rule reward (math, dapo, deepscaler, f1, gpqa, ...).")
    g.add_argument("--reward-key", type=str, default=None, help="Key selecting the scalar from dict rewards.")
    g.add_argument("--eval-reward-key", type=str, default=None, help="Same for eval (default: --reward-key).")
    g.add_argument("--group-rm", action="store_true", default=False, help="Reward a whole prompt group at once.")
    g.add_argument("--rm-url", type=str, default=None, help="Endpoint for remote_rm / OPD teacher.")
    g.add_argument("--custom-rm-path", type=str, default=None,
                   help="Custom reward: module.function, `async def` or plain `def` (run in a worker thread).")
    g.add_argument("--reward-timeout", type=float, default=None,
                   help="Seconds a reward may take per sample (per group with --group-rm); one that takes longer "
                        "fails its sample(s) with the reason and the run goes on. Default: no limit.")
    g.add_argument("--stop-on-failed-ratio", type=float, default=1.0,
                   help="Stop the run when this share of a training step's samples FAILED (e.g. every reward "
                        "raised), naming the first failure's reason; 1.0 stops only when every sample failed.")
    g.add_argument("--custom-reward-post-process-path", type=str, default=None, help="Hook on rewards after the reward model (signature: docs/customization.md).")
    g.add_argument("--custom-convert-samples-to-train-data-path", type=str, default=None, help="Converts samples to train data (signature: docs/customization.md).")


def _add_algorithm_args(parser) -> None:
    g = parser.add_argument_group("algorithm and loss")
    g.add_argument("--advantage-estimator", default="grpo",
                   choices=["grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"])
    g.add_argument("--loss-type", default="policy_loss", choices=["policy_loss", "sft_loss", "custom_loss"])
    g.add_argument("--custom-loss-function-path", type=str, default=None, help="Custom loss (with --loss-type custom_loss) (signature: docs/customization.md).")
    g.add_argument("--eps-clip", type=float, default=0.2)
    g.add_argument("--eps-clip-high", type=float, default=None)
    g.add_argument("--eps-clip-c", type=float, default=None, help="Dual-clip constant (> 1).")
    g.add_argument("--value-clip", type=float, default=0.2)
    g.add_argument("--kl-coef", type=float, default=0.0,
                   help="KL penalty to the reference model in the reward." + _REFERENCE_HELP)
    g.add_argument("--use-kl-loss", action="store_true", default=False,
                   help="Add a KL-to-reference term (--kl-loss-coef) to the loss." + _REFERENCE_HELP)
    g.add_argument("--kl-loss-coef", type=float, default=0.0)
    g.add_argument("--kl-loss-type", choices=["k1", "k2", "k3", "low_var_kl"], default="k1")
    g.add_argument("--use-unbiased-kl", action="store_true", default=False)
    g.add_argument("--entropy-coef", type=float, default=0.0)
    g.add_argument("--gamma", type=float, default=1.0)
    g.add_argument("--lambd", type=float, default=1.0)
    g.add_argument("--normalize-advantages", action="store_true", default=False)
    g.add_argument("--disable-grpo-std-normalization", dest="grpo_std_normalization", action="store_false", default=True)
    g.add_argument("--disable-rewards-normalization", dest="rewards_normalization", action="store_false", default=True)
    g.add_argument("--disable-compute-advantages-and-returns", dest="compute_advantages_and_returns",
                   action="store_false", default=True)
    g.add_argument("--custom-advantage-function-path", type=str, default=None, help="Custom advantage/return estimator (signature: docs/customization.md).")
    g.add_argument("--calculate-per-token-loss", action="store_true", default=False)
    g.add_argument("--use-rollout-logprobs", action="store_true", default=False)
    g.add_argument("--use-tis", action="store_true", default=False)
    g.add_argument("--true-on-policy", action="store_true", default=False,
                   help="The engine's log-prob of every sampled token equals the trainer's pi_old bit for bit: both "
                        "sides run the same batch-invariant ops (slime/backends/batch_invariant.py). Needs "
                        "--train-backend fsdp and --rollout-backend embedded, on the CPU, in fp32 or in bf16 (--embedded-engine-dtype "
                        "bfloat16 with --fsdp-mixed-precision bf16) (docs/true_on_policy.md).")
    g.add_argument("--tis-clip", type=float, default=2.0)
    g.add_argument("--tis-clip-low", type=float, default=0)
    g.add_argument("--custom-tis-function-path", type=str, default=None, help="Custom truncated-importance-sampling function (signature: docs/customization.md).")
    g.add_argument("--get-mismatch-metrics", action="store_true", default=False)
    g.add_argument("--custom-pg-loss-reducer-function-path", type=str, default=None, help="Custom policy-gradient loss reducer (signature: docs/customization.md).")
    g.add_argument("--use-opsm", action="store_true", default=False)
    g.add_argument("--opsm-delta", type=float, default=1e-4)
    g.add_argument("--use-rollout-entropy", action="store_true", default=False)
    g.add_argument("--use-routing-replay", action="store_true", default=False)
    g.add_argument("--use-rollout-routing-replay", action="store_true", default=False)
    g.add_argument("--ref-load", type=str, default=None,
                   help="Reference model checkpoint (--kl-coef, --use-kl-loss). Under --train-backend fsdp the reference is "
                        "this directory when it is an HF one (config.json), else the --hf-checkpoint weights as loaded "
                        "at start.")
    g.add_argument("--ref-ckpt-step", type=int, default=None)
    g.add_argument("--ref-update-interval", type=int, default=None)
    g.add_argument("--keep-old-actor", action="store_true", default=False,
                   help="Compute π_old with a host-memory copy of the actor from before the last update "
                        "(the policy of a one-step-off rollout in train_async.py).")
    g.add_argument("--num-critic-only-steps", type=int, default=0)
    g.add_argument("--megatron-config-path", type=str, default=None)
    g.add_argument("--reset-optimizer-states", action="store_true", default=False)
    g.add_argument("--use-stateless-adam", action="store_true", default=False)
    g.add_argument("--log-probs-chunk-size", type=int, default=-1,
                   help="Rows per chunk of the log-prob/entropy head (FSDP: -1 = 2048 rows; the [K, V] logits "
                        "are never held whole).")
    g.add_argument("--recompute-loss-function", action="store_true", default=False)


def _add_opd_args(parser) -> None:
    g = parser.add_argument_group("on-policy distillation")
    g.add_argument("--use-opd", action="store_true", default=False)
    g.add_argument("--opd-type", choices=["sglang", "megatron"], default=None)
    g.add_argument("--opd-kl-coef", type=float, default=1.0)
    g.add_argument("--opd-teacher-load", type=str, default=None)
    g.add_argument("--opd-teacher-ckpt-step", type=int, default=None)


def _add_weight_update_args(parser) -> None:
    g = parser.add_argument_group("weight update")
    g.add_argument("--update-weight-mode", choices=["full", "delta"], default="full")
    g.add_argument("--update-weight-transport", choices=["nccl", "disk"], default="nccl",
                   help="nccl: broadcast (gloo on CPU); tensor handles when colocated, and shared memory when every "
                        "engine is an embedded CPU engine on this machine (docs/loop.md); disk: HF checkpoint versions.")
    g.add_argument("--update-weight-disk-dir", type=str, default=None)
    g.add_argument("--update-weight-disk-keep-files", action="store_true", default=False)
    g.add_argument("--update-weight-delta-encoding", choices=["xor", "overwrite"], default="xor")
    g.add_argument("--update-weight-delta-checksum", choices=["xxh3-128", "blake3", "adler32"], default="xxh3-128")
    g.add_argument("--update-weight-local-checkpoint-dir", type=str, default=None)
    g.add_argument("--custom-update-weight-post-write-path", type=str, default=None, help="Runs between writing a disk weight version and loading it (signature: docs/customization.md).")
    g.add_argument("--update-weight-buffer-size", type=int, default=512 * 1024**2, help="Bucket size in bytes.")
    g.add_argument("--update-weights-interval", type=int, default=1, help="Sync every N rollout steps (async).")
    g.add_argument("--check-weight-update-equal", action="store_true", default=False)


def _add_checkpoint_args(parser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--load", type=str, default=None, help="Actor checkpoint dir (resume point).")
    g.add_argument("--save", type=str, default=None, help="Save dir.")
    g.add_argument("--overwrite-save", action="store_true", default=False,
                   help="Allow --save to be a directory holding another run's checkpoints (a --load other than "
                        "--save, or none): without it such a run is refused at start and nothing is overwritten.")
    g.add_argument("--save-interval", type=int, default=None, help="Save every N rollout steps.")
    g.add_argument("--async-save", action="store_true", default=False,
                   help="Write checkpoints in the background: the state is copied to host memory, then written "
                        "while the next step trains; the next save and the end of the run wait for it, and the "
                        "latest-checkpoint marker moves only once it is complete (--train-backend fsdp).")
    g.add_argument("--no-save-optim", action="store_true", default=False)
    g.add_argument("--no-save-rng", action="store_true", default=False)
    g.add_argument("--no-load-optim", action="store_true", default=False)
    g.add_argument("--no-load-rng", action="store_true", default=False)
    g.add_argument("--finetune", action="store_true", default=False)
    g.add_argument("--ckpt-step", type=int, default=None)
    g.add_argument("--ckpt-format", type=str, default="torch_dist")
    g.add_argument("--save-hf", type=str, default=None, help="Also save HF weights to this template ({rollout_id}).")


def _add_customization_args(parser) -> None:
    g = parser.add_argument_group("model / training customisation")
    for name in ("custom-model-provider-path", "custom-megatron-init-path",
                 "custom-megatron-before-log-prob-hook-path", "custom-megatron-before-train-step-hook-path"):
        g.add_argument(f"--{name}", type=str, default=None, help="Megatron hook (signature: docs/customization.md).")
    g.add_argument("--only-train-params-name-list", type=str, nargs="*", default=None)
    g.add_argument("--freeze-params-name-list", type=str, nargs="*", default=None)
    g.add_argument("--freeze-indexer", action="store_true", default=False)
    g.add_argument("--allgather-cp", action="store_true", default=False)
    g.add_argument("--qwen-gdn-backend", choices=["fla", "flashqla"], default="fla")
    g.add_argument("--megatron-deepgemm-forward-layers", type=int, nargs="+", default=None)
    g.add_argument("--megatron-deepgemm-forward-modules", type=str, nargs="+", default=None)
    g.add_argument("--megatron-deepgemm-moe-forward-layers", type=int, nargs="+", default=None)
    g.add_argument("--megatron-deepgemm-moe-forward-modules", type=str, nargs="+", default=None)
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="Multi-token-prediction layers (MiMo, DeepSeek-V3, GLM-4.5); the Megatron backend refuses it "
                        "at start (not built).")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.2)
    g.add_argument("--enable-mtp-training", action="store_true", default=False)
    g.add_argument("--padded-vocab-size", type=int, default=None)
    g.add_argument("--custom-config-path", type=str, default=None, help="YAML of extra/override args.")


def _add_logging_args(parser) -> None:
    g = parser.add_argument_group("logging and metrics")
    g.add_argument("--use-wandb", action="store_true", default=False)
    g.add_argument("--wandb-mode", choices=["online", "offline", "disabled"], default=None)
    for name in ("wandb-dir", "wandb-key", "wandb-host", "wandb-team", "wandb-group", "wandb-project", "wandb-run-id"):
        g.add_argument(f"--{name}", type=str, default=None)
    g.add_argument("--disable-wandb-random-suffix", dest="wandb_random_suffix", action="store_false", default=True)
    g.add_argument("--wandb-always-use-train-step", action="store_true", default=False)
    g.add_argument("--use-tensorboard", action="store_true", default=False)
    g.add_argument("--tb-project-name", type=str, default=None)
    g.add_argument("--tb-experiment-name", type=str, default=None)
    g.add_argument("--log-multi-turn", action="store_true", default=False,
                   help="Log multi_turn/* metrics: response lengths with and without tool observations, model "
                        "turns per sample.")
    g.add_argument("--log-passrate", action="store_true", default=False)
    g.add_argument("--log-reward-category", type=str, default=None,
                   help="Key of dict rewards whose value is tallied per step as rollout/error_cat/<value> "
                        "(share of samples).")
    g.add_argument("--log-correct-samples", action="store_true", default=False,
                   help="Log rollout/correct_length/p25..p100, rollout/correct_ratio and rollout/correct_entropy "
                        "of correct samples (reward exactly 1); the trainer then computes entropy in its "
                        "forward-only pass.")
    g.add_argument("--custom-rollout-log-function-path", type=str, default=None, help="Custom rollout metrics logger (signature: docs/customization.md).")
    g.add_argument("--custom-eval-rollout-log-function-path", type=str, default=None, help="Custom rollout metrics logger (signature: docs/customization.md).")
    g.add_argument("--console-log-interval", type=int, default=None,
                   help="Without a terminal (CI, a log file): print a step line every N rollout steps (default: "
                        "about 20 lines per run; the first and last step always). On a terminal a progress bar "
                        "shows every step. metrics.jsonl always has every step.")
    g.add_argument("--run-dir", type=str, default=None,
                   help="Directory for metrics.jsonl, logs and the run summary (default: runs/<timestamp>).")


def _add_debug_args(parser) -> None:
    g = parser.add_argument_group("debug, dumps and profiling")
    g.add_argument("--save-debug-rollout-data", type=str, default=None)
    g.add_argument("--save-debug-train-data", type=str, default=None)
    g.add_argument("--dump-details", type=str, default=None)
    g.add_argument("--load-debug-rollout-data-subsample", type=float, default=None)
    g.add_argument("--load-forge-rollout-data", type=str, default=None,
                   help="Dump(s) that --rollout-function-path slime.rollout.forge_load.generate_rollout replays with "
                        "the engines alive: a --save-debug-rollout-data template with {rollout_id} (a step without "
                        "its own dump replays step 0's) or one path replayed every step.")
    g.add_argument("--use-pytorch-profiler", action="store_true", default=False,
                   help="Record the torch profiler over rollout steps --profile-step-start..--profile-step-end-1 "
                        "(what: --profile-target); Chrome traces go to <run-dir>/profile/.")
    g.add_argument("--profile-target", type=str, nargs="+", default=None,
                   choices=["train_overall", "train", "train_actor", "train_log_probs", "rollout"],
                   help="What the profiler records (setting it turns --use-pytorch-profiler on; default "
                        "train_overall): a trainer rank's whole step (train_overall, alias train), its optimizer "
                        "steps (train_actor), its forward-only log-prob passes (train_log_probs), the engines "
                        "during generation (rollout).")
    g.add_argument("--profile-step-start", type=int, default=10, help="First rollout step profiled.")
    g.add_argument("--profile-step-end", type=int, default=12, help="Rollout step after the last one profiled.")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="Training ranks profiled.")
    g.add_argument("--memory-snapshot-dir", type=str, default=None,
                   help="Where --record-memory-history writes its snapshots (default: <run-dir>/memory).")
    g.add_argument("--memory-snapshot-num-steps", type=int, default=None,
                   help="Write one memory snapshot after this many rollout steps, then stop recording "
                        "(default: a snapshot after every step).")
    g.add_argument("--memory-recorder", choices=["torch", "memray"], default="torch")
    g.add_argument("--record-memory-history", action="store_true", default=False,
                   help="Record the CUDA allocator's history in every trainer rank and dump snapshots "
                        "(pytorch.org/memory_viz opens them); needs CUDA.")


def _add_rollout_buffer_args(parser) -> None:
    g = parser.add_argument_group("rollout-buffer plugin")
    g.add_argument("--rollout-buffer-url", type=str, default=None)
    g.add_argument("--fetch-trajectory-retry-times", type=int, default=-1)
    g.add_argument("--min-batch-collection-ratio", type=float, default=1)
    g.add_argument("--rollout-task-type", type=str, default="math")


def _add_ci_args(parser) -> None:
    g = parser.add_argument_group("CI guards")
    g.add_argument("--ci-test", action="store_true", default=False)
    g.add_argument("--ci-disable-kl-checker", action="store_true", default=False)
    g.add_argument("--ci-train-rollout-logprob-abs-diff-threshold", type=float, default=0.1)
    g.add_argument("--ci-save-grad-norm", type=str, default=None)
    g.add_argument("--ci-load-grad-norm", type=str, default=None)


def _add_sglang_owned_args(parser) -> None:
    g = parser.add_argument_group("SGLang / router options owned by slime")
    g.add_argument("--sglang-router-ip", type=str, default=None, help="Use an existing router at this address.")
    g.add_argument("--sglang-router-port", type=int, default=None, help="Port of that router.")
    g.add_argument("--sglang-router-request-timeout-secs", type=int, default=14400)
    g.add_argument("--sglang-server-concurrency", type=int, default=512, help="Max concurrent requests per engine.")
    g.add_argument("--prefill-num-servers", type=int, default=None)
    g.add_argument("--sglang-config", type=str, default=None)


def _add_embedded_engine_args(parser) -> None:
    g = parser.add_argument_group("embedded engine (--rollout-backend embedded)")
    g.add_argument("--embedded-engine-max-total-tokens", type=int, default=None,
                   help="KV-cache token budget per engine on CPU (GPU: sized by --sglang-mem-fraction-static).")
    g.add_argument("--embedded-engine-max-running-requests", type=int, default=None,
                   help="Max requests decoded together per engine.")
    g.add_argument("--embedded-engine-dtype", type=str, default=None,
                   help="Engine dtype (default: float32 on CPU, bfloat16 on CUDA).")


def _moe_layer_freq(text: str, flag: str = "--moe-layer-freq"):
    """Megatron's --moe-layer-freq: an int, or a list expression of 0/1 such as ``([0]*1+[1]*47)``."""
    import re

    if re.fullmatch(r"\d+", text.strip()):
        return int(text)
    if not re.fullmatch(r"[\s\d\[\]\(\)\*\+,]+", text):
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected an int or a 0/1 list like '([0]*1+[1]*47)'")
    value = eval(text, {"__builtins__": {}})  # digits, brackets, * and + only (checked above)
    if not isinstance(value, list) or any(v not in (0, 1) for v in value):
        raise argparse.ArgumentTypeError(f"{flag} {text!r} must give a list of 0/1")
    return value


def _linear_attention_freq(text: str):
    return _moe_layer_freq(text, "--linear-attention-freq")


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """Training flags spelled as Megatron names them (accepted by both backends)."""
    g = parser.add_argument_group("training (Megatron-named flags)")
    # parallelism
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true", default=False)
    g.add_argument("--use-distributed-optimizer", action="store_true", default=True)
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", type=str, nargs="*", default=None)
    # optimizer
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, default=1e-6)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"], default="constant")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--optimizer-cpu-offload", action="store_true", default=False)
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true", default=False)
    g.add_argument("--use-precision-aware-optimizer", action="store_true", default=False)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true", default=False)
    g.add_argument("--fp16", action="store_true", default=False)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true", default=False)
    g.add_argument("--attention-softmax-in-fp32", action="store_true", default=False)
    g.add_argument("--attention-backend", type=str, default="auto")
    g.add_argument("--gradient-checkpointing", action="store_true", default=False,
                   help="FSDP backend: activation checkpointing of every decoder layer.")
    # model shape (scripts/models presets); cross-checked against --hf-checkpoint by the Megatron backend
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true", default=False)
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=4096)
    g.add_argument("--position-embedding-type", type=str, default="rope")
    g.add_argument("--use-rotary-position-embeddings", action="store_true", default=False)
    g.add_argument("--rotary-base", type=float, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", default=False)
    g.add_argument("--disable-bias-linear", action="store_true", default=False)
    g.add_argument("--add-qkv-bias", action="store_true", default=False)
    g.add_argument("--qk-layernorm", action="store_true", default=False)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=False)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-router-score-function", type=str, default="softmax")
    g.add_argument("--moe-grouped-gemm", action="store_true", default=False)
    g.add_argument("--moe-token-dispatcher-type", type=str, default="allgather")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-router-load-balancing-type", type=str, default="aux_loss")
    g.add_argument("--moe-router-pre-softmax", action="store_true", default=False,
                   help="Top-k of the full softmax without renormalising (HF norm_topk_prob false).")
    g.add_argument("--moe-shared-expert-gate", action="store_true", default=False, help="Sigmoid gate on the shared expert.")
    g.add_argument("--moe-layer-freq", type=_moe_layer_freq, default=1,
                   help="Every N-th layer is MoE, or a 0/1 list per layer, e.g. '([0]*1+[1]*47)'.")
    g.add_argument("--use-rope-scaling", action="store_true", default=False, help="Llama 3.1 RoPE frequency scaling.")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="Llama 3.1 RoPE scaling factor.")
    g.add_argument("--rotary-interleaved", action="store_true", default=False,
                   help="Rotary pairs are adjacent channels (x0, x1), (x2, x3) ... instead of the two halves.")
    _add_mla_arguments(parser)
    _add_moe_router_arguments(parser)
    _add_megatron_misc_arguments(parser)
    _add_megatron_lm_arguments(parser)


def _add_megatron_lm_arguments(parser) -> None:
    """The rest of Megatron-LM's model flags (slime/utils/megatron_lm_flags.py), so upstream scripts parse.
    Default None: a TransformerConfig field is passed to Megatron-Core only when set; the others are refused
    (MEGATRON_LM_REFUSALS)."""
    from slime.utils.megatron_lm_flags import MEGATRON_LM_FLAGS

    g = parser.add_argument_group("Megatron-LM model flags (TransformerConfig fields passed to Megatron-Core when set)")
    for strings, dest, kind, type_name, nargs, choices, default, group in MEGATRON_LM_FLAGS:
        if kind in ("storetrue", "storefalse"):
            g.add_argument(*strings, dest=dest, action="store_const", const=kind == "storetrue", default=None,
                           help=f"Megatron-LM's {strings[0]} (its default: {default}).")
        else:
            g.add_argument(*strings, dest=dest, type={"int": int, "float": float}.get(type_name, str), nargs=nargs,
                           choices=choices, default=None, help=f"Megatron-LM's {strings[0]} (its default: {default}).")


def _add_mla_arguments(parser) -> None:
    g = parser.add_argument_group("multi-latent attention (DeepSeek-V3 family; Megatron-named)")
    g.add_argument("--multi-latent-attention", action="store_true", default=False,
                   help="Multi-head latent attention (Megatron-Core's MLASelfAttention).")
    g.add_argument("--q-lora-rank", type=int, default=None, help="Rank of the query's low-rank projection (None: a full q_proj).")
    g.add_argument("--kv-lora-rank", type=int, default=32, help="Rank of the compressed key/value latent.")
    g.add_argument("--qk-head-dim", type=int, default=128, help="Query/key head size without the rotary part (HF qk_nope_head_dim).")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="Rotary part of the query/key heads (HF qk_rope_head_dim).")
    g.add_argument("--v-head-dim", type=int, default=128, help="Value head size.")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                   help="YaRN context-extension factor under --multi-latent-attention (HF rope_scaling.factor); "
                        "for other models the Llama 3.1 factor of --use-rope-scaling.")
    g.add_argument("--mscale", type=float, default=1.0, help="YaRN mscale (HF rope_scaling.mscale).")
    g.add_argument("--mscale-all-dim", type=float, default=0.0, help="YaRN mscale_all_dim (HF rope_scaling.mscale_all_dim).")
    g.add_argument("--yarn-beta-fast", type=float, default=32.0,
                   help="YaRN beta_fast under --multi-latent-attention (HF rope_scaling.beta_fast; Kimi-K2 uses 1).")
    g.add_argument("--yarn-beta-slow", type=float, default=1.0,
                   help="YaRN beta_slow under --multi-latent-attention (HF rope_scaling.beta_slow).")
    g.add_argument("--yarn-original-max-position-embeddings", type=int, default=4096,
                   help="YaRN's pre-extension context under --multi-latent-attention (HF "
                        "rope_scaling.original_max_position_embeddings).")
    g.add_argument("--rope-type", choices=["rope", "yarn"], default=None,
                   help="Rotary type of --multi-latent-attention (default yarn, as Megatron; rope for configs "
                        "without rope_scaling).")


def _add_moe_router_arguments(parser) -> None:
    g = parser.add_argument_group("MoE routing (Megatron-named)")
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=None,
                   help="Dtype of the router's gating and top-k (default fp32).")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true", default=False,
                   help="Per-expert score bias used for top-k choice only (DeepSeek-V3's aux-loss-free balancing; "
                        "HF e_score_correction_bias).")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="Step of the expert-bias update from the tokens per expert.")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="Multiplies the routing weights (HF routed_scaling_factor).")
    g.add_argument("--moe-router-num-groups", type=int, default=None, help="Expert groups of group-limited routing (HF n_group).")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="Groups each token may route to (HF topk_group).")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="Tokens an expert takes (x its even share); past it tokens are dropped. None: no dropping.")
    g.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default="probs",
                   help="Which tokens an expert over capacity drops: lowest routing probability, or latest position.")
    g.add_argument("--moe-permute-fusion", action="store_true", default=False,
                   help="Transformer Engine's fused token permutation (needs transformer_engine).")
    g.add_argument("--moe-enable-deepep", action="store_true", default=False,
                   help="DeepEP all-to-all token dispatch (needs CUDA and the deep_ep package).")


def _add_megatron_misc_arguments(parser) -> None:
    g = parser.add_argument_group("Megatron kernels and model spec")
    g.add_argument("--spec", type=str, nargs="*", default=None,
                   help="'MODULE FUNCTION' (or 'MODULE.FUNCTION'): Megatron layer spec to build the decoder with; "
                        "FUNCTION(args, config, vp_stage) returning a ModuleSpec, or a ModuleSpec object.")
    g.add_argument("--apply-layernorm-1p", action="store_true", default=False,
                   help="Zero-centred norm weights (weight + 1: Qwen3.5, Qwen3-Next); checked against --hf-checkpoint; "
                        "the Megatron backend refuses it at start (not built).")
    g.add_argument("--enable-experimental", action="store_true", default=False,
                   help="Megatron-Core's experimental features (megatron.core.config.set_experimental_flag), e.g. "
                        "the fused token permutation of its MoE dispatchers under --moe-permute-fusion.")
    g.add_argument("--use-gated-attention", action="store_true", default=False,
                   help="Sigmoid gate on the attention output, from a second half of q_proj (Qwen3.5, Qwen3-Next); "
                        "checked against --hf-checkpoint; the Megatron backend refuses it at start (not built).")
    g.add_argument("--linear-attention-freq", type=_linear_attention_freq, default=None,
                   help="Every N-th layer is softmax attention, the rest gated-DeltaNet linear attention (Qwen3.5, "
                        "Qwen3-Next: 4), or a 0/1 list per layer (1: linear attention); checked against "
                        "--hf-checkpoint; the Megatron backend refuses it at start (not built).")
    g.add_argument("--post-self-attn-layernorm", action="store_true", default=False,
                   help="A norm on the attention output before the residual add (GLM-4); checked against "
                        "--hf-checkpoint.")
    g.add_argument("--post-mlp-layernorm", action="store_true", default=False,
                   help="A norm on the MLP output before the residual add (GLM-4); as --post-self-attn-layernorm.")
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None, help="FP8 training format.")
    g.add_argument("--fp8-recipe", type=str, default=None, help="FP8 scaling recipe (delayed, tensorwise, blockwise, mxfp8).")
    g.add_argument("--fp8-param-gather", action="store_true", default=False, help="Keep FP8 parameter copies.")
    g.add_argument("--deterministic-mode", action="store_true", default=False,
                   help="Bitwise reproducible runs: deterministic kernels (torch.use_deterministic_algorithms; "
                        "Megatron's deterministic_mode) and, with the embedded engine, a sampling seed per sample "
                        "(--rollout-seed and the sample's index), so two runs with one --seed give the same metrics "
                        "and checkpoints (docs/true_on_policy.md).")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_false",
                   default=True, help="Megatron: skip the NaN check of the reduced gradients.")
    # slime never enables these fusions (the local layer spec has no fused kernels, they need TE/Apex):
    # the flags ask for what always happens, so upstream scripts that pass them parse
    for name, dest in (("rope", "apply_rope_fusion"), ("masked-softmax", "masked_softmax_fusion"),
                       ("gradient-accumulation", "gradient_accumulation_fusion"), ("bias-swiglu", "bias_swiglu_fusion"),
                       ("bias-dropout", "bias_dropout_fusion"), ("bias-gelu", "bias_gelu_fusion")):
        g.add_argument(f"--no-{name}-fusion", dest=dest, action="store_false", default=False,
                       help=f"Accepted: slime never fuses {name.replace('-', ' ')} (it is off already).")


def flag_defaults(**overrides) -> argparse.Namespace:
    """Every slime and training flag at its parser default (nothing validated), with ``overrides`` set: the
    ``args`` of code that runs outside a run's command line (a model layout check, a bench)."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_slime_arguments(parser)
    add_training_arguments(parser)
    args = argparse.Namespace(**{a.dest: a.default for a in parser._actions if a.dest != "help"})
    vars(args).update(overrides)
    return args
