"""slime's command line: ``parse_args()`` builds the one ``args`` namespace every component and hook sees.

Pipeline (docs/INTERFACES.md §4.1):
1. pre-parse the mode flags (``--train-backend``, ``--debug-*``, ``--load-debug-rollout-data``);
2. SGLang-side flags: slime's own (§4.3.16), every SGLang ``ServerArgs`` flag as ``--sglang-<flag>``
   when SGLang is importable (otherwise unknown ``--sglang-*`` values are kept verbatim for
   forwarding), every router flag as ``--router-<flag>`` (read from the installed smg/sglang-router);
3. slime's own flags and the Megatron-named training flags the seed's scripts use;
4. ``validate_args()`` — the cross-field rules of §4.4 in one place.

Unknown flags fail with the closest valid spelling.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import logging
import os
import sys

from slime.utils.arguments_groups import REFUSED_FLAGS, add_slime_arguments, add_training_arguments, mark_refused_flags
from slime.utils.backend_flags import FSDP_ONLY, MEGATRON_ONLY, refuse_other_backend_flags
from slime.utils.exactness import validate_exactness
from slime.utils.passthrough import (PassThrough, add_router_arguments, add_sglang_arguments, owned_flag_message,
                                     rename_legacy_sglang_flags, sglang_value)

logger = logging.getLogger(__name__)

#: attributes the run sets on ``args`` once it is under way (the engines it started, the job's choices), with
#: the value every reader sees before that
RUN_ATTRIBUTES = {"rollout_engine_urls": None, "rollout_num_engines": None, "sglang_model_routers": None,
                  "rollout_overlaps_training": False}

__all__ = ["parse_args", "validate_args", "slime_validate_args", "get_parser"]


def _pre_parse(argv: list[str]) -> argparse.Namespace:
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--train-backend", choices=["megatron", "fsdp"], default="megatron")
    pre.add_argument("--rollout-backend", choices=["sglang", "embedded"], default="sglang")
    pre.add_argument("--debug-rollout-only", action="store_true", default=False)
    pre.add_argument("--debug-train-only", action="store_true", default=False)
    pre.add_argument("--load-debug-rollout-data", type=str, default=None)
    known, _ = pre.parse_known_args(argv)
    return known


def get_parser(add_custom_arguments=None, *, parse_sglang: bool = True) -> tuple[argparse.ArgumentParser, PassThrough]:
    """The full parser (slime + training + SGLang/router pass-through) and the pass-through state."""
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="slime: RL post-training. See docs/usage.md for the flag groups.",
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        usage="%(prog)s --rollout-batch-size N (--num-rollout N | --num-epoch N) [flags]  (--help lists them; docs/usage.md groups them)",
    )
    if add_custom_arguments is not None:
        parser = add_custom_arguments(parser) or parser
    add_slime_arguments(parser)
    add_training_arguments(parser)
    from slime.backends.fsdp_utils.arguments import add_fsdp_arguments

    add_fsdp_arguments(parser)
    mark_refused_flags(parser)
    passthrough = PassThrough()
    if parse_sglang:
        add_sglang_arguments(parser, passthrough)
        add_router_arguments(parser, passthrough)
    return parser, passthrough


def parse_args(args_list: list[str] | None = None, add_custom_arguments=None) -> argparse.Namespace:
    """Parse slime's command line (``sys.argv[1:]`` when ``args_list`` is None) and validate it.

    ``add_custom_arguments``: a callable ``(parser) -> parser`` registering extra flags for hooks.
    """
    argv = list(sys.argv[1:] if args_list is None else args_list)
    mode = _pre_parse(argv)
    skip_sglang = mode.debug_train_only or mode.load_debug_rollout_data is not None
    parser, passthrough = get_parser(add_custom_arguments, parse_sglang=True)
    argv = rename_legacy_sglang_flags(argv, passthrough.sglang_flags if passthrough.sglang_introspected else None)
    args, unknown = parser.parse_known_args(argv)
    leftover = passthrough.absorb_unknown(unknown, args)
    if leftover:
        _fail_unknown(parser, leftover)
    args.sglang_passthrough = passthrough.forwarded(args)
    args.router_passthrough = passthrough.router_forwarded(args)
    args.sglang_server_fields = passthrough.server_fields()
    if skip_sglang:
        args.sglang_passthrough = {}
    validate_args(args)
    return args


def _fail_unknown(parser: argparse.ArgumentParser, leftover: list[str]) -> None:
    valid = [opt for action in parser._actions for opt in action.option_strings]
    messages = []
    previous_was_flag = False
    for token in leftover:
        if not token.startswith("-"):
            if not previous_was_flag:  # a value after an unknown flag belongs to it
                messages.append(f"unexpected value {token!r}")
            continue
        previous_was_flag = True
        name = token.split("=", 1)[0]
        owned = owned_flag_message(name)
        if owned:
            messages.append(owned)
            continue
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        messages.append(f"unknown flag {name}{hint}")
    parser.error("; ".join(messages))


# --------------------------------------------------------------------------- validation (§4.4)


@functools.lru_cache(maxsize=1)
def _flags_and_defaults() -> dict[str, tuple[str, object]]:
    parser, _ = get_parser(parse_sglang=False)
    return {a.dest: (a.option_strings[0], a.default) for a in parser._actions if a.option_strings and a.dest != "help"}


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Apply docs/INTERFACES.md §4.4 in order: raise naming the flags involved; fill documented derived
    values; never override a value the user set explicitly."""
    from slime.utils.eval_config import resolve_eval_datasets
    from slime.utils.flag_checks import check_flag_values, check_load_and_save

    # 0. flags slime accepts for upstream scripts but does not implement; counts and intervals in range
    _refuse_unimplemented(args)
    check_flag_values(args)
    refuse_other_backend_flags(args, _flags_and_defaults())  # before the derived values below (e.g. --finetune from --ref-load)
    _resolve_gguf_checkpoints(args)
    _validate_model_shape_flags(args)
    # 1. eval datasets; prompt files exist
    resolve_eval_datasets(args)
    _check_prompt_files(args)
    # 2. temperature
    if args.rollout_temperature <= 0:
        raise ValueError(
            f"--rollout-temperature must be > 0 (got {args.rollout_temperature}); greedy decoding is not a valid "
            f"RL policy. Use --eval-temperature for greedy evaluation."
        )
    # 3. KL needs a reference model
    if args.kl_coef != 0 or args.use_kl_loss:
        ref = args.ref_load or (args.hf_checkpoint if args.train_backend == "fsdp" else None)
        if ref is None:
            raise ValueError("--kl-coef != 0 or --use-kl-loss needs a reference model: set --ref-load")
        if not os.path.exists(ref):
            raise FileNotFoundError(f"--ref-load {ref!r} does not exist (needed by --kl-coef/--use-kl-loss)")
        if args.ref_load is not None and not os.path.exists(os.path.join(args.ref_load, "latest_checkpointed_iteration.txt")):
            logger.info("--ref-load %s has no latest_checkpointed_iteration.txt; loading it as a plain checkpoint", args.ref_load)
    # 4. on-policy distillation
    _validate_opd(args)
    # 5. load resolution (a --load that does not exist, a --save of another run: refused first)
    check_load_and_save(args)
    _resolve_load(args)
    # 6.-7.
    if args.eval_interval is not None and not args.eval_datasets:
        raise ValueError("--eval-interval needs at least one eval dataset (--eval-prompt-data or --eval-config)")
    if args.async_save and args.train_backend == "megatron":
        raise ValueError("--async-save is implemented for --train-backend fsdp; Megatron checkpoints are written "
                         "synchronously: drop --async-save")
    if args.save_interval is not None and not args.save:
        raise ValueError("--save-interval needs --save (the directory checkpoints are written to)")
    # 8.-11.
    if args.kl_coef != 0 and args.kl_loss_coef != 0:
        raise ValueError(
            f"--kl-coef ({args.kl_coef}) and --kl-loss-coef ({args.kl_loss_coef}) cannot both be non-zero: "
            f"choose KL in the reward or KL in the loss"
        )
    if args.advantage_estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline") and not args.normalize_advantages:
        raise ValueError(f"--advantage-estimator {args.advantage_estimator} requires --normalize-advantages")
    if args.max_weight_staleness is not None and args.max_weight_staleness < 0:
        raise ValueError(f"--max-weight-staleness must be >= 0 weight versions (got {args.max_weight_staleness})")
    if args.use_rollout_logprobs and args.use_tis:
        raise ValueError("--use-rollout-logprobs and --use-tis are mutually exclusive")
    if args.get_mismatch_metrics and not args.custom_tis_function_path:
        raise ValueError("--get-mismatch-metrics requires --custom-tis-function-path")
    # 12.-13.
    if args.use_dynamic_batch_size and args.max_tokens_per_gpu is None:
        raise ValueError("--use-dynamic-batch-size requires --max-tokens-per-gpu")
    if (args.context_parallel_size or 1) > 1 and args.train_backend != "megatron":
        raise ValueError(f"--context-parallel-size {args.context_parallel_size} needs --train-backend megatron "
                         f"(the FSDP backend has no context parallelism)")
    if args.balance_by_flops:
        if not args.use_dynamic_batch_size:
            raise ValueError("--balance-by-flops balances the micro-batches that dynamic batching packs: add "
                             "--use-dynamic-batch-size --max-tokens-per-gpu N")
        args.balance_data = True
    if args.log_probs_max_tokens_per_gpu is None:
        args.log_probs_max_tokens_per_gpu = args.max_tokens_per_gpu
    # 14.-15.
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    if args.advantage_estimator == "cispo" and args.eps_clip < 1:
        logger.warning("cispo with --eps-clip %s < 1: the canonical setting is --eps-clip 1.0 --eps-clip-high 4.0", args.eps_clip)
    if args.eps_clip_c is not None and args.eps_clip_c <= 1:
        raise ValueError(f"--eps-clip-c must be > 1 (got {args.eps_clip_c})")
    if args.eval_reward_key is None:
        args.eval_reward_key = args.reward_key
    # 16.-17. dumps
    if args.dump_details is not None:
        args.save_debug_rollout_data = os.path.join(args.dump_details, "rollout_data", "{rollout_id}.pt")
        args.save_debug_train_data = os.path.join(args.dump_details, "train_data", "{rollout_id}.pt")
    if args.save_debug_train_data is not None and args.save_debug_train_data == args.save_debug_rollout_data:
        raise ValueError("--save-debug-train-data must not be equal to --save-debug-rollout-data")
    if args.load_debug_rollout_data is not None:
        args.debug_train_only = True
    # 18.-19.
    args.rollout_external = args.rollout_external_engine_addrs is not None
    args.use_critic = args.advantage_estimator == "ppo"
    args.critic_num_nodes = args.actor_num_nodes
    args.critic_num_gpus_per_node = args.actor_num_gpus_per_node
    # 20.-24. offload / colocate / debug modes
    _resolve_placement(args)
    # 25.-28.
    if args.eval_function_path is None:
        # the fully async rollout does not evaluate: its runs evaluate with the default rollout
        fully_async = args.rollout_function_path == "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
        args.eval_function_path = ("slime.rollout.sglang_rollout.generate_rollout" if fully_async
                                   else args.rollout_function_path)
    _resolve_batch_sizes(args)
    if args.n_samples_per_prompt == 1:
        args.grpo_std_normalization = False
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = args.rollout_batch_size
    if args.over_sampling_batch_size < args.rollout_batch_size:
        raise ValueError(
            f"--over-sampling-batch-size ({args.over_sampling_batch_size}) must be >= --rollout-batch-size "
            f"({args.rollout_batch_size})"
        )
    # 29.
    if args.num_rollout is None and args.num_epoch is None:
        raise ValueError("either --num-rollout or --num-epoch is required")
    if args.num_rollout is not None and args.num_epoch is not None:
        logger.warning("--num-rollout %s given: --num-epoch %s is ignored", args.num_rollout, args.num_epoch)
    if args.num_rollout is None and not args.rollout_global_dataset:
        raise ValueError("--num-epoch needs the global dataset (do not pass --disable-rollout-global-dataset)")
    # 30.-31.
    if args.enable_mtp_training and args.mtp_num_layers is None:
        raise ValueError("--enable-mtp-training requires --mtp-num-layers")
    if args.use_rollout_routing_replay:
        args.use_routing_replay = True
    # 32. custom config overrides
    if args.custom_config_path is not None:
        _apply_custom_config(args)
        _refuse_unimplemented(args)  # the YAML may set a refused flag's attribute too
    # 33.
    if args.eval_max_context_len is None:
        args.eval_max_context_len = args.rollout_max_context_len
    if args.rollout_max_context_len is not None:
        if args.rollout_max_prompt_len is None:
            args.rollout_max_prompt_len = args.rollout_max_context_len - 1
        if args.rollout_max_prompt_len > args.rollout_max_context_len - 1:
            raise ValueError(
                f"--rollout-max-prompt-len ({args.rollout_max_prompt_len}) must be <= --rollout-max-context-len - 1 "
                f"({args.rollout_max_context_len - 1})"
            )
    # 34.-37.
    if args.only_train_params_name_list and args.freeze_params_name_list:
        raise ValueError("--only-train-params-name-list and --freeze-params-name-list are mutually exclusive")
    _validate_weight_update(args)
    _validate_health_check(args)
    _validate_observability(args)
    _validate_sglang_side(args)
    validate_exactness(args)
    _validate_backends(args)
    _parse_json_flags(args)
    args.rank = 0
    args.world_size = args.actor_num_nodes * args.actor_num_gpus_per_node
    for name, default in RUN_ATTRIBUTES.items():
        vars(args).setdefault(name, default)
    return args


slime_validate_args = validate_args


@functools.lru_cache(maxsize=1)
def refused_flag_defaults() -> dict[str, tuple[str, object]]:
    """``dest -> (flag, default)`` of every flag in ``REFUSED_FLAGS``."""
    parser, _ = get_parser(parse_sglang=False)
    result = {}
    for action in parser._actions:
        flag = next((o for o in action.option_strings if o in REFUSED_FLAGS), None)
        if flag is not None:
            result[action.dest] = (flag, action.default)
    return result


def _refuse_unimplemented(args) -> None:
    """A flag slime accepts only so upstream scripts parse fails when set away from its default."""
    refused = []
    for dest, (flag, default) in refused_flag_defaults().items():
        value = getattr(args, dest, default)
        if value != default:
            refused.append(f"{flag} {value!r} is not implemented by slime ({REFUSED_FLAGS[flag]})")
    if refused:
        raise ValueError("; ".join(refused) + ". Remove these flags or leave them at their defaults.")


def _validate_model_shape_flags(args) -> None:
    """Megatron model flags that contradict each other (the HF config is compared later, per backend)."""
    from slime.utils.arguments_groups import megatron_lm_passthrough_dests

    megatron_only = [d for d in megatron_lm_passthrough_dests() if getattr(args, d, None) is not None]
    if megatron_only and args.train_backend != "megatron":
        flags = ", ".join("--" + d.replace("_", "-") for d in megatron_only)
        raise ValueError(f"{flags}: Megatron-Core TransformerConfig fields, used only with --train-backend megatron "
                         f"(got --train-backend {args.train_backend})")
    mla = args.multi_latent_attention
    if not mla and args.rotary_scaling_factor != 1.0 and args.rope_scaling_factor not in (8.0, args.rotary_scaling_factor):
        raise ValueError(f"--rotary-scaling-factor {args.rotary_scaling_factor} and --rope-scaling-factor "
                         f"{args.rope_scaling_factor} both give the Llama 3.1 RoPE factor; pass one")
    if args.moe_router_group_topk and not args.moe_router_num_groups:
        raise ValueError(f"--moe-router-group-topk {args.moe_router_group_topk} needs --moe-router-num-groups")
    if args.moe_router_enable_expert_bias and args.moe_router_score_function not in ("sigmoid", "sqrtsoftplus"):
        raise ValueError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (or sqrtsoftplus), "
                         f"got {args.moe_router_score_function}")
    if args.moe_enable_deepep and args.train_backend == "megatron":
        import importlib.util

        import torch

        if not torch.cuda.is_available() or importlib.util.find_spec("deep_ep") is None:
            raise ValueError("--moe-enable-deepep needs CUDA GPUs and the deep_ep package (DeepEP), which this "
                             "machine lacks; drop the flag (tokens are then dispatched by --moe-token-dispatcher-type)")
    if not mla and any(getattr(args, d) != v for d, v in (("q_lora_rank", None), ("rope_type", None))):
        raise ValueError("--q-lora-rank / --rope-type describe multi-latent attention: pass --multi-latent-attention too")


def _check_prompt_files(args) -> None:
    """A prompt file that does not exist fails here, not at the first rollout (or first eval)."""
    from slime.utils.data import _parse_path_slice

    if args.debug_train_only or args.load_debug_rollout_data is not None:
        return  # no prompts are read
    paths = []
    if args.prompt_data and args.rollout_global_dataset:
        paths.append(("--prompt-data", args.prompt_data))
    flag = "--eval-config" if args.eval_config is not None else "--eval-prompt-data"
    paths += [(f"{flag} ({config.name})", config.path) for config in args.eval_datasets]
    for flag, path in paths:
        file_path = _parse_path_slice(path)[0]
        if not os.path.isfile(file_path):
            raise FileNotFoundError(f"{flag}: prompt file {file_path!r} does not exist (resolved from "
                                    f"{os.getcwd()!r}); give an existing .jsonl or .parquet file")


def _validate_observability(args) -> None:
    """--profile-target turns the profiler on; a step range that profiles nothing, or memory history
    without CUDA, fails here instead of silently producing no files."""
    if args.console_log_interval is not None and args.console_log_interval < 1:
        raise ValueError(f"--console-log-interval must be >= 1, got {args.console_log_interval}")
    if args.profile_target:
        args.use_pytorch_profiler = True
    if args.use_pytorch_profiler:
        args.profile_target = args.profile_target or ["train_overall"]
        if args.profile_step_end <= args.profile_step_start:
            raise ValueError(f"--profile-step-end ({args.profile_step_end}) must be > --profile-step-start "
                             f"({args.profile_step_start}): rollout steps start <= id < end are profiled")
        first = args.start_rollout_id or 0
        if args.num_rollout is not None and not first <= args.profile_step_start < args.num_rollout:
            raise ValueError(f"--profile-step-start {args.profile_step_start} is outside the run's rollout steps "
                             f"({first}..{args.num_rollout - 1}, --num-rollout {args.num_rollout}): nothing would be "
                             "profiled; lower --profile-step-start/--profile-step-end")
    if args.memory_snapshot_num_steps is not None and args.memory_snapshot_num_steps < 1:
        raise ValueError(f"--memory-snapshot-num-steps must be >= 1, got {args.memory_snapshot_num_steps}")
    if args.record_memory_history:
        import torch

        if args.cpu_only or not torch.cuda.is_available():
            raise ValueError("--record-memory-history records the CUDA allocator and needs a GPU "
                             f"({'--cpu-only is set' if args.cpu_only else 'torch sees no CUDA device'}); "
                             "drop the flag on CPU (--use-pytorch-profiler works there)")


def _validate_opd(args) -> None:
    if args.use_opd and args.opd_type is None:
        raise ValueError("--use-opd requires --opd-type {sglang,megatron}")
    if args.use_opd and args.opd_type == "megatron":
        if args.opd_teacher_load is None or not os.path.exists(args.opd_teacher_load):
            raise FileNotFoundError(f"--opd-type megatron needs an existing --opd-teacher-load (got {args.opd_teacher_load!r})")
    if args.use_opd and args.opd_type == "sglang" and args.opd_teacher_load is not None:
        raise ValueError("--opd-type sglang takes teacher log-probs from --rm-url; do not set --opd-teacher-load")
    if (args.use_opd and args.opd_type == "sglang" and not args.rm_url
            and args.custom_rm_path == "slime.rollout.on_policy_distillation.reward_func"):
        raise ValueError("--opd-type sglang with --custom-rm-path slime.rollout.on_policy_distillation.reward_func "
                         "needs --rm-url: the teacher engine's /generate URL")
    if not args.use_opd and args.opd_teacher_load is not None:
        raise ValueError("--opd-teacher-load is set but --use-opd is not")


def _resolve_gguf_checkpoints(args) -> None:
    """A GGUF file (or a directory holding one) given as an HF checkpoint becomes its cached, dequantized HF
    directory here, so every later reader (trainer, engine, Megatron) sees an HF directory."""
    from slime.utils.gguf_model import resolve_hf_checkpoint

    args.hf_checkpoint = resolve_hf_checkpoint(args.hf_checkpoint, "--hf-checkpoint")
    args.ref_load = resolve_hf_checkpoint(args.ref_load, "--ref-load")
    if args.critic_hf_checkpoint:
        args.critic_hf_checkpoint = resolve_hf_checkpoint(args.critic_hf_checkpoint, "--critic-hf-checkpoint")


def _is_hf_dir(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "config.json"))


def _resolve_load(args) -> None:
    """§4.4 rule 5. A ``--load`` directory without ``latest_checkpointed_iteration.txt`` holds no
    checkpoint yet: the actor starts from ``--ref-load`` (or, for FSDP, ``--hf-checkpoint``) without
    optimizer/RNG state, and the run starts at rollout 0 unless ``--start-rollout-id`` says otherwise.
    With a checkpoint, ``start_rollout_id`` stays None and is read from the checkpoint at start-up."""
    if args.load is not None and os.path.isfile(os.path.join(args.load, "latest_checkpointed_iteration.txt")):
        return
    if args.load is not None or args.ref_load is not None:
        args.no_load_optim = args.no_load_rng = args.finetune = True
        if not _is_hf_dir(args.load):
            args.load = args.ref_load
        if args.ref_ckpt_step is not None:
            args.ckpt_step = args.ref_ckpt_step
    if args.start_rollout_id is None:
        args.start_rollout_id = 0


def _resolve_placement(args) -> None:
    if args.offload:
        args.offload_train = True if args.offload_train is None else args.offload_train
        args.offload_rollout = True if args.offload_rollout is None else args.offload_rollout
    del args.offload
    if args.debug_rollout_only and args.debug_train_only:
        raise ValueError("--debug-rollout-only and --debug-train-only cannot be combined")
    if args.debug_rollout_only:
        if args.rollout_external:
            pass
        elif args.colocate and args.rollout_num_gpus is None:
            args.rollout_num_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
        elif args.rollout_num_gpus == 0:
            args.actor_num_gpus_per_node = 0
        elif args.rollout_num_gpus:
            args.actor_num_gpus_per_node = min(8, args.rollout_num_gpus)
            args.actor_num_nodes = max(1, args.rollout_num_gpus // args.actor_num_gpus_per_node)
        args.colocate = False
        args.offload_train = args.offload_rollout = False
    # Colocated with neither offload flag given: offload (the documented default) until the first
    # training step has measured that trainer and engines fit on the device together (slime.ray.job).
    args.offload_auto = bool(args.colocate and not args.release_train and not args.use_critic
                             and args.offload_train is None and args.offload_rollout is None)
    if args.colocate:
        if args.release_train:
            args.offload_train, args.offload_rollout = False, True
        else:
            args.offload_train = True if args.offload_train is None else args.offload_train
            args.offload_rollout = True if args.offload_rollout is None else args.offload_rollout
        if args.rollout_num_gpus is None:
            args.rollout_num_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
    args.offload_train = bool(args.offload_train)
    args.offload_rollout = bool(args.offload_rollout)
    if args.use_critic:
        args.offload_train = True if args.colocate else args.offload_train
    if args.offload_train:
        args.disable_grad_buffers_cpu_backup = True
        args.disable_param_buffers_cpu_backup = True


def _resolve_batch_sizes(args) -> None:
    total = args.rollout_batch_size * args.n_samples_per_prompt
    if args.num_steps_per_rollout is not None:
        if args.num_steps_per_rollout <= 0:
            raise ValueError(f"--num-steps-per-rollout must be > 0 (got {args.num_steps_per_rollout})")
        derived = total // args.num_steps_per_rollout
        if derived == 0:
            raise ValueError(
                f"--num-steps-per-rollout {args.num_steps_per_rollout} exceeds --rollout-batch-size x "
                f"--n-samples-per-prompt = {total}"
            )
        if args.global_batch_size is not None and args.global_batch_size != derived:
            raise ValueError(
                f"--global-batch-size {args.global_batch_size} disagrees with --rollout-batch-size "
                f"{args.rollout_batch_size} x --n-samples-per-prompt {args.n_samples_per_prompt} / "
                f"--num-steps-per-rollout {args.num_steps_per_rollout} = {derived}"
            )
        args.global_batch_size = derived
    elif args.global_batch_size is None:
        args.global_batch_size = total  # one optimizer step per rollout
    if args.global_batch_size > total:
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is larger than the rollouts of one step "
            f"(--rollout-batch-size x --n-samples-per-prompt = {total}): no optimizer step could run"
        )


def _apply_custom_config(args) -> None:
    import yaml

    path = args.custom_config_path
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--custom-config-path {path!r} does not exist")
    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise ValueError(f"--custom-config-path {path}: expected a YAML mapping, got {type(values).__name__}")
    for key, value in values.items():
        setattr(args, key, value)


def _validate_health_check(args) -> None:
    """The rollout health monitor's settings only mean something with --use-fault-tolerance."""
    defaults = {"rollout_health_check_interval": 30.0, "rollout_health_check_timeout": 30.0,
                "rollout_health_check_first_wait": 0}
    changed = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k, v in defaults.items() if getattr(args, k) != v]
    if changed and not args.use_fault_tolerance:
        raise ValueError(f"{', '.join(changed)}: the rollout health monitor runs only with --use-fault-tolerance; "
                         f"add it, or drop these flags")
    if args.rollout_health_check_interval <= 0 or args.rollout_health_check_timeout <= 0:
        raise ValueError(f"--rollout-health-check-interval ({args.rollout_health_check_interval}) and "
                         f"--rollout-health-check-timeout ({args.rollout_health_check_timeout}) must be > 0")
    if args.rollout_health_check_first_wait < 0:
        raise ValueError(f"--rollout-health-check-first-wait must be >= 0 (got {args.rollout_health_check_first_wait})")


def _validate_weight_update(args) -> None:
    if args.update_weight_transport == "disk" and not args.update_weight_disk_dir:
        raise ValueError("--update-weight-transport disk requires --update-weight-disk-dir")
    if args.release_train:
        if args.train_backend != "megatron":
            raise ValueError("--release-train is only supported with --train-backend megatron")
        if args.use_critic or args.keep_old_actor:
            raise ValueError("--release-train cannot be combined with a critic (ppo) or --keep-old-actor")
        if not args.save:
            raise ValueError("--release-train requires --save")
        if args.save_interval is None:
            args.save_interval = 1
        if args.update_weight_mode != "full" or args.update_weight_transport != "disk":
            raise ValueError("--release-train requires --update-weight-mode full --update-weight-transport disk")
    if args.update_weight_mode == "delta":
        if args.update_weight_transport != "disk":
            raise ValueError("--update-weight-mode delta requires --update-weight-transport disk")
        if args.colocate:
            raise ValueError("--update-weight-mode delta is incompatible with --colocate")
        if not args.update_weight_local_checkpoint_dir:
            raise ValueError("--update-weight-mode delta requires --update-weight-local-checkpoint-dir")


def _validate_sglang_side(args) -> None:
    exclusive = {
        "--prefill-num-servers": args.prefill_num_servers is not None,
        "--sglang-config": args.sglang_config is not None,
        "--rollout-external-engine-addrs": args.rollout_external,
    }
    chosen = [k for k, v in exclusive.items() if v]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join(chosen)} are mutually exclusive")
    if args.rollout_external and args.colocate:
        raise ValueError("--rollout-external-engine-addrs engines run on their own GPUs: they cannot be combined with "
                         "--colocate (tensor weight updates need engines sharing the trainer's devices)")
    pp = sglang_value(args, "sglang_pp_size") or sglang_value(args, "sglang_pipeline_parallel_size") or 1
    if args.rollout_num_gpus_per_engine % int(pp) != 0:
        raise ValueError(
            f"--rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine} must be divisible by --sglang-pp-size {pp}"
        )
    args.sglang_tp_size = args.rollout_num_gpus_per_engine // int(pp)
    for short, long in (("dp_size", "data_parallel_size"), ("pp_size", "pipeline_parallel_size"),
                        ("ep_size", "expert_parallel_size"), ("moe_dp_size", "moe_data_parallel_size")):
        value = getattr(args, f"sglang_{short}", None)
        value = getattr(args, f"sglang_{long}", None) if value is None else value
        if value is not None:  # SGLang versions differ in which spelling is the dest: keep both
            setattr(args, f"sglang_{short}", value)
            setattr(args, f"sglang_{long}", value)
    dp = sglang_value(args, "sglang_dp_size") or sglang_value(args, "sglang_data_parallel_size") or 1
    if int(dp) > 1 and not sglang_value(args, "sglang_enable_dp_attention", False):
        raise ValueError(f"--sglang-dp-size {dp} > 1 requires --sglang-enable-dp-attention")
    if args.sglang_router_ip and ":" in args.sglang_router_ip and not args.sglang_router_ip.startswith("["):
        args.sglang_router_ip = f"[{args.sglang_router_ip}]"
    quantization = sglang_value(args, "sglang_quantization")
    if quantization and args.check_weight_update_equal:
        raise ValueError(f"--check-weight-update-equal compares the engine's weights with the trainer's exactly, but "
                         f"--sglang-quantization {quantization} engines hold rounded ones; drop one of the two")
    if (args.sglang_router_ip is None) != (args.sglang_router_port is None):
        raise ValueError("--sglang-router-ip and --sglang-router-port must be given together")
    if args.sglang_config is not None and not args.debug_train_only:
        from slime.backends.sglang_utils.sglang_config import models_from_args

        models_from_args(args)  # errors name the file, key path and value; fills --rollout-num-gpus


def _parse_json_flags(args) -> None:
    """JSON-valued flags become Python objects; a malformed value names its flag."""
    if args.train_env_vars:
        try:
            env = json.loads(args.train_env_vars) if isinstance(args.train_env_vars, str) else args.train_env_vars
        except json.JSONDecodeError as e:
            raise ValueError(f"--train-env-vars must be a JSON object: {e}") from None
        if not isinstance(env, dict):
            raise ValueError(f"--train-env-vars must be a JSON object, got {type(env).__name__}")
        args.train_env_vars = env
    if isinstance(args.apply_chat_template_kwargs, str):
        try:
            args.apply_chat_template_kwargs = json.loads(args.apply_chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"--apply-chat-template-kwargs must be a JSON object: {e}") from None
    if isinstance(args.multimodal_keys, str):
        try:
            args.multimodal_keys = json.loads(args.multimodal_keys)
        except json.JSONDecodeError as e:
            raise ValueError(f"--multimodal-keys must be a JSON object: {e}") from None


def _validate_backends(args) -> None:
    """Fail at start, with the install command, when a chosen backend's library is missing."""
    import importlib.util

    if not args.debug_rollout_only and args.train_backend == "megatron" and importlib.util.find_spec("megatron") is None:
        raise ValueError(
            "--train-backend megatron (the default) needs Megatron-Core, which is not installed. Install it with "
            "`pip install -e '.[megatron]'`, or pass --train-backend fsdp (runs on CPU and GPU)."
        )
    if (not args.debug_rollout_only and args.train_backend == "megatron" and args.num_layers is not None
            and _is_hf_dir(args.hf_checkpoint)):
        # a model preset was given: its shape must be the checkpoint's (docs/INTERFACES.md §4.2)
        from slime.backends.megatron_utils.model_config import hf_validate_args

        hf_validate_args(args)
    needs_engine = not args.debug_train_only and not args.rollout_external and args.rollout_num_gpus != 0
    if needs_engine and args.rollout_backend == "sglang":
        if importlib.util.find_spec("sglang") is None:
            raise ValueError(
                "--rollout-backend sglang (the default) needs SGLang, which is not installed. Install it with "
                "`pip install -e '.[sglang]'` on a GPU machine, or pass --rollout-backend embedded (slime's own "
                "engine; runs on CPU and GPU)."
            )
        import torch

        if not torch.cuda.is_available():  # SGLang's package can be importable (e.g. for its flags) yet not run
            raise ValueError(
                "--rollout-backend sglang (the default) needs CUDA GPUs, and this machine has none. Pass "
                "--rollout-backend embedded (slime's own engine; runs on CPU and GPU), or point at running SGLang "
                "servers with --rollout-external-engine-addrs."
            )


def flag_reference_markdown() -> str:
    """The flag table of docs/usage.md (slime's own and the training flags; pass-through excluded)."""
    parser, _ = get_parser(parse_sglang=False)
    lines = ["### Accepted but refused", "",
             "These upstream flags parse, so scripts passing their defaults run unchanged; slime does not "
             "implement them, and a non-default value fails at start-up with the alternative below.", "",
             "| flag | instead |", "|---|---|"]
    lines += [f"| `{flag}` | {hint} |" for flag, hint in REFUSED_FLAGS.items()]
    lines.append("")
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    lines += ["### Read by one training backend only", "",
              "Set away from its default under the other `--train-backend`, each fails at start-up with the "
              "alternative below.", "", "| flag | read by | under the other backend |", "|---|---|---|"]
    lines += [f"| `{flags[dest]}` | megatron | {hint} |" for dest, hint in MEGATRON_ONLY.items()]
    lines += [f"| `{flags[dest]}` | fsdp | {hint} |" for dest, hint in FSDP_ONLY.items()]
    lines.append("")
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        lines += [f"### {group.title}", "", "| flag | default | help |", "|---|---|---|"]
        for action in actions:
            flags = ", ".join(f"`{o}`" for o in action.option_strings)
            default = "required" if action.required else f"`{action.default!r}`"
            text = (action.help or "").replace("|", "\\|").replace("%%", "%")
            lines.append(f"| {flags} | {default} | {text} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m slime.arguments  -> prints the flag reference
    print(flag_reference_markdown())
