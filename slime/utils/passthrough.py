"""``--sglang-*`` and ``--router-*`` pass-through (INTERFACES §4.2).

When SGLang is importable, every ``ServerArgs`` CLI flag is re-registered with a ``--sglang-`` prefix
(types, choices, nargs and defaults from SGLang's own parser), except the flags slime sets itself.
Without SGLang, unknown ``--sglang-<flag> [value]`` tokens are kept verbatim (numbers typed) so they
can be forwarded to an engine. The router's flags come from the installed smg (or sglang-router)
``RouterArgs.add_cli_args(..., use_router_prefix=True)``, with slime's changed defaults.
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)

# ServerArgs fields slime controls itself (never passed through).
SGLANG_EXCLUDED = {
    "model_path", "config", "trust_remote_code", "random_seed", "enable_memory_saver", "tp_size",
    "tensor_parallel_size", "port", "host", "nnodes", "node_rank", "dist_init_addr", "gpu_id_step",
    "base_gpu_id", "nccl_port", "skip_server_warmup", "enable_return_routed_experts",
}
# slime's own flags that happen to start with --sglang- (§4.3.16): not SGLang server flags.
SLIME_OWNED_SGLANG = {
    "sglang_router_ip", "sglang_router_port", "sglang_router_request_timeout_secs",
    "sglang_server_concurrency", "sglang_config",
}
ROUTER_DEFAULT_OVERRIDES = {"router_log_level": "warn", "router_balance_abs_threshold": 10, "router_balance_rel_threshold": 1.2}


class PassThrough:
    """Tracks which pass-through flags exist and which values the user gave."""

    def __init__(self):
        self.sglang_dests: dict[str, object] = {}  # dest -> default, for introspected SGLang flags
        self.router_dests: dict[str, object] = {}  # dest -> router's own default
        self.sglang_verbatim: dict[str, object] = {}  # flag name (no prefix) -> value, SGLang not installed
        self.router_verbatim: dict[str, object] = {}
        self.sglang_introspected = False
        self.router_introspected = False

    # ------------------------------------------------------------------ unknown tokens

    def absorb_unknown(self, unknown: list[str], args: argparse.Namespace) -> list[str]:
        """Keep unknown ``--sglang-*`` (and ``--router-*`` when no router package is installed) for
        forwarding; return the tokens that are still unknown."""
        leftover, i = [], 0
        while i < len(unknown):
            token = unknown[i]
            name, eq, inline = token.partition("=")
            prefix = None
            if name.startswith("--sglang-") and not self.sglang_introspected:
                prefix, store = "sglang", self.sglang_verbatim
            elif name.startswith("--router-") and not self.router_introspected:
                prefix, store = "router", self.router_verbatim
            if prefix is None:
                leftover.append(token)
                i += 1
                continue
            flag = name[len(prefix) + 3:]
            if eq:
                value, i = _typed(inline), i + 1
            else:
                values = []
                i += 1
                while i < len(unknown) and not unknown[i].startswith("--"):
                    values.append(_typed(unknown[i]))
                    i += 1
                value = True if not values else values[0] if len(values) == 1 else values
            store[flag] = value
            setattr(args, f"{prefix}_{flag.replace('-', '_')}", value)
        return leftover

    # ------------------------------------------------------------------ what to forward

    def forwarded(self, args: argparse.Namespace) -> dict[str, object]:
        """SGLang flags to forward to engines: ``{"mem-fraction-static": 0.7, ...}`` (non-default only)."""
        result = dict(self.sglang_verbatim)
        for dest, default in self.sglang_dests.items():
            value = getattr(args, dest, default)
            if value != default:
                result[dest[len("sglang_"):].replace("_", "-")] = value
        return result

    def router_forwarded(self, args: argparse.Namespace) -> dict[str, object]:
        """Router flags to pass to ``smg launch`` (values that differ from the router's own defaults)."""
        result = dict(self.router_verbatim)
        for dest, default in self.router_dests.items():
            value = getattr(args, dest, default)
            if value != default and value not in (None, [], False):
                result[dest[len("router_"):].replace("_", "-")] = value
        return result


def _typed(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def add_sglang_arguments(parser: argparse.ArgumentParser, state: PassThrough) -> None:
    try:
        from sglang.srt.server_args import ServerArgs  # noqa: F401
    except Exception:  # SGLang absent (CPU machines) or its optional kernels missing
        return
    source = argparse.ArgumentParser(add_help=False)
    try:
        ServerArgs.add_cli_args(source)
    except Exception as e:  # pragma: no cover - depends on the installed SGLang
        logger.warning("could not read SGLang's ServerArgs flags (%s); --sglang-* values are forwarded verbatim", e)
        return
    group = parser.add_argument_group("SGLang server flags (--sglang-<flag>, from the installed SGLang)")
    existing = {opt for action in parser._actions for opt in action.option_strings}
    for action in source._actions:
        if not action.option_strings or action.dest in SGLANG_EXCLUDED or action.dest == "help":
            continue
        options = [f"--sglang-{opt[2:]}" for opt in action.option_strings if opt.startswith("--")]
        options = [opt for opt in options if opt not in existing]
        if not options:
            continue
        kwargs = {"dest": f"sglang_{action.dest}", "default": action.default, "help": action.help}
        if isinstance(action, argparse._StoreTrueAction):
            kwargs["action"] = "store_true"
        elif isinstance(action, argparse._StoreFalseAction):
            kwargs["action"] = "store_false"
        elif isinstance(action, (argparse._StoreAction, argparse._AppendAction)):
            if isinstance(action, argparse._AppendAction):
                kwargs["action"] = "append"
            kwargs.update(type=action.type, choices=action.choices, nargs=action.nargs)
        else:
            continue
        group.add_argument(*options, **{k: v for k, v in kwargs.items() if v is not None or k == "default"})
        state.sglang_dests[f"sglang_{action.dest}"] = action.default
    state.sglang_introspected = True


def add_router_arguments(parser: argparse.ArgumentParser, state: PassThrough) -> None:
    router_args = None
    for module in ("smg.router_args", "sglang_router.router_args"):
        try:
            router_args = __import__(module, fromlist=["RouterArgs"]).RouterArgs
            break
        except Exception:
            continue
    if router_args is None:
        return
    source = argparse.ArgumentParser(add_help=False)
    router_args.add_cli_args(source, use_router_prefix=True, exclude_host_port=True)
    group = parser.add_argument_group("router flags (--router-<flag>, from the installed smg)")
    existing = {opt for action in parser._actions for opt in action.option_strings}
    for action in source._actions:
        if not action.option_strings or action.dest == "help":
            continue
        options = [opt for opt in action.option_strings if opt not in existing]
        if not options:
            continue
        state.router_dests[action.dest] = action.default
        action.option_strings = options
        group._add_action(action)
    for dest, value in ROUTER_DEFAULT_OVERRIDES.items():
        if dest in state.router_dests:
            parser.set_defaults(**{dest: value})
    state.router_introspected = True
