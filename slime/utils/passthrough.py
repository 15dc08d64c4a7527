"""``--sglang-*`` and ``--router-*`` pass-through (docs/INTERFACES.md §4.2).

When SGLang is importable, every ``ServerArgs`` CLI flag is re-registered with a ``--sglang-`` prefix
(types, choices, nargs and defaults from SGLang's own parser), except the flags slime sets itself.
Without SGLang, unknown ``--sglang-<flag> [value]`` tokens are kept verbatim (numbers typed) so they
can be forwarded to an engine. The router's flags come from the installed smg (or sglang-router)
``RouterArgs.add_cli_args(..., use_router_prefix=True)``, with slime's changed defaults.
"""

from __future__ import annotations

import argparse
import copy
import logging

logger = logging.getLogger(__name__)

# ServerArgs fields slime controls itself (never passed through), and where the value comes from.
SGLANG_OWNED_BY_SLIME = {
    "model_path": "--hf-checkpoint",
    "config": "slime (use --sglang-config for slime's engine YAML)",
    "trust_remote_code": "slime (always on)",
    "random_seed": "--seed (seed + engine rank x GPUs per node)",
    "enable_memory_saver": "--offload-rollout (colocated engines release memory while training)",
    "tp_size": "--rollout-num-gpus-per-engine (divided by --sglang-pp-size)",
    "tensor_parallel_size": "--rollout-num-gpus-per-engine (divided by --sglang-pp-size)",
    "port": "slime (a free port per engine)",
    "host": "slime (the engine's node IP)",
    "nnodes": "slime (engines larger than --num-gpus-per-node span several nodes)",
    "node_rank": "slime (engines larger than --num-gpus-per-node span several nodes)",
    "dist_init_addr": "slime (a free port on the engine's first node)",
    "gpu_id_step": "slime (always 1)",
    "base_gpu_id": "slime (the engine's first GPU on its node)",
    "nccl_port": "slime (a free port per engine)",
    "skip_server_warmup": "slime (always on)",
    "enable_return_routed_experts": "--use-rollout-routing-replay",
}
SGLANG_EXCLUDED = set(SGLANG_OWNED_BY_SLIME)
# slime's own flags that happen to start with --sglang- (§4.3.16): not SGLang server flags.
SLIME_OWNED_SGLANG = {
    "sglang_router_ip", "sglang_router_port", "sglang_router_request_timeout_secs",
    "sglang_server_concurrency", "sglang_config",
}
# router flags slime fills itself: the worker list and the prefill/decode wiring come from the engines
ROUTER_EXCLUDED = {"worker_urls", "router_prefill", "router_decode", "router_encode", "router_host", "router_port"}
ROUTER_DEFAULT_OVERRIDES = {"router_log_level": "warn", "router_balance_abs_threshold": 10, "router_balance_rel_threshold": 1.2}


# SGLang options renamed or removed between the version slime's docs and scripts were first written
# for (0.5.15) and the tested one (0.5.23), found by diffing the two releases' ServerArgs. An old
# spelling is rewritten to the new one with a one-line warning; a removed one is refused by name.
SGLANG_RENAMED = {
    "cuda-graph-bs": "cuda-graph-bs-decode",
    "cuda-graph-max-bs": "cuda-graph-max-bs-decode",
    "nsa-decode-backend": "dsa-decode-backend",
    "nsa-prefill-backend": "dsa-prefill-backend",
    "fp8-gemm-runner-backend": "fp8-gemm-backend",
    "fp4-gemm-runner-backend": "fp4-gemm-backend",
}
SGLANG_REMOVED = ("collect-tokens-histogram", "cuda-graph-tc-compiler", "disable-piecewise-cuda-graph",
                  "enable-breakable-cuda-graph", "enforce-piecewise-cuda-graph", "piecewise-cuda-graph-compiler",
                  "piecewise-cuda-graph-max-tokens", "piecewise-cuda-graph-tokens", "enable-deepep-waterfill",
                  "enable-expert-distribution-metrics", "keep-mm-feature-on-device", "mamba-scheduler-strategy",
                  "prefill-round-robin-balance", "speculative-dflash-draft-window-size", "stream-output",
                  "torchao-config", "elastic-ep-rejoin", "optimistic-prefill-retries")


def rename_legacy_sglang_flags(argv: list[str], current: set[str] | None = None) -> list[str]:
    """``--sglang-<old>`` -> ``--sglang-<new>`` for SGLang's renamed options (a warning each); a
    removed option raises naming it. ``current``: the installed SGLang's option names (no prefix),
    so a name that is still valid there is left alone."""
    out = []
    for token in argv:
        name, eq, value = token.partition("=")
        flag = name[len("--sglang-"):] if name.startswith("--sglang-") else None
        if flag is None or (current is not None and flag in current):
            out.append(token)
            continue
        if flag in SGLANG_RENAMED:
            new = f"--sglang-{SGLANG_RENAMED[flag]}"
            logger.warning("%s is SGLang's old name for %s (renamed since SGLang 0.5.15); passing it as %s",
                           name, new, new)
            out.append(new + eq + value)
        elif flag in SGLANG_REMOVED:
            raise ValueError(f"{name}: SGLang removed --{flag} (it is not an option of SGLang 0.5.23, the tested "
                             f"version); drop it from the command line")
        else:
            out.append(token)
    return out


def owned_flag_message(flag: str) -> str | None:
    """``--sglang-tp-size`` -> why the flag is not accepted and which slime flag sets the value."""
    if not flag.startswith("--sglang-"):
        return None
    field = flag[len("--sglang-"):].split("=", 1)[0].replace("-", "_")
    source = SGLANG_OWNED_BY_SLIME.get(field)
    if source is None:
        return None
    return f"{flag} is set by slime for every engine, from {source}; it cannot be passed through"


class _PrefixedBooleanOptional(argparse.Action):
    """``--sglang-x`` / ``--sglang-no-x`` for SGLang's ``--x`` / ``--no-x`` (BooleanOptionalAction)."""

    def __init__(self, option_strings, dest, negative_strings=(), **kwargs):
        self.negative_strings = set(negative_strings)
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string not in self.negative_strings)


class PassThrough:
    """Tracks which pass-through flags exist and which values the user gave."""

    def __init__(self):
        self.sglang_dests: dict[str, object] = {}  # dest -> default, for introspected SGLang flags
        self.router_dests: dict[str, object] = {}  # dest -> router's own default
        self.sglang_verbatim: dict[str, object] = {}  # flag name (no prefix) -> value, SGLang not installed
        self.router_verbatim: dict[str, object] = {}
        self.sglang_negatable: set[str] = set()  # dests with a --sglang-no-<flag> form
        self.sglang_introspected = False
        self.router_introspected = False
        self.sglang_flags: set[str] = set()  # option names of the installed SGLang, without "--"

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
                name = dest[len("sglang_"):].replace("_", "-")
                if value is False and dest in self.sglang_negatable:  # SGLang spells it --no-<flag>
                    name, value = f"no-{name}", True
                result[name] = value
        return result

    def server_fields(self) -> set[str] | None:
        """ServerArgs field names of the installed SGLang (None without SGLang)."""
        if not self.sglang_introspected:
            return None
        return {dest[len("sglang_"):] for dest in self.sglang_dests} | SGLANG_EXCLUDED

    def router_forwarded(self, args: argparse.Namespace) -> dict[str, object]:
        """Router flags to pass to ``smg launch`` (values that differ from the router's own defaults)."""
        result = dict(self.router_verbatim)
        for dest, default in self.router_dests.items():
            value = getattr(args, dest, default)
            if value != default and value is not None and value is not False and value != []:  # 0 is a value
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
    """Re-register every SGLang ``ServerArgs`` flag as ``--sglang-<flag>`` (dest ``sglang_<dest>``)
    with SGLang's own action, type, choices, nargs and default; aliases are prefixed too."""
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
        dest = f"sglang_{action.dest}"
        if isinstance(action, argparse.BooleanOptionalAction):
            negative = [o for o in options if o.startswith("--sglang-no-")]
            prefixed = _PrefixedBooleanOptional(options, dest, negative_strings=negative, default=action.default,
                                                help=action.help)
            state.sglang_negatable.add(dest)
        else:  # SGLang's own action class (store, store_true, deprecated aliases, LoRA paths ...)
            prefixed = copy.copy(action)
            prefixed.option_strings, prefixed.dest, prefixed.container = options, dest, group
        group._add_action(prefixed)
        state.sglang_dests[dest] = action.default
        state.sglang_flags.update(opt[2:] for opt in action.option_strings if opt.startswith("--"))
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
        if not action.option_strings or action.dest == "help" or action.dest in ROUTER_EXCLUDED:
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


# --sglang-* flags the embedded engine understands (SGLang names); others are SGLang-only.
EMBEDDED_SGLANG_FLAGS = {"mem-fraction-static", "context-length", "max-total-tokens", "max-running-requests",
                         "chunked-prefill-size", "tool-call-parser", "served-model-name", "api-key", "dtype",
                         "random-seed", "log-level", "custom-pull-weights-pre-read-hook", "attention-backend",
                         "disable-cuda-graph", "cuda-graph-max-bs", "cuda-graph-bs", "quantization", "fp8-gemm-backend",
                         "kv-cache-dtype", "enable-return-routed-experts", "enable-memory-saver", "enable-weights-cpu-backup",
                         "speculative-algorithm", "speculative-draft-model-path", "speculative-draft-model",
                         "speculative-num-steps", "speculative-num-draft-tokens", "speculative-eagle-topk",
                         "speculative-ngram-max-trie-depth", "speculative-adaptive", "speculative-adaptive-config",
                         "enable-deterministic-inference"}
# SGLang 0.5.23's name of an option (as its ServerArgs field) -> the embedded engine's flag for it
EMBEDDED_FLAG_FOR = {"cuda-graph-max-bs-decode": "cuda-graph-max-bs", "cuda-graph-bs-decode": "cuda-graph-bs",
                     "fp8-gemm-runner-backend": "fp8-gemm-backend"}


def sglang_value(args, dest: str, default=None):
    """The value of an SGLang ``ServerArgs`` flag (``dest`` like ``sglang_quantization``): ``args`` holds it
    only when the installed SGLang declares it or the command line gave it verbatim, else ``default``."""
    return getattr(args, dest, default)
