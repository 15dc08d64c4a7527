"""Where prompt groups come from (docs/INTERFACES.md §2.16).

``RolloutDataSource`` hands out the dataset sequentially, ``n_samples_per_prompt`` deep copies per
prompt, wrapping into a new (reshuffled) epoch at the end. ``RolloutDataSourceWithBuffer`` (the
default) first serves groups that were put back (partial rollout, user hooks) through the buffer
filter. ``save(rollout_id)`` / ``load(rollout_id)`` persist the position, epoch, counters, the
shuffle seed and the buffer, so a resumed run hands out exactly the prompts the original run would
have handed out next.
"""

from __future__ import annotations

import abc
import copy
import json
import logging
import os

from slime.utils.misc import load_function
from slime.utils.passthrough import sglang_value
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

STATE_FILE_TEMPLATE = "global_dataset_state_dict_{rollout_id}.pt"


def _state_path(base_dir: str, rollout_id: int) -> str:
    return os.path.join(base_dir, "rollout", STATE_FILE_TEMPLATE.format(rollout_id=rollout_id))


class DataSource(abc.ABC):
    """A source of prompt groups for the rollout function (constructed as ``cls(args)``)."""

    @abc.abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """Return ``num_samples`` prompt groups, each of ``n_samples_per_prompt`` samples."""

    @abc.abstractmethod
    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Put prompt groups back (to be handed out again)."""

    @abc.abstractmethod
    def save(self, rollout_id: int) -> None:
        """Persist the state reached after rollout step ``rollout_id``."""

    @abc.abstractmethod
    def load(self, rollout_id: int | None = None) -> None:
        """Restore the state saved after rollout step ``rollout_id`` (no-op when absent)."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of prompts in one epoch."""


class RolloutDataSource(DataSource):
    """Sequential, epoch-wrapping prompt source over ``--prompt-data`` (read-only)."""

    def __init__(self, args):
        self.args = args
        self.epoch_id = 0
        self.sample_offset = 0
        self.sample_group_index = 0
        self.sample_index = 0
        self.metadata: dict = {}
        self.dataset = None
        if args.rollout_global_dataset and args.prompt_data:
            self.dataset = self._load_dataset(args)
            if args.rollout_shuffle:
                self.dataset.shuffle(self.epoch_id)

    @staticmethod
    def _load_dataset(args):
        from slime.utils.data import Dataset
        from slime.utils.processing_utils import load_processor, load_tokenizer

        tokenizer = load_tokenizer(args.hf_checkpoint) if args.hf_checkpoint else None
        # only prompts with media (--multimodal-keys) can need the processor; looking for one imports
        # transformers' processing stack (2-3 s of the rollout manager's start)
        has_media = bool(args.multimodal_keys)
        processor = load_processor(args.hf_checkpoint) if tokenizer is not None and has_media else None
        return Dataset(
            args.prompt_data,
            tokenizer,
            processor,
            args.rollout_max_prompt_len or _engine_max_prompt_len(args),
            prompt_key=args.input_key,
            label_key=args.label_key,
            tool_key=args.tool_key,
            metadata_key=args.metadata_key,
            multimodal_keys=args.multimodal_keys,
            seed=args.rollout_seed,
            apply_chat_template=args.apply_chat_template,
            apply_chat_template_kwargs=args.apply_chat_template_kwargs,
        )

    def _next_prompts(self, num_prompts: int) -> list[Sample]:
        if self.dataset is None:
            return [Sample() for _ in range(num_prompts)]
        if len(self.dataset) == 0:
            raise ValueError(f"prompt dataset {self.args.prompt_data} is empty (after length filtering)")
        prompts: list[Sample] = []
        while len(prompts) < num_prompts:
            if self.sample_offset >= len(self.dataset):
                self.epoch_id += 1
                self.sample_offset = 0
                if self.args.rollout_shuffle:
                    self.dataset.shuffle(self.epoch_id)
            take = min(num_prompts - len(prompts), len(self.dataset) - self.sample_offset)
            prompts += self.dataset.samples[self.sample_offset : self.sample_offset + take]
            self.sample_offset += take
        return prompts

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        n = int(self.args.n_samples_per_prompt or 1)
        groups = []
        for prompt_sample in self._next_prompts(num_samples):
            group = []
            for _ in range(n):
                sample = copy.deepcopy(prompt_sample)
                sample.group_index = self.sample_group_index
                sample.index = self.sample_index
                self.sample_index += 1
                group.append(sample)
            self.sample_group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        raise RuntimeError(
            f"{type(self).__name__} is read-only; use RolloutDataSourceWithBuffer (the default --data-source-path) "
            f"to put groups back"
        )

    def state_dict(self) -> dict:
        return {
            "sample_offset": self.sample_offset,
            "epoch_id": self.epoch_id,
            "sample_group_index": self.sample_group_index,
            "sample_index": self.sample_index,
            "metadata": copy.deepcopy(self.metadata),
            # The shuffle order is a pure function of (rollout_seed, epoch_id); the seed is saved so a
            # resume with a different --rollout-seed is detected instead of silently reordering.
            "rollout_seed": self.args.rollout_seed,
            "rollout_shuffle": bool(self.args.rollout_shuffle),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("rollout_seed", self.args.rollout_seed) != self.args.rollout_seed:
            logger.warning(
                "data source state was saved with --rollout-seed %s but this run uses %s; the prompt order will differ",
                state.get("rollout_seed"), self.args.rollout_seed,
            )  # fmt: skip
        self.sample_offset = state["sample_offset"]
        self.epoch_id = state["epoch_id"]
        self.sample_group_index = state["sample_group_index"]
        self.sample_index = state["sample_index"]
        self.metadata = state.get("metadata", {})
        if self.dataset is not None and self.args.rollout_shuffle:
            self.dataset.shuffle(self.epoch_id)

    def save(self, rollout_id: int) -> None:
        import torch

        if not self.args.rollout_global_dataset:
            return
        if not self.args.save:
            raise ValueError("saving the data-source state needs --save")
        path = _state_path(self.args.save, rollout_id)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(self.state_dict(), path)
        logger.info("saved data-source state to %s", path)

    def load(self, rollout_id: int | None = None) -> None:
        import torch

        if not self.args.rollout_global_dataset or rollout_id is None or rollout_id < 0:
            return
        if not self.args.load:
            return
        path = _state_path(self.args.load, rollout_id)
        if not os.path.exists(path):
            logger.info("no data-source state at %s; starting from the beginning", path)
            return
        self.load_state_dict(torch.load(path, weights_only=False))
        logger.info("loaded data-source state from %s (epoch %d, offset %d)", path, self.epoch_id, self.sample_offset)

    def __len__(self) -> int:
        return len(self.dataset) if self.dataset is not None else 0


def pop_first(args, rollout_id, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """Default buffer filter: remove and return the first ``min(len(buffer), num_samples)`` groups."""
    num_to_pop = min(len(buffer), num_samples)
    groups = buffer[:num_to_pop]
    del buffer[:num_to_pop]
    return groups


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """The default source: a FIFO buffer of put-back groups served first, then the dataset."""

    def __init__(self, args):
        super().__init__(args)
        self.buffer: list[list[Sample]] = []
        path = args.buffer_filter_path
        self.buffer_filter = load_function(path) if path else pop_first

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = self._get_samples_from_buffer(num_samples)
        if len(groups) < num_samples:
            groups += super().get_samples(num_samples - len(groups))
        return groups

    def _get_samples_from_buffer(self, num_samples: int) -> list[list[Sample]]:
        if not self.buffer or num_samples <= 0:
            return []
        groups = self.buffer_filter(self.args, None, self.buffer, num_samples)
        if len(groups) > num_samples:
            raise ValueError(f"buffer filter returned {len(groups)} groups but only {num_samples} were asked for")
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        if not isinstance(samples, list) or not all(isinstance(g, list) for g in samples):
            raise TypeError("add_samples expects a list of prompt groups (list[list[Sample]])")
        n = int(self.args.n_samples_per_prompt or 1)
        for group in samples:
            if len(group) != n:
                raise ValueError(f"each group put back must have n_samples_per_prompt={n} samples, got {len(group)}")
        self.buffer.extend(samples)

    def get_buffer_length(self) -> int:
        return len(self.buffer)

    def update_metadata(self, metadata: dict) -> None:
        self.metadata.update(metadata)

    def get_metadata(self) -> dict:
        return self.metadata

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["buffer"] = [[_sample_to_dict(s) for s in group] for group in self.buffer]
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.buffer = [[_sample_from_dict(s) for s in group] for group in state.get("buffer", [])]


def _sample_to_dict(sample):
    if isinstance(sample, list):  # fan-out leaves
        return [_sample_to_dict(s) for s in sample]
    return sample.to_dict()


def _sample_from_dict(data):
    if isinstance(data, list):
        return [_sample_from_dict(d) for d in data]
    return Sample.from_dict(data)


def _engine_max_prompt_len(args) -> int | None:
    """The longest prompt the engines accept (their context length - 1: ``--sglang-context-length``, else the
    model's ``max_position_embeddings``). Longer prompts are left out at load, counted in a warning, instead of
    failing at the engine."""
    context = sglang_value(args, "sglang_context_length")
    config_path = os.path.join(args.hf_checkpoint or "", "config.json")
    if not context and os.path.isfile(config_path):
        with open(config_path) as f:
            config = json.load(f)
        config = config.get("text_config", config)  # multimodal models keep the language model's beside
        context = config.get("max_position_embeddings")
    return int(context) - 1 if context else None
