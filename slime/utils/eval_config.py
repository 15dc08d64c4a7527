"""Evaluation datasets: ``--eval-prompt-data name path ...`` or ``--eval-config`` (docs/INTERFACES.md §7.2–§7.4).

Every dataset becomes an :class:`EvalDatasetConfig` whose unset fields fall back to the ``defaults``
mapping of the config file, then to the ``--eval-*`` flags, then to the ``--rollout-*`` / data flags.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class EvalDatasetConfig:
    name: str
    path: str
    rm_type: str | None = None
    custom_rm_path: str | None = None
    input_key: str | None = None
    label_key: str | None = None
    tool_key: str | None = None
    metadata_key: str | None = None
    multimodal_keys: Any = None
    apply_chat_template: bool | None = None
    apply_chat_template_kwargs: dict | None = None
    n_samples_per_eval_prompt: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_response_len: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    custom_generate_function_path: str | None = None
    app_service: Any = None
    eval_task_timeout: float | None = None
    min_eval_samples: int | None = None
    eval_early_stop_remaining: int | None = None
    eval_early_stop_idle_timeout: float | None = None
    message_processor: Any = None
    reward_model: Any = None
    remote_environment: Any = None
    metadata_overrides: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.min_eval_samples is not None and self.min_eval_samples <= 0:
            raise ValueError(f"eval dataset {self.name!r}: min_eval_samples must be > 0 (got {self.min_eval_samples})")

    @property
    def cache_key(self) -> tuple:
        return (self.name, self.path, self.input_key, self.label_key, self.tool_key, self.metadata_key)

    def inject_metadata(self, metadata: dict | None) -> dict:
        """A copy of ``metadata`` with this dataset's ``rm_type`` and ``metadata_overrides`` applied."""
        result = copy.deepcopy(metadata) if metadata else {}
        if self.rm_type is not None:
            result["rm_type"] = self.rm_type
        result.update(copy.deepcopy(self.metadata_overrides or {}))
        return result


# field -> ordered list of args attributes to fall back to
_ARG_FALLBACKS = {
    "n_samples_per_eval_prompt": ["n_samples_per_eval_prompt", "n_samples_per_prompt"],
    "temperature": ["eval_temperature", "rollout_temperature"],
    "top_p": ["eval_top_p", "rollout_top_p"],
    "top_k": ["eval_top_k", "rollout_top_k"],
    "max_response_len": ["eval_max_response_len", "rollout_max_response_len"],
    "stop": ["rollout_stop"],
    "stop_token_ids": ["rollout_stop_token_ids"],
    "skip_special_tokens": ["rollout_skip_special_tokens"],
    "min_new_tokens": ["eval_min_new_tokens"],
    "input_key": ["eval_input_key", "input_key"],
    "label_key": ["eval_label_key", "label_key"],
    "tool_key": ["eval_tool_key", "tool_key"],
    "metadata_key": ["metadata_key"],
    "multimodal_keys": ["multimodal_keys"],
    "apply_chat_template": ["apply_chat_template"],
    "apply_chat_template_kwargs": ["apply_chat_template_kwargs"],
    "custom_rm_path": ["eval_custom_rm_path", "custom_rm_path"],
}


def build_eval_dataset_configs(args, raw_list: list[dict], defaults: dict | None = None) -> list[EvalDatasetConfig]:
    """Resolve each raw dataset entry: entry > ``defaults`` > CLI args."""
    defaults = dict(defaults or {})
    valid = {f.name for f in fields(EvalDatasetConfig)} - {"name", "path"}
    unknown = sorted(set(defaults) - valid)
    if unknown:
        raise ValueError(f"eval config defaults has unknown keys {unknown}; valid keys: {sorted(valid)}")
    configs = []
    for raw in raw_list:
        entry = {**defaults, **dict(raw)}
        if "name" not in entry or "path" not in entry:
            raise ValueError(f"eval dataset entry {raw!r} needs 'name' and 'path'")
        config = EvalDatasetConfig(**entry)  # unknown keys -> TypeError naming the key
        for name, sources in _ARG_FALLBACKS.items():
            if getattr(config, name) is None:
                for source in sources:
                    value = getattr(args, source, None)
                    if value is not None:
                        setattr(config, name, value)
                        break
        if config.no_stop_trim is None:
            config.no_stop_trim = True
        if isinstance(config.apply_chat_template_kwargs, str):
            config.apply_chat_template_kwargs = json.loads(config.apply_chat_template_kwargs)
        configs.append(config)
    return configs


def _load_eval_config(path: str) -> tuple[list[dict], dict]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--eval-config {path!r} does not exist")
    with open(path) as f:
        if path.endswith(".json"):
            root = json.load(f)
        else:
            import yaml

            root = yaml.safe_load(f)
    if not isinstance(root, dict):
        raise ValueError(f"--eval-config {path}: expected a mapping at the top level")
    section = root.get("eval", root)
    defaults = section.get("defaults") or {}
    datasets = section.get("datasets")
    if not datasets:
        raise ValueError(f"--eval-config {path}: no datasets (expected eval.datasets as a list or a name->entry mapping)")
    if isinstance(datasets, dict):
        datasets = [{"name": name, **(entry or {})} for name, entry in datasets.items()]
    return list(datasets), dict(defaults)


def resolve_eval_datasets(args) -> None:
    """§4.4 rule 1: fill ``args.eval_datasets`` and normalise ``args.eval_prompt_data``."""
    if args.eval_config is not None:
        raw, defaults = _load_eval_config(args.eval_config)
    elif args.eval_prompt_data:
        values = list(args.eval_prompt_data)
        if len(values) == 1:
            values = ["aime", values[0]]
        if len(values) % 2:
            raise ValueError(
                f"--eval-prompt-data takes name/path pairs (name1 path1 name2 path2 ...); got {len(values)} values"
            )
        raw, defaults = [{"name": values[i], "path": values[i + 1]} for i in range(0, len(values), 2)], {}
    else:
        args.eval_datasets = []
        args.eval_prompt_data = None
        return
    args.eval_datasets = build_eval_dataset_configs(args, raw, defaults)
    args.eval_prompt_data = [v for config in args.eval_datasets for v in (config.name, config.path)]
