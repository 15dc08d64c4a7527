"""Set-up of the Megatron-Core backend: per-role flag overrides, refusals, parallel state, model,
DDP wrapper, distributed optimizer and its lr schedule."""

from __future__ import annotations

import copy

import torch

from slime.backends.megatron_utils import model as mm
from slime.backends.training.backend import apply_freeze_lists
from slime.utils.misc import load_function

__all__ = ["apply_megatron_config", "refuse_unsupported", "init_parallel_state", "build_model", "wrap_ddp",
           "build_optimizer"]


def apply_megatron_config(args, role: str):
    """``--megatron-config-path`` YAML: ``{actor: {flag: value}, critic: {...}}`` (argparse names,
    dashes or underscores) applied to a copy of ``args`` for ``role``; unknown flags are errors."""
    path = args.megatron_config_path
    if not path:
        return args
    import yaml

    with open(path) as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict) or not set(config) <= {"actor", "critic"}:
        raise ValueError(f"--megatron-config-path {path}: expected a mapping with 'actor' and/or 'critic' sections, got {list(config) if isinstance(config, dict) else type(config).__name__}")
    args = copy.copy(args)
    for key, value in (config.get(role) or {}).items():
        dest = key.lstrip("-").replace("-", "_")
        if not hasattr(args, dest):
            raise ValueError(f"--megatron-config-path {path}: {role}.{key} is not a flag")
        setattr(args, dest, value)
    return args


#: the flags of Qwen3.5 / Qwen3-Next layers (gated attention, gated-DeltaNet, zero-centred norms): they parse (upstream
#: scripts pass them) and this backend, which does not build those layers, refuses them when it starts
HYBRID_LAYER_FLAGS = (("--use-gated-attention", "use_gated_attention"), ("--attention-output-gate", "attention_output_gate"),
                      ("--experimental-attention-variant", "experimental_attention_variant"),
                      ("--linear-attention-freq", "linear_attention_freq"), ("--apply-layernorm-1p", "apply_layernorm_1p"),
                      ("--linear-conv-kernel-dim", "linear_conv_kernel_dim"),
                      ("--linear-key-head-dim", "linear_key_head_dim"), ("--linear-value-head-dim", "linear_value_head_dim"),
                      ("--linear-num-key-heads", "linear_num_key_heads"),
                      ("--linear-num-value-heads", "linear_num_value_heads"))


def refuse_unsupported(args) -> None:
    """What this backend does not implement (yet): fail at start, naming the flags."""
    cp = args.context_parallel_size > 1
    refused = {
        "--context-parallel-size > 1 with --loss-type custom_loss (the custom loss reads every position's logits; "
        "under CP each rank holds a part of each sample)": cp and args.loss_type == "custom_loss",
        "--context-parallel-size > 1 with MoE routing replay (the replayed experts are laid out per sample, not per "
        "CP chunk)": cp and (args.use_routing_replay or args.use_rollout_routing_replay),
        "--context-parallel-size > 1 with --sequence-parallel (not combined yet; CP runs on the local layer spec)":
            cp and args.sequence_parallel and args.tensor_model_parallel_size > 1,
        f"--virtual-pipeline-model-parallel-size {args.virtual_pipeline_model_parallel_size} "
        f"(the trainer builds one model chunk per stage)": (args.virtual_pipeline_model_parallel_size or 1) > 1,
        f"--rollout-top-p {args.rollout_top_p} (log-probs renormalised over the engine's nucleus: "
        f"--train-backend fsdp only)": args.rollout_top_p != 1.0,
        "--keep-old-actor (--train-backend fsdp only)": args.keep_old_actor,
        "--multimodal-keys / --freeze-vision-tower (vision-language models train with --train-backend fsdp)":
            bool(args.multimodal_keys) or args.freeze_vision_tower,
        "--sequence-parallel without Transformer Engine or Apex (Megatron-Core's local layer spec then norms "
        "with torch modules that do not support it; drop --sequence-parallel or install transformer_engine)":
            args.sequence_parallel and args.tensor_model_parallel_size > 1 and not mm.have_sequence_parallel_norm(),
    }
    refused.update({
        "--moe-permute-fusion without Transformer Engine (the fused permutation is a TE kernel; drop the flag or "
        "install transformer_engine)": args.moe_permute_fusion and not mm.have_transformer_engine(),
        "--moe-enable-deepep without CUDA and the deep_ep package (DeepEP's all-to-all; drop the flag to dispatch "
        "with --moe-token-dispatcher-type)": args.moe_enable_deepep and not mm.have_deepep(),
        "--rotary-interleaved with --multi-latent-attention (Megatron-Core's MLA rotates the two halves)":
            args.rotary_interleaved and args.multi_latent_attention,
    })
    from slime.backends.megatron_utils.model_config import NOT_BUILT_BY_MEGATRON

    hybrid = [flag for flag, dest in HYBRID_LAYER_FLAGS if getattr(args, dest, None) not in (None, False)]
    variant = args.experimental_attention_variant
    refused.update({
        f"{' / '.join(hybrid)} ({NOT_BUILT_BY_MEGATRON['qwen3_5']})": bool(hybrid) and variant != "dsa",
        "--experimental-attention-variant dsa (DSA sparse attention, GLM-5 / DeepSeek-V3.2: no HF weight mapping; use "
        "a softmax-attention model)": variant == "dsa",
        f"--mtp-num-layers {args.mtp_num_layers} (multi-token-prediction layers: the HF weight "
        "mapping has none, so they would start untrained and be saved over the checkpoint's; drop the flag, the main "
        "model trains as usual)": args.mtp_num_layers not in (None, 0),
        "--post-self-attn-layernorm without --post-mlp-layernorm or the reverse (GLM-4 has both; the layer is built "
        "with both)": args.post_self_attn_layernorm != args.post_mlp_layernorm,
    })
    names = [name for name, active in refused.items() if active]
    if names:
        raise NotImplementedError(f"--train-backend megatron does not support {'; '.join(names)}")


def init_parallel_state(args) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size or 1,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
        )
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(args.seed)


def build_model(args, role: str, device, weights_dir: str, trainable: bool):
    """This stage's GPTModel (``--custom-model-provider-path`` or :func:`~.model.model_provider`); the
    critic's output layer is a value head. Frozen models are returned in eval mode."""
    from megatron.core import parallel_state as ps

    path = args.custom_model_provider_path
    pre, post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    if path:
        model = load_function(path)(pre_process=pre, post_process=post)
    else:
        model = mm.model_provider(args, pre_process=pre, post_process=post)
    if role == "critic":
        mm.attach_value_head(model, weights_dir, args.seed)
    model.to(device)
    if not trainable:
        model.requires_grad_(False)
        return model.eval()
    apply_freeze_lists(model, args)
    return model


def wrap_ddp(model, check_for_nan: bool = True):
    """Megatron DDP; ``check_for_nan`` (off with ``--no-check-for-nan-in-loss-and-grad``) raises when a
    reduced gradient bucket holds a NaN."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True,
        bucket_size=None, average_in_collective=False, check_for_nan_in_grad=check_for_nan,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_optimizer(args, ddp_model, lr: float):
    """Megatron's distributed optimizer and ``OptimizerParamScheduler`` over the run's optimizer steps."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(
        optimizer=args.optimizer, lr=lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        use_distributed_optimizer=True, params_dtype=torch.float32, bf16=False,
        optimizer_cpu_offload=args.optimizer_cpu_offload,
        overlap_cpu_optimizer_d2h_h2d=args.overlap_cpu_optimizer_d2h_h2d,
        use_precision_aware_optimizer=args.use_precision_aware_optimizer,
    )
    optimizer = get_megatron_optimizer(config, [ddp_model])
    steps_per_rollout = max(args.rollout_batch_size * args.n_samples_per_prompt // max(args.global_batch_size, 1), 1)
    total = (args.num_rollout or 1) * steps_per_rollout
    warmup = args.lr_warmup_iters if not args.lr_warmup_fraction else int(args.lr_warmup_fraction * total)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=lr, min_lr=args.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=args.lr_decay_iters or total, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=total, wd_incr_style="constant",
    )
    return optimizer, scheduler
