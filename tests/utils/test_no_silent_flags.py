"""Every flag does something: it is read by code outside the argument modules, refused at start-up
when set, feeds a derived value that is read (checked here by its effect), or sits on the short
allow-list below with the reason it is harmless.

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

from slime.utils.arguments import get_parser, parse_args, refused_flag_defaults
from slime.utils.arguments_groups import REFUSED_FLAGS, megatron_lm_passthrough_dests

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARGUMENT_MODULES = {"slime/utils/arguments.py", "slime/utils/arguments_groups.py", "slime/backends/fsdp_utils/arguments.py",
                    "slime/utils/megatron_lm_flags.py"}
BASE = ["--rollout-batch-size", "4", "--num-rollout", "2", "--train-backend", "fsdp", "--rollout-backend", "embedded"]

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
}

# Flags validate_args consumes to fill other values that are read: (argv, dest, expected value).
DERIVED = {
    "offload": (["--offload"], "offload_train", True),
    "num_steps_per_rollout": (["--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2"], "global_batch_size", 8),
    "dump_details": (["--dump-details", "/tmp/d"], "save_debug_rollout_data", "/tmp/d/rollout_data/{rollout_id}.pt"),
    "custom_config_path": (None, "my_hook_option", 7),  # argv built from a YAML file in the test
}


def _package_files():
    yield from (ROOT / "slime").rglob("*.py")
    yield ROOT / "train.py"
    yield ROOT / "train_async.py"


def _base_name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def read_names() -> set[str]:
    """Attribute and string names read as flags by the package outside the argument modules."""
    names: set[str] = set()
    for path in _package_files():
        if str(path.relative_to(ROOT)) in ARGUMENT_MODULES:
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


def silent_flags() -> dict[str, str]:
    """``dest -> flag`` of every flag whose value nothing outside the argument modules reads."""
    parser, passthrough = get_parser(parse_sglang=True)
    read = read_names()
    forwarded = set()
    if "router_passthrough" in read:
        forwarded |= set(passthrough.router_dests)
    if "sglang_passthrough" in read:
        forwarded |= set(passthrough.sglang_dests)
    # TransformerConfig fields handed to Megatron-Core by name in the Megatron backend's config builder
    if "megatron_lm_passthrough_dests()" in (ROOT / "slime/backends/megatron_utils/model.py").read_text():
        forwarded |= set(megatron_lm_passthrough_dests())
    silent = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        if action.dest not in read and action.dest not in forwarded:
            silent.setdefault(action.dest, action.option_strings[0])
    return silent


def test_no_flag_is_silently_ignored():
    refused = set(refused_flag_defaults())
    unexplained = {dest: flag for dest, flag in silent_flags().items()
                   if dest not in refused and dest not in ALLOWED_UNREAD and dest not in DERIVED}
    assert not unexplained, (
        f"flags nobody reads: {sorted(unexplained.values())}. Read each one where it takes effect, or add it to "
        f"REFUSED_FLAGS (slime/utils/arguments_groups.py) with what to use instead")


def test_the_lists_hold_only_flags_that_need_them():
    """A flag that became read must leave the allow-list (refused flags may stay: reading them is harmless)."""
    silent = silent_flags()
    assert not set(ALLOWED_UNREAD) - set(silent), "allow-listed flags that are read now: remove them from ALLOWED_UNREAD"
    assert not set(DERIVED) - set(silent)
    parser, _ = get_parser(parse_sglang=False)
    known = {o for a in parser._actions for o in a.option_strings}
    assert not set(REFUSED_FLAGS) - known, "REFUSED_FLAGS names flags the parser does not define"
    assert len(refused_flag_defaults()) == len(REFUSED_FLAGS)


def test_the_scan_finds_a_flag_nobody_reads():
    """The scanner itself: flags the trainer reads are found, a refused (unread) one is reported."""
    assert "seed" in read_names() and "lr" in read_names()
    assert "use_stateless_adam" in silent_flags()  # refused, but still unread


def _non_default_argv(action) -> list[str]:
    flag = next(o for o in action.option_strings if o in REFUSED_FLAGS)
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, next(str(c) for c in action.choices if c != action.default and [c] != action.default)]
    value = {int: "7", float: "0.5"}.get(action.type, "/some/value")
    return [flag, value]


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
