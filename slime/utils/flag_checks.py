"""Flag values checked while the command line is parsed (``validate_args``): counts in range, the reward and
failure flags, ``--colocate``'s GPU counts, near-miss ``--sglang-*`` options, ``--load`` and ``--save``."""

from __future__ import annotations

import os

from slime.utils.errors import UserError

__all__ = ["POSITIVE_FLAGS", "check_flag_values", "check_sglang_passthrough", "check_load_and_save"]

#: flags that count something: (dest, smallest valid value); None values are skipped (flag not given)
POSITIVE_FLAGS = (("rollout_batch_size", 1), ("n_samples_per_prompt", 1), ("num_rollout", 0), ("num_epoch", 1),
                  ("save_interval", 1), ("eval_interval", 1), ("global_batch_size", 1), ("micro_batch_size", 1),
                  ("over_sampling_batch_size", 1), ("rollout_max_response_len", 1), ("eval_max_response_len", 1),
                  ("rollout_max_context_len", 2), ("rollout_max_prompt_len", 1), ("update_weights_interval", 1),
                  ("max_tokens_per_gpu", 1), ("rollout_num_gpus_per_engine", 1), ("actor_num_nodes", 1),
                  ("actor_num_gpus_per_node", 0), ("sglang_server_concurrency", 1))


def check_flag_values(args) -> None:
    """Counts and intervals in range, the new reward/failure flags, and ``--colocate``'s GPU counts."""
    for dest, minimum in POSITIVE_FLAGS:
        value = getattr(args, dest, None)
        if value is not None and value < minimum:
            what = "a positive number" if minimum == 1 else f">= {minimum}"
            raise UserError(f"{_flag(dest)} must be {what} (got {value})")
    timeout = args.reward_timeout
    if timeout is not None and timeout <= 0:
        raise UserError(f"--reward-timeout must be > 0 seconds (got {timeout:g}); leave it out for no limit")
    ratio = args.stop_on_failed_ratio
    if not 0 < ratio <= 1:
        raise UserError(f"--stop-on-failed-ratio must be in (0, 1] (got {ratio:g}): the share of a step's samples "
                        f"that may fail before the run stops")
    check_sglang_passthrough(args)
    rollout_gpus = args.rollout_num_gpus
    actor_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
    if (args.colocate and not args.debug_rollout_only
            and rollout_gpus is not None and rollout_gpus != actor_gpus):
        raise UserError(f"--colocate puts the engines on the trainer's GPUs, so --rollout-num-gpus ({rollout_gpus}) "
                        f"must equal --actor-num-nodes x --actor-num-gpus-per-node ({args.actor_num_nodes} x "
                        f"{args.actor_num_gpus_per_node} = {actor_gpus}): set --rollout-num-gpus {actor_gpus} "
                        f"(or leave it out), or change --actor-num-gpus-per-node")


def check_sglang_passthrough(args) -> None:
    """Without SGLang installed, ``--sglang-*`` values are kept verbatim for the embedded engine: one that is
    a near miss of an embedded engine option is a typo, refused with the option meant."""
    import difflib

    if args.rollout_backend != "embedded" or args.sglang_server_fields is not None:
        return
    from slime.utils.passthrough import EMBEDDED_FLAG_FOR, EMBEDDED_SGLANG_FLAGS

    for name in args.sglang_passthrough or {}:
        if EMBEDDED_FLAG_FOR.get(name, name) in EMBEDDED_SGLANG_FLAGS:
            continue
        close = difflib.get_close_matches(name, sorted(EMBEDDED_SGLANG_FLAGS), n=1, cutoff=0.85)
        if close:
            raise UserError(f"--sglang-{name} is not an option of the embedded engine; "
                            f"did you mean --sglang-{close[0]}?")


def check_load_and_save(args) -> None:
    """A ``--load`` that does not exist is a typo, unless it is ``--save`` (a fresh run that resumes
    itself when restarted). A ``--save`` holding another run's checkpoints is refused unless
    ``--overwrite-save``."""
    load, save = args.load, args.save
    same = bool(load and save) and os.path.realpath(load) == os.path.realpath(save)
    if load and not os.path.exists(load) and not same:
        raise UserError(f"--load {load!r} does not exist (resolved from {os.getcwd()!r}). Give an existing "
                        f"checkpoint directory; to start from --hf-checkpoint/--ref-load drop --load, or pass the "
                        f"--save directory as --load to resume a run automatically")
    marker = os.path.join(save or "", "latest_checkpointed_iteration.txt")
    if (save and os.path.isfile(marker) and not same and not args.overwrite_save
            and not args.debug_rollout_only):
        step = open(marker).read().strip()
        raise UserError(f"--save {save!r} already holds checkpoints of another run (last step {step}); this run "
                        f"would overwrite them. Pass --load {save} to resume that run, choose another --save, or "
                        f"pass --overwrite-save to write over them")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")
