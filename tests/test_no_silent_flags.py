"""Every flag does something on the backend it is given to: it is read by the code path of the chosen
``--train-backend`` (the shared code and that backend's package) outside the argument modules, refused
at start-up when set (for every backend, or for the backend that would ignore it:
``slime/utils/backend_flags.py``), feeds a derived value that is read (checked here by its effect), or
sits on the short allow-list below with the reason it is harmless. The embedded engine's package is
not scanned: the engine process reads its own parser (``embedded_engine/config.py``), whose names
(``--attention-backend``) would pass for trainer flags.

A "read" is found statically over slime/ and the entry files: ``<x>args.<dest>`` / ``self.args.<dest>``
in a load context, ``getattr(..., "<dest>")`` / ``hasattr``, or ``"<dest>"`` as an element of a
list/tuple/set or dict value, or anywhere in getattr's name expression (the tables that code walks with ``getattr(args, name)``, e.g. the eval
dataset defaults). ``--router-*`` flags are consumed wholesale by ``PassThrough.router_forwarded``
(and ``--sglang-*`` by ``PassThrough.forwarded`` when SGLang is installed), so those dests are
counted as read once the forwarded dicts themselves are read; likewise the Megatron-LM TransformerConfig
flags that ``megatron_lm_passthrough_dests`` lists (the Megatron backend hands them to Megatron-Core).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from slime.arguments import get_parser, parse_args, refused_flag_defaults
from slime.utils.arguments_groups import REFUSED_FLAGS, megatron_lm_passthrough_dests
from slime.utils.backend_flags import FSDP_ONLY, MEGATRON_ONLY

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARGUMENT_MODULES = {"slime/arguments.py", "slime/utils/arguments_groups.py", "slime/backends/fsdp_utils/arguments.py",
                    "slime/utils/megatron_lm_flags.py", "slime/utils/backend_flags.py"}
BASE = ["--rollout-batch-size", "4", "--num-rollout", "2", "--train-backend", "fsdp", "--rollout-backend", "embedded"]
BACKEND_PACKAGES = {"fsdp": "slime/backends/fsdp_utils/", "megatron": "slime/backends/megatron_utils/"}
ENGINE_PACKAGE = "slime/backends/embedded_engine/"

# Flags nothing reads because what they ask for is what slime always does. Keep this list short.
ALLOWED_UNREAD = {
    # Megatron's spelling of the default: both backends shard optimizer state (FSDP2; Megatron's
    # DistributedOptimizer is always built); store_true with default True, so it cannot change anything
    "use_distributed_optimizer": "always on",
    # the Megatron backend always reduces gradients in fp32 (DistributedDataParallelConfig)
    "accumulate_allreduce_grads_in_fp32": "always on",
    # the Megatron backend always computes softmax in fp32 (TransformerConfig)
    "attention_softmax_in_fp32": "always on",
    # rotary embeddings are the only position embedding implemented (--position-embedding-type is read)
    "use_rotary_position_embeddings": "always on",
    # bf16 autocast is the GPU default of both backends; --fp16 is the flag that changes it
    "bf16": "the default",
    # Megatron-LM's --no-position-embedding: no learned absolute position embedding, which is always so (RoPE only)
    "add_position_embedding": "always so",
    # checked by validate_args alone: "sglang" is the only teacher implemented ("megatron" needs the refused
    # --opd-teacher-load); the FSDP backend's read is a second refusal
    "opd_type": "validated at start",
}

# Flags validate_args consumes to fill other values that are read: (argv, dest, expected value).
DERIVED = {
    "offload": (["--offload"], "offload_train", True),
    "num_steps_per_rollout": (["--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2"], "global_batch_size", 8),
    "dump_details": (["--dump-details", "/tmp/d"], "save_debug_rollout_data", "/tmp/d/rollout_data/{rollout_id}.pt"),
    "custom_config_path": (None, "my_hook_option", 7),  # argv built from a YAML file in the test
}


def _package_files(backend: str | None = None):
    """The files of ``backend``'s code path: the shared code and that backend's package (None: both)."""
    others = [package for name, package in BACKEND_PACKAGES.items() if name != backend] if backend else []
    for path in (ROOT / "slime").rglob("*.py"):
        relative = str(path.relative_to(ROOT))
        if not relative.startswith(ENGINE_PACKAGE) and not any(relative.startswith(p) for p in others):
            yield path
    yield ROOT / "train.py"
    yield ROOT / "train_async.py"


def _base_name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def read_names(backend: str | None = None, skip: frozenset[str] = frozenset()) -> set[str]:
    """Attribute and string names read as flags outside the argument modules (and ``skip``) on ``backend``'s
    code path."""
    names: set[str] = set()
    for path in _package_files(backend):
        if str(path.relative_to(ROOT)) in ARGUMENT_MODULES | skip:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                base = _base_name(node.value)
                if base is not None and base.endswith("args"):
                    names.add(node.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
                if len(node.args) >= 2:  # a constant, or constants chosen by an expression (a if c else b)
                    names.update(c.value for c in ast.walk(node.args[1])
                                 if isinstance(c, ast.Constant) and isinstance(c.value, str))
            elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                names.update(e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
            elif isinstance(node, ast.Dict):
                names.update(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return names


def silent_flags(backend: str | None = None, add_custom_arguments=None,
                 skip: frozenset[str] = frozenset()) -> dict[str, str]:
    """``dest -> flag`` of every flag whose value nothing outside the argument modules (and ``skip``) reads on
    ``backend``'s code path (None: on either backend's)."""
    parser, passthrough = get_parser(add_custom_arguments, parse_sglang=True)
    read = read_names(backend, skip)
    forwarded = set()
    if "router_passthrough" in read:
        forwarded |= set(passthrough.router_dests)
    if "sglang_passthrough" in read:
        forwarded |= set(passthrough.sglang_dests)
    # TransformerConfig fields handed to Megatron-Core by name in the Megatron backend's config builder
    if backend != "fsdp" and "megatron_lm_passthrough_dests()" in (ROOT / "slime/backends/megatron_utils/model.py").read_text():
        forwarded |= set(megatron_lm_passthrough_dests())
    silent = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        if action.dest not in read and action.dest not in forwarded:
            silent.setdefault(action.dest, action.option_strings[0])
    return silent


def refused_for(backend: str) -> set[str]:
    """Dests refused at start when set under ``--train-backend backend``."""
    if backend == "fsdp":  # Megatron-only flags, and the TransformerConfig passthrough (_validate_model_shape_flags)
        return set(MEGATRON_ONLY) | set(megatron_lm_passthrough_dests())
    return set(FSDP_ONLY)


def unexplained_flags(backend: str, add_custom_arguments=None) -> dict[str, str]:
    refused = set(refused_flag_defaults()) | refused_for(backend)
    return {dest: flag for dest, flag in silent_flags(backend, add_custom_arguments).items()
            if dest not in refused and dest not in ALLOWED_UNREAD and dest not in DERIVED}


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_no_flag_is_silently_ignored(backend):
    unexplained = unexplained_flags(backend)
    assert not unexplained, (
        f"flags the --train-backend {backend} code path does not read: {sorted(unexplained.values())}. Read each "
        f"one where it takes effect, or refuse it: for every backend in REFUSED_FLAGS (slime/utils/arguments_groups.py), "
        f"for this backend in slime/utils/backend_flags.py, each with what to use instead")


def test_a_flag_added_without_a_reader_is_reported_for_each_backend():
    def add(parser):
        parser.add_argument("--brand-new-knob", type=int, default=3)

    for backend in ("fsdp", "megatron"):
        assert unexplained_flags(backend, add) == {"brand_new_knob": "--brand-new-knob"}


# start-up checks name flags of either backend to validate or refuse them; they make no flag take effect
START_UP_CHECKS = frozenset({"slime/preflight.py", "slime/utils/exactness.py"})


def test_a_flag_one_backend_reads_is_silent_on_the_other():
    """The scan is per backend: FSDP's reads do not count for Megatron and the other way round."""
    fsdp, megatron = silent_flags("fsdp", skip=START_UP_CHECKS), silent_flags("megatron", skip=START_UP_CHECKS)
    for dest in ("tensor_model_parallel_size", "sequence_parallel", "recompute_granularity", "optimizer_cpu_offload",
                 "custom_megatron_init_path"):
        assert dest in fsdp and dest not in megatron, dest
    for dest in ("fsdp_compile", "gradient_checkpointing", "fsdp_mixed_precision"):
        assert dest in megatron and dest not in fsdp, dest
    assert "lr" not in fsdp and "lr" not in megatron


def test_the_lists_hold_only_flags_that_need_them():
    """A flag that became read must leave the allow-list (refused flags may stay: reading them is harmless);
    a flag refused for one backend must be one that backend does not read."""
    silent = {backend: silent_flags(backend) for backend in ("fsdp", "megatron")}
    either = set(silent["fsdp"]) | set(silent["megatron"])
    assert not set(ALLOWED_UNREAD) - either, "allow-listed flags that are read now: remove them from ALLOWED_UNREAD"
    assert not set(DERIVED) - either
    # the start-up checks name every hook and checkpoint flag to validate it, whichever backend runs
    fsdp_beyond_checks = silent_flags("fsdp", skip=START_UP_CHECKS)
    megatron_beyond_checks = silent_flags("megatron", skip=START_UP_CHECKS)
    assert not set(MEGATRON_ONLY) - set(fsdp_beyond_checks), "MEGATRON_ONLY flags that the FSDP backend reads"
    assert not set(FSDP_ONLY) - set(megatron_beyond_checks), "FSDP_ONLY flags that the Megatron backend reads"
    parser, _ = get_parser(parse_sglang=False)
    known = {o for a in parser._actions for o in a.option_strings}
    assert not set(REFUSED_FLAGS) - known, "REFUSED_FLAGS names flags the parser does not define"
    assert len(refused_flag_defaults()) == len(REFUSED_FLAGS)


def test_the_scan_finds_a_flag_nobody_reads():
    """The scanner itself: flags the trainer reads are found, a refused (unread) one is reported."""
    assert "seed" in read_names() and "lr" in read_names()
    assert "use_stateless_adam" in silent_flags()  # refused, but still unread
    assert "attention_backend" in silent_flags()  # the engine's own --attention-backend does not count


def _non_default_argv(action, flag: str | None = None) -> list[str]:
    flag = flag or next(o for o in action.option_strings if o in REFUSED_FLAGS)
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, next(str(c) for c in action.choices if c != action.default and [c] != action.default)]
    value = {int: "7", float: "0.5"}.get(action.type, "/some/value")
    return [flag, "4" if action.dest == "linear_attention_freq" else value]  # a layer pattern, not a path


def _refused_actions():
    parser, _ = get_parser(parse_sglang=False)
    return [a for a in parser._actions if any(o in REFUSED_FLAGS for o in a.option_strings)]


@pytest.mark.parametrize("action", _refused_actions(), ids=lambda a: a.option_strings[0])
def test_refused_flag_fails_when_set_and_parses_at_its_default(action):
    argv = _non_default_argv(action)
    with pytest.raises(ValueError, match=f"{argv[0]} .* is not implemented by slime") as info:
        parse_args(BASE + argv)
    assert REFUSED_FLAGS[argv[0]] in str(info.value)
    if action.nargs != 0 and action.default is not None:  # an upstream script passing the default still runs
        values = action.default if isinstance(action.default, list) else [action.default]
        parse_args(BASE + [argv[0], *[str(v) for v in values]])


def test_refused_flags_say_so_in_help():
    parser, _ = get_parser(parse_sglang=False)
    text = parser.format_help()
    assert "refused unless left at its default" in text
    for action in _refused_actions():
        assert "refused unless left at its default" in action.help


def test_derived_flags_take_effect(tmp_path):
    for dest, (argv, target, expected) in DERIVED.items():
        if argv is None:
            path = tmp_path / "custom.yaml"
            path.write_text(f"{target}: {expected}\n")
            argv = ["--custom-config-path", str(path)]
        args = parse_args(BASE + argv)
        assert getattr(args, target) == expected, dest
        assert target in read_names() or dest == "custom_config_path", f"{target} (from {dest}) is read by nothing"


def test_a_refused_flag_set_by_custom_config_is_refused_too(tmp_path):
    path = tmp_path / "custom.yaml"
    path.write_text("use_stateless_adam: true\n")
    with pytest.raises(ValueError, match="--use-stateless-adam True is not implemented"):
        parse_args(BASE + ["--custom-config-path", str(path)])


def _backend_only_cases():
    parser, _ = get_parser(parse_sglang=False)
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    architecture = [dest for dest, hint in MEGATRON_ONLY.items() if "config.json" in hint]
    # the model-shape flags share one message and one check: three of them stand for the rest
    cases = [("fsdp", actions[dest], hint) for dest, hint in MEGATRON_ONLY.items() if dest not in architecture[3:]]
    cases += [("megatron", actions[dest], hint) for dest, hint in FSDP_ONLY.items()]
    # --no-rope-fusion and the like store the default they already hold: they cannot be set away from it
    return [case for case in cases if not (case[1].nargs == 0 and case[1].const == case[1].default)]


@pytest.mark.parametrize("backend,action,hint", _backend_only_cases(),
                         ids=lambda v: v.option_strings[0] if hasattr(v, "option_strings") else None)
def test_a_flag_the_chosen_backend_ignores_fails_when_set_and_parses_at_its_default(backend, action, hint):
    """FSDP asked for TP=2 (or Megatron for --fsdp-compile) fails at start with what to use instead;
    an upstream script passing the default still parses."""
    base = [backend if a == "fsdp" else a for a in BASE]
    argv = [action.option_strings[0], "2"] if action.dest == "moe_layer_freq" else _non_default_argv(action, action.option_strings[0])
    with pytest.raises(ValueError, match=f"--train-backend {backend} does not read .*{argv[0]} ") as info:
        parse_args(base + argv)
    assert hint in str(info.value)
    if backend == "fsdp" and action.nargs != 0 and action.default is not None:
        values = action.default if isinstance(action.default, list) else [action.default]
        parse_args(base + [argv[0], *[str(v) for v in values]])


def test_fsdp_asked_for_tensor_parallelism_says_what_to_use():
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2 .*tensor, pipeline, expert and sequence "
                                         "parallelism need --train-backend megatron"):
        parse_args(BASE + ["--tensor-model-parallel-size", "2"])
