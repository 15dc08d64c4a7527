"""The engine layout: which models are served, by how many engines of which kind, on how many GPUs.

From ``--sglang-config`` (a YAML file) or, without it, from the flags (one regular group of
``--rollout-num-gpus``, or a prefill group of ``--prefill-num-servers`` engines plus a decode group).
The file::

    sglang:
      - name: actor                 # the trained policy (weights are pushed here)
        update_weights: true        # default true; false = a frozen model (reference, judge, teacher)
        model_path: /ckpt/actor     # default --hf-checkpoint
        server_groups:
          - worker_type: prefill    # regular | prefill | decode | placeholder
            num_gpus: 8
            num_gpus_per_engine: 4  # default --rollout-num-gpus-per-engine
            overrides: {mem_fraction_static: 0.8, chunked_prefill_size: 8192}   # ServerArgs fields
          - worker_type: decode
            num_gpus: 8
      - name: judge
        update_weights: false
        model_path: /ckpt/judge
        server_groups: [{worker_type: regular, num_gpus: 2, num_gpus_per_engine: 2}]

Each model gets its own router (``args.sglang_model_routers[name]``); the first model whose weights
are updated is the default (``--sglang-router-ip/port``). A ``placeholder`` group reserves GPUs
without starting anything. Errors name the file, the key path and the bad value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WORKER_TYPES = ("regular", "prefill", "decode", "placeholder")
_MODEL_KEYS = {"name", "model_path", "update_weights", "server_groups"}
_GROUP_KEYS = {"worker_type", "num_gpus", "num_gpus_per_engine", "overrides"}


@dataclass
class ServerGroup:
    """Engines of one kind for one model: ``num_gpus // num_gpus_per_engine`` of them."""

    worker_type: str  # regular | prefill | decode | placeholder
    num_gpus: int
    num_gpus_per_engine: int
    overrides: dict = field(default_factory=dict)  # ServerArgs field -> value, for this group only

    @property
    def num_engines(self) -> int:
        return 0 if self.worker_type == "placeholder" else self.num_gpus // self.num_gpus_per_engine


@dataclass
class ModelConfig:
    name: str
    model_path: str
    update_weights: bool
    server_groups: list[ServerGroup]

    @property
    def pd_disaggregation(self) -> bool:
        return any(g.worker_type in ("prefill", "decode") for g in self.server_groups)

    @property
    def num_gpus(self) -> int:
        return sum(g.num_gpus for g in self.server_groups)


class SGLangConfigError(ValueError):
    pass


def _fail(source: str, key_path: str, message: str) -> None:
    raise SGLangConfigError(f"{source}: {key_path}: {message}")


def _positive_int(value, source: str, key_path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        _fail(source, key_path, f"expected a positive integer, got {value!r}")
    return value


def parse_sglang_config(data, source: str, *, default_model_path: str | None, default_gpus_per_engine: int,
                        known_fields: set[str] | None = None, owned_fields: set[str] = frozenset()) -> list[ModelConfig]:
    """Validate the parsed YAML ``data`` (``source`` names the file in errors).

    ``known_fields``: the ServerArgs fields of the installed SGLang (None when SGLang is absent: any
    override name is accepted and forwarded); ``owned_fields``: fields slime sets itself.
    """
    if not isinstance(data, dict) or "sglang" not in data:
        _fail(source, "<top level>", f"expected a mapping with the key 'sglang' (a list of models), got {data!r:.80}")
    extra = set(data) - {"sglang"}
    if extra:
        _fail(source, "<top level>", f"unknown keys {sorted(extra)} (only 'sglang')")
    models_data = data["sglang"]
    if not isinstance(models_data, list) or not models_data:
        _fail(source, "sglang", f"expected a non-empty list of models, got {models_data!r:.80}")
    models, names = [], set()
    for i, model_data in enumerate(models_data):
        path = f"sglang[{i}]"
        if not isinstance(model_data, dict):
            _fail(source, path, f"expected a mapping, got {model_data!r:.80}")
        unknown = set(model_data) - _MODEL_KEYS
        if unknown:
            _fail(source, path, f"unknown keys {sorted(unknown)} (valid: {sorted(_MODEL_KEYS)})")
        name = model_data.get("name", "default" if len(models_data) == 1 else None)
        if not isinstance(name, str) or not name:
            _fail(source, f"{path}.name", f"every model needs a name (a non-empty string), got {name!r}")
        if name in names:
            _fail(source, f"{path}.name", f"duplicate model name {name!r}")
        names.add(name)
        model_path = model_data.get("model_path", default_model_path)
        if not isinstance(model_path, str) or not model_path:
            _fail(source, f"{path}.model_path", f"needs a checkpoint path (or --hf-checkpoint), got {model_path!r}")
        update_weights = model_data.get("update_weights", True)
        if not isinstance(update_weights, bool):
            _fail(source, f"{path}.update_weights", f"expected true or false, got {update_weights!r}")
        groups_data = model_data.get("server_groups")
        if not isinstance(groups_data, list) or not groups_data:
            _fail(source, f"{path}.server_groups", f"expected a non-empty list of server groups, got {groups_data!r:.80}")
        groups = [_parse_group(g, source, f"{path}.server_groups[{j}]", default_gpus_per_engine, known_fields, owned_fields)
                  for j, g in enumerate(groups_data)]
        kinds = {g.worker_type for g in groups} - {"placeholder"}
        if kinds & {"prefill", "decode"}:
            if kinds != {"prefill", "decode"}:
                _fail(source, f"{path}.server_groups", f"prefill/decode disaggregation needs both prefill and decode "
                      f"groups and no regular one; found worker types {sorted(kinds)}")
        models.append(ModelConfig(name, model_path, update_weights, groups))
    return models


def _parse_group(data, source, path, default_gpus_per_engine, known_fields, owned_fields) -> ServerGroup:
    if not isinstance(data, dict):
        _fail(source, path, f"expected a mapping, got {data!r:.80}")
    unknown = set(data) - _GROUP_KEYS
    if unknown:
        _fail(source, path, f"unknown keys {sorted(unknown)} (valid: {sorted(_GROUP_KEYS)})")
    worker_type = data.get("worker_type", "regular")
    if worker_type not in WORKER_TYPES:
        _fail(source, f"{path}.worker_type", f"{worker_type!r} is not one of {', '.join(WORKER_TYPES)}")
    if "num_gpus" not in data:
        _fail(source, f"{path}.num_gpus", "missing (the GPUs this group uses)")
    num_gpus = _positive_int(data["num_gpus"], source, f"{path}.num_gpus")
    per_engine = _positive_int(data.get("num_gpus_per_engine", default_gpus_per_engine), source,
                               f"{path}.num_gpus_per_engine")
    if num_gpus % per_engine and worker_type != "placeholder":
        _fail(source, f"{path}.num_gpus", f"{num_gpus} is not a multiple of num_gpus_per_engine {per_engine}")
    overrides = data.get("overrides") or {}
    if not isinstance(overrides, dict):
        _fail(source, f"{path}.overrides", f"expected a mapping of SGLang ServerArgs fields, got {overrides!r:.80}")
    for key in overrides:
        key_path = f"{path}.overrides.{key}"
        if not isinstance(key, str):
            _fail(source, key_path, "override names are ServerArgs field names (strings)")
        if key in owned_fields:
            _fail(source, key_path, f"{key!r} is set by slime for every engine and cannot be overridden")
        if known_fields is not None and key not in known_fields:
            import difflib

            close = difflib.get_close_matches(key, sorted(known_fields), n=1)
            _fail(source, key_path, f"{key!r} is not a ServerArgs field of the installed SGLang"
                  + (f"; did you mean {close[0]!r}?" if close else ""))
    return ServerGroup(worker_type, num_gpus, per_engine, dict(overrides))


def load_sglang_config(path: str, **kwargs) -> list[ModelConfig]:
    import os

    import yaml

    if not os.path.isfile(path):
        raise FileNotFoundError(f"--sglang-config {path!r} does not exist")
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise SGLangConfigError(f"{path}: not valid YAML: {e}") from None
    return parse_sglang_config(data, path, **kwargs)


def models_from_args(args) -> list[ModelConfig]:
    """The layout for this run: ``--sglang-config`` if given, else one model from the flags."""
    from slime.utils.passthrough import SGLANG_EXCLUDED

    per_engine = args.rollout_num_gpus_per_engine
    if args.sglang_config:
        known = args.sglang_server_fields
        models = load_sglang_config(args.sglang_config, default_model_path=args.hf_checkpoint,
                                    default_gpus_per_engine=per_engine, known_fields=known, owned_fields=SGLANG_EXCLUDED)
        total = sum(m.num_gpus for m in models)
        if args.rollout_num_gpus is None:
            args.rollout_num_gpus = total
        elif args.rollout_num_gpus != total:
            raise ValueError(f"--sglang-config {args.sglang_config} uses {total} GPUs (placeholders included) but "
                             f"--rollout-num-gpus is {args.rollout_num_gpus}; make them equal or drop --rollout-num-gpus")
        return models
    total = args.rollout_num_gpus or 0
    if args.prefill_num_servers:
        prefill = args.prefill_num_servers * per_engine
        if prefill >= total:
            raise ValueError(f"--prefill-num-servers {args.prefill_num_servers} x --rollout-num-gpus-per-engine "
                             f"{per_engine} leaves no GPU of --rollout-num-gpus {total} for decode servers")
        groups = [ServerGroup("prefill", prefill, per_engine), ServerGroup("decode", total - prefill, per_engine)]
    else:
        groups = [ServerGroup("regular", total, per_engine)] if total else []
    return [ModelConfig("default", args.hf_checkpoint, True, groups)]
