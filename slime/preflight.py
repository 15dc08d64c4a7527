"""Start-up checks that need the environment: every hook resolved and its signature checked, the reward
configured, every data and eval file opened and parsed, ``--save`` writable, a finished run recognised.

``validate_args`` (slime.arguments) checks the flags against each other; ``preflight(args)`` runs
once more before any process is started (``Job`` calls it) and raises :class:`UserError` naming the flag,
file, line or field, what was found and what to do. ``main(entry)`` is what ``train.py`` and
``train_async.py`` run: a user's mistake ends in one message (exit 1), a traceback only with
``SLIME_DEBUG=1``.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import tempfile

from slime.utils.errors import RunFinished, UserError
from slime.utils.flag_checks import check_flag_values, check_load_and_save

logger = logging.getLogger(__name__)

__all__ = ["UserError", "RunFinished", "preflight", "check_flag_values", "check_load_and_save", "check_hooks",
           "check_model_plugins", "check_reward", "check_data_files", "check_save_dir", "check_finished", "main",
           "HOOK_SIGNATURES"]

#: rows of a training prompt file parsed at start (the whole file is read later, before the first step)
TRAIN_ROWS_CHECKED = 1000


# flag dest -> (positional parameters the hook is called with, what docs/customization.md says, async?)
# ``async`` None: both accepted; True: must be ``async def``.
HOOK_SIGNATURES: dict[str, tuple[tuple[str, ...], str, bool | None]] = {
    "rollout_function_path": (("args", "rollout_id", "data_source"),
                              "def generate_rollout(args, rollout_id, data_source, evaluation=False)", False),
    "eval_function_path": (("args", "rollout_id", "data_source"),
                           "def generate_rollout(args, rollout_id, data_source, evaluation=False)", False),
    "custom_generate_function_path": (("args", "sample", "sampling_params"),
                                      "async def generate(args, sample, sampling_params, evaluation=False)", True),
    "custom_rm_path": (("args", "sample"), "[async] def reward(args, sample, **kwargs) -> float | dict", None),
    "dynamic_sampling_filter_path": (("args", "samples"), "def filter(args, samples, **kwargs)", False),
    "buffer_filter_path": (("args", "rollout_id", "buffer", "num_samples"),
                           "def buffer_filter(args, rollout_id, buffer, num_samples)", False),
    "rollout_sample_filter_path": (("args", "groups"), "def filter(args, groups)", False),
    "rollout_all_samples_process_path": (("args", "all_groups", "data_source"),
                                         "def process(args, all_groups, data_source)", False),
    "rollout_sample_hook_path": (("args", "sample"), "[async] def hook(args, sample, *, rollout_id=None, "
                                 "evaluation=False)", None),
    "data_source_path": (("args",), "class DataSource: __init__(self, args)", False),
    "custom_rollout_log_function_path": (
        ("rollout_id", "args", "samples", "rollout_extra_metrics", "rollout_time"),
        "def log(rollout_id, args, samples, rollout_extra_metrics, rollout_time)", False),
    "custom_eval_rollout_log_function_path": (("rollout_id", "args", "data", "extra_metrics"),
                                              "def log(rollout_id, args, data, extra_metrics)", False),
    "rollout_data_postprocess_path": (("args", "rollout_id", "rollout_data"),
                                      "def postprocess(args, rollout_id, rollout_data)", False),
    "custom_loss_function_path": (("args", "batch", "logits", "sum_of_sample_mean"),
                                  "def loss(args, batch, logits, sum_of_sample_mean)", False),
    "custom_tis_function_path": (("*", "args", "pg_loss", "train_log_probs", "rollout_log_probs", "loss_masks",
                                  "total_lengths", "response_lengths"),  # "*": called with keywords only
                                 "def tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs)",
                                 False),
    "custom_pg_loss_reducer_function_path": (("total_lengths", "response_lengths", "loss_masks"),
                                             "def make_reducer(total_lengths, response_lengths, loss_masks, "
                                             "calculate_per_token_loss=False)", False),
    "custom_reward_post_process_path": (("args", "samples"), "def post(args, samples)", False),
    "custom_convert_samples_to_train_data_path": (("args", "samples"), "def convert(args, samples)", False),
    "custom_advantage_function_path": (("args", "rollout_data"), "def adv(args, rollout_data)", False),
    "custom_update_weight_post_write_path": (("args", "version_dir", "rollout_engines"),
                                             "def hook(args, version_dir, rollout_engines)", False),
    "custom_megatron_init_path": (("args",), "def init(args)", False),
    "custom_megatron_before_log_prob_hook_path": (("args", "model", "store_prefix"),
                                                  "def hook(args, model, store_prefix)", False),
    "custom_megatron_before_train_step_hook_path": (
        ("args", "rollout_id", "step_id", "model", "optimizer", "opt_param_scheduler"),
        "def hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)", False),
    "custom_model_provider_path": (("pre_process", "post_process"),
                                   "def provider(pre_process, post_process, vp_stage=None)", False),
}
_MEGATRON_ONLY = {"custom_megatron_init_path", "custom_megatron_before_log_prob_hook_path",
                  "custom_megatron_before_train_step_hook_path", "custom_model_provider_path"}
_DEFAULT_ROLLOUTS = ("slime.rollout.sglang_rollout.generate_rollout",
                     "slime.rollout.fully_async_rollout.generate_rollout_fully_async")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _is_async(fn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def check_hook(dest: str, path: str, *, batched: bool = False):
    """Import the hook ``path`` given to flag ``dest`` and check it can be called as slime calls it."""
    from slime.utils.misc import load_function

    params, expected, must_be_async = HOOK_SIGNATURES[dest]
    if batched:
        params, expected = ("args", "samples"), "[async] def batched_reward(args, samples, **kwargs) -> list"
    try:
        fn = load_function(path)
    except (ImportError, AttributeError, ValueError) as e:
        raise UserError(f"{_flag(dest)} {path}: {e}") from None
    except Exception as e:  # the module itself fails on import
        raise UserError(f"{_flag(dest)} {path}: importing it raised {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise UserError(f"{_flag(dest)} {path} is not callable (found {type(fn).__name__} {fn!r:.60}); "
                        f"expected {expected}")
    if must_be_async and not _is_async(fn):
        raise UserError(f"{_flag(dest)} {path} is a plain `def`; slime awaits it: write it as {expected}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # builtins and C callables: nothing to compare
    positional, keywords = (params, {}) if params[:1] != ("*",) else ((), dict.fromkeys(params[1:]))
    if dest in ("rollout_function_path", "eval_function_path"):
        keywords = {"evaluation": False}
    try:
        signature.bind(*positional, **keywords)
    except TypeError as e:
        called = ", ".join(p for p in params if p != "*")
        raise UserError(f"{_flag(dest)} {path} has the signature {path.rpartition('.')[2]}{signature}, which cannot "
                        f"be called with ({called}) ({e}); expected {expected}") from None
    return fn


def check_hooks(args) -> None:
    """Every dotted-path hook flag that is set: importable, callable, and callable with slime's arguments."""
    for dest in HOOK_SIGNATURES:
        if dest in _MEGATRON_ONLY and args.train_backend != "megatron":
            continue
        value = getattr(args, dest, None)
        for path in (value if isinstance(value, (list, tuple)) else [value]):
            if path:
                batched = dest == "custom_rm_path" and bool(args.group_rm)
                check_hook(dest, path, batched=batched)


#: the package upstream slime's model scripts load Megatron model builders from (layer specs, model providers);
#: it is not shipped here
UPSTREAM_MODEL_PLUGINS = "slime_plugins."
UPSTREAM_MODEL_PLUGIN_HINT = (
    "no such module here (upstream slime's model plugins, slime_plugins.*, are not part of slime), and slime's "
    "Megatron backend builds no vision tower and no Qwen3.5 / Qwen3-Next layers. Train Qwen3.5 (with its vision tower or without), Qwen3-Next "
    "and the vision-language models (Qwen2.5-VL, Qwen3-VL) with --train-backend fsdp, which builds the model from "
    "--hf-checkpoint's config.json: drop this flag and MODEL_ARGS; images come with --multimodal-keys "
    "(docs/vision_language.md)")


def _model_plugin_paths(args) -> list[tuple[str, str, str]]:
    """(flag, path, module) of the Megatron model builders the flags name."""
    found = []
    if args.custom_model_provider_path:
        path = args.custom_model_provider_path
        found.append(("--custom-model-provider-path", path, path.rpartition(":" if ":" in path else ".")[0]))
    spec = args.spec
    if spec:
        module = spec[0] if len(spec) == 2 else spec[0].rpartition(".")[0]
        found.append(("--spec", " ".join(spec), module))
    return found


def _qwen35_or_vision_script(args) -> bool:
    """The flags of a Qwen3.5 / Qwen3-Next preset (gated attention, gated-DeltaNet layers), or images."""
    return bool(args.use_gated_attention or args.experimental_attention_variant == "gated_delta_net"
                or args.linear_attention_freq is not None or args.multimodal_keys)


def check_model_plugins(args) -> None:
    """``--custom-model-provider-path`` / ``--spec`` naming a module that is not here, from upstream's plugin package
    or beside a Qwen3.5 preset's flags or images (an upstream Qwen3.5 or vision-language script): refused with
    what trains those models here, before the bare import error would."""
    import importlib

    if args.train_backend != "megatron":
        return  # --train-backend fsdp refuses both flags at parse
    for flag, path, module in _model_plugin_paths(args):
        if not (module.startswith(UPSTREAM_MODEL_PLUGINS) or _qwen35_or_vision_script(args)):
            continue
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and (module == e.name or module.startswith(e.name + ".")):  # the module itself is missing
                raise UserError(f"{flag} {path}: {UPSTREAM_MODEL_PLUGIN_HINT}") from None


def _first_row_metadata(args) -> dict:
    from slime.utils.data import iter_rows

    if not args.prompt_data:
        return {}
    try:
        for _, row in iter_rows(args.prompt_data):
            metadata = row.get(args.metadata_key or "metadata")
            return metadata if isinstance(metadata, dict) else {}
    except Exception:
        return {}  # check_data_files reports the file's problem
    return {}


def check_reward(args) -> None:
    """An ``--rm-type`` slime knows; a reward at all when the default rollout needs one."""
    from slime.rollout.rm_hub import RULE_RM_TYPES

    rm_type = (args.rm_type or "").strip()
    if rm_type:
        base = rm_type[len("boxed_"):] if rm_type.startswith("boxed_") else rm_type
        if base not in RULE_RM_TYPES:
            import difflib

            close = difflib.get_close_matches(base, RULE_RM_TYPES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UserError(f"--rm-type {rm_type!r} is not a rule reward{hint}; valid types: "
                            f"{', '.join(RULE_RM_TYPES)} (each may be prefixed with boxed_), or write your own with "
                            f"--custom-rm-path module.function")
        if base == "remote_rm" and not args.rm_url:
            raise UserError("--rm-type remote_rm needs --rm-url (the reward server's URL)")
    needs_reward = (args.rollout_function_path in _DEFAULT_ROLLOUTS
                    and not args.custom_generate_function_path
                    and not args.debug_train_only)
    if needs_reward and not rm_type and not args.custom_rm_path:
        if "rm_type" not in _first_row_metadata(args):
            raise UserError("no reward is configured: every sample would fail with reward 0. Pass --rm-type (one of "
                            f"{', '.join(RULE_RM_TYPES)}), or --custom-rm-path module.function, or give each data "
                            "row metadata {\"rm_type\": ...}")


def _data_files(args) -> list[tuple[str, str, dict, int | None]]:
    """(flag, path, row keys, rows to check) of every prompt and eval file this run reads."""
    if args.debug_train_only or args.load_debug_rollout_data:
        return []
    files = []
    if args.prompt_data and args.rollout_global_dataset:
        keys = dict(prompt_key=args.input_key, label_key=args.label_key, tool_key=args.tool_key,
                    metadata_key=args.metadata_key, multimodal_keys=args.multimodal_keys)
        files.append(("--prompt-data", args.prompt_data, keys, TRAIN_ROWS_CHECKED))
    flag = "--eval-config" if args.eval_config is not None else "--eval-prompt-data"
    for config in args.eval_datasets or []:
        keys = dict(prompt_key=config.input_key, label_key=config.label_key, tool_key=config.tool_key,
                    metadata_key=config.metadata_key, multimodal_keys=config.multimodal_keys)
        files.append((f"{flag} ({config.name})", config.path, keys, None))  # evaluated late: read it all now
    return files


def check_data_files(args) -> None:
    """Open every data and eval file and parse its rows (all of an eval file, the first
    ``TRAIN_ROWS_CHECKED`` of a training file): a bad row names the file, line and key."""
    import itertools
    import json

    from slime.utils.data import Dataset, iter_rows

    for flag, path, keys, limit in _data_files(args):
        multimodal = keys.pop("multimodal_keys")
        if isinstance(multimodal, str):
            multimodal = json.loads(multimodal)
        parser = Dataset.__new__(Dataset)  # only the row parser: no tokenizer needed without templating
        count = 0
        try:
            for line_no, row in itertools.islice(iter_rows(path), limit):
                parser._row_to_sample(row, f"{path} line {line_no}", multimodal_keys=multimodal,
                                      apply_chat_template=False, apply_chat_template_kwargs={}, **keys)
                count += 1
        except (ValueError, KeyError, OSError) as e:
            message = e.args[0] if isinstance(e, KeyError) and e.args else e
            raise UserError(f"{flag}: {message}") from None
        if count == 0:
            raise UserError(f"{flag}: {path} holds no rows")


def check_save_dir(args) -> None:
    """``--save`` exists or can be made, and a file can be written in it."""
    save = args.save
    if not save:
        return
    if os.path.exists(save) and not os.path.isdir(save):
        raise UserError(f"--save {save!r} is a file, not a directory")
    try:
        os.makedirs(save, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=save, prefix=".slime-write-check-"):
            pass
    except OSError as e:
        raise UserError(f"--save {save!r} is not writable ({e.strerror}): checkpoints could not be saved; "
                        f"choose a directory you can write to") from None


def check_finished(args) -> None:
    """Resuming a checkpoint that already completed ``--num-rollout`` steps: raise :class:`RunFinished`."""
    load, num_rollout = args.load, args.num_rollout
    if not load or num_rollout is None or args.start_rollout_id is not None:
        return
    marker = os.path.join(load, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(marker):
        return
    text = open(marker).read().strip()
    ckpt_step = args.ckpt_step
    if ckpt_step is not None:
        last = ckpt_step
    elif text.isdigit():
        last = int(text)
    else:
        return  # Megatron's "release" marker, or a malformed one the trainer reports
    if last + 1 >= num_rollout and num_rollout > 0:
        raise RunFinished(f"nothing to do: the checkpoint in --load {load} has completed rollout step {last} and "
                          f"--num-rollout is {num_rollout}, so this run is already finished. Raise --num-rollout "
                          f"to train further.")


def preflight(args) -> None:
    """Everything that can be checked before a process starts; raises :class:`UserError`. Runs once."""
    if getattr(args, "_preflight_done", False):
        return
    check_finished(args)
    check_save_dir(args)
    check_model_plugins(args)
    check_hooks(args)
    check_reward(args)
    check_data_files(args)
    args._preflight_done = True


# --------------------------------------------------------------------------- the entry point

#: errors raised while the command line is read and checked: the user's input, reported in one line
_STARTUP_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, ImportError, AttributeError,
                   TypeError, KeyError)


def _report(error: BaseException, code: int) -> None:
    if os.environ.get("SLIME_DEBUG"):
        raise error
    message = error.args[0] if isinstance(error, KeyError) and error.args else error
    sys.stderr.write(f"slime: {'error: ' if code else ''}{message}\n")
    if code:
        sys.stderr.write("(set SLIME_DEBUG=1 for the traceback)\n")
    sys.exit(code)


def main(entry, parse=None) -> None:
    """Parse and check the command line, then run ``entry(args)``. A mistake found before work starts,
    or a :class:`UserError` raised later (e.g. a step where every sample failed), ends in one message."""
    if parse is None:
        from slime.arguments import parse_args as parse
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args = parse()
        preflight(args)
    except RunFinished as e:
        _report(e, 0)
    except _STARTUP_ERRORS as e:
        _report(e, 1)
    try:
        entry(args)
    except UserError as e:  # also raised in a Ray actor: the task error is an instance of it
        cause = getattr(e, "cause", None)
        _report(cause if isinstance(cause, UserError) else e, 0 if isinstance(e, RunFinished) else 1)
    except Exception as e:
        if not getattr(e, "_actor_init_failed", False):  # ray.exceptions.RayActorError of a constructor
            raise
        # a component's constructor rejected the input (e.g. the data source: every prompt too long);
        # Ray keeps only the text of the error, whose last line is the exception and its message
        lines = [line for line in str(e).splitlines() if line.strip()]
        _report(RuntimeError(f"a component failed to start: {lines[-1].strip() if lines else e}"), 1)
