"""The train data of one data-parallel shard of a rollout step, as a typed record.

The rollout manager builds one :class:`TrainBatch` per shard
(:func:`slime.backends.training.train_data.split_train_data_by_dp`); every rank of a data-parallel replica
trains on the same one. User hooks that are documented to receive the ``rollout_data`` dict
(``--rollout-data-postprocess-path``, ``--custom-advantage-function-path``, the train debug dump)
get :meth:`TrainBatch.as_rollout_data` — the docs/INTERFACES.md §7.7 keys plus the computed columns — and
what they change is read back with :meth:`TrainBatch.with_rollout_data`.

Notation: n = samples in the shard; R_i = response length of sample i; L_i its total length.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["StepSchedule", "TrainBatch", "PER_SAMPLE_COLUMNS", "COMPUTED_COLUMNS"]


@dataclass
class StepSchedule:
    """Which micro-batches make up each optimizer step of the rollout step (the same number of
    micro-batches on every shard, so the data-parallel collectives stay matched)."""

    global_batch_sizes: list[int]  # rollouts per optimizer step, B (the per-rollout normaliser, §5.8)
    num_microbatches: list[int]  # micro-batches per optimizer step
    micro_batch_indices: list[list[int]]  # per micro-batch, all steps in order: local sample positions (may be empty)
    step_loss_token_counts: list[float]  # per step, Σ_i max(Σ_t m, 1) over all shards (the per-token normaliser)

    @property
    def num_steps(self) -> int:
        return len(self.num_microbatches)

    def micro_batches(self, step_id: int) -> list[list[int]]:
        """The micro-batches of optimizer step ``step_id``."""
        first = sum(self.num_microbatches[:step_id])
        return self.micro_batch_indices[first: first + self.num_microbatches[step_id]]


#: per-sample columns from the rollout that a shard carries when the rollout produced them
PER_SAMPLE_COLUMNS = (
    "tokens", "response_lengths", "loss_masks", "rewards", "rollout_mask_sums", "truncated", "sample_indices",
    "rollout_ids", "round_number", "rollout_log_probs", "rollout_top_p_token_ids", "rollout_top_p_token_offsets",
    "rollout_routed_experts", "teacher_log_probs", "multimodal_train_inputs", "source_names", "prompt", "metadata",
)
#: per-sample columns the trainer computes (lists of float32 ``[R_i]`` tensors)
COMPUTED_COLUMNS = ("log_probs", "ref_log_probs", "entropy", "values", "kl", "advantages", "returns", "opd_reverse_kl")
_SCHEDULE_KEYS = tuple(f.name for f in dataclasses.fields(StepSchedule))
_SHARD_KEYS = ("partition", "raw_reward", "total_lengths", "dp_rank", "dp_size", "num_dropped_samples")


@dataclass
class TrainBatch:
    """One shard of a rollout step: per-sample columns, the whole-batch fields, the step schedule."""

    tokens: list[torch.Tensor]  # int64 [L_i]: prompt + response
    response_lengths: list[int]  # R_i
    loss_masks: list[torch.Tensor]  # int32 [R_i], 1 = trained token
    rewards: list[float]  # post-processed rewards (docs/INTERFACES.md §5.1)
    rollout_mask_sums: torch.Tensor  # float32 [n]: D_i, the loss-mask total of sample i's rollout in its step
    schedule: StepSchedule
    partition: list[int]  # global positions of the shard's samples in the rollout step
    raw_reward: list[float]  # whole batch: raw rewards of every sample of the step
    total_lengths: list[int]  # whole batch: L of every sample of the step
    dp_rank: int = 0
    dp_size: int = 1
    num_dropped_samples: int = 0  # samples of the step left out to fill whole optimizer steps
    # optional per-sample columns from the rollout (None when it did not produce them)
    truncated: list[int] | None = None
    sample_indices: list[int] | None = None  # Sample.index
    rollout_ids: list | None = None
    round_number: list | None = None
    rollout_log_probs: list[torch.Tensor] | None = None  # float32 [R_i]: log μ of the engine
    rollout_top_p_token_ids: list[torch.Tensor] | None = None  # int32: the engine's nucleus per position
    rollout_top_p_token_offsets: list[torch.Tensor] | None = None  # int32 [R_i + 1]
    rollout_routed_experts: list | None = None  # MoE experts the engine chose, per token and layer
    teacher_log_probs: list[torch.Tensor] | None = None  # float32 [R_i]
    multimodal_train_inputs: list | None = None
    source_names: list | None = None
    prompt: list | None = None
    metadata: list | None = None  # Sample.train_metadata
    # per-sample columns computed by the trainer (float32 [R_i] tensors)
    log_probs: list[torch.Tensor] | None = None  # π_old
    ref_log_probs: list[torch.Tensor] | None = None
    entropy: list[torch.Tensor] | None = None  # --use-rollout-entropy
    values: list[torch.Tensor] | None = None  # critic's V_old
    kl: list[torch.Tensor] | None = None  # shaping KL (docs/INTERFACES.md §5.2)
    advantages: list[torch.Tensor] | None = None
    returns: list[torch.Tensor] | None = None
    opd_reverse_kl: list[torch.Tensor] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys a user hook added to the dict view

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def local_total_lengths(self) -> list[int]:
        """L_i of the shard's samples."""
        return [int(t.numel()) for t in self.tokens]

    def replace(self, **columns) -> "TrainBatch":
        """A copy with ``columns`` set (the other columns shared, not copied)."""
        return dataclasses.replace(self, **columns)

    # ------------------------------------------------------------------ pickling (Ray's object store)

    def __getstate__(self) -> dict[str, Any]:
        """What a pickle holds: every column that is a list of 1-D CPU tensors of one dtype as ONE flat tensor
        and the lengths (:class:`_PackedColumn`). The rollout manager puts each shard in Ray's object store, and
        torch pickles every tensor's storage on its own, so one tensor a column costs a fraction of a tensor a
        sample (docs/loop.md, "Speed of the loop")."""
        state = dict(self.__dict__)
        for name, value in state.items():
            if _packable(value):
                state[name] = _PackedColumn(torch.cat(value), [int(t.numel()) for t in value])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Columns come back as lists of views of the flat tensor (one storage a column)."""
        for name, value in state.items():
            if isinstance(value, _PackedColumn):
                state[name] = list(torch.split(value.flat, value.lengths))
        self.__dict__.update(state)

    def __copy__(self) -> "TrainBatch":
        return dataclasses.replace(self)  # shallow, the tensors shared (pickling would copy them)

    def as_rollout_data(self) -> dict[str, Any]:
        """The documented ``rollout_data`` dict (docs/INTERFACES.md §2.9, §7.7): the shard's keys, the schedule
        keys, ``total_lengths_local`` and the computed columns present. Lists are shared with the
        record, so editing an element in place is seen by it too."""
        data: dict[str, Any] = {}
        for name in (*PER_SAMPLE_COLUMNS, *COMPUTED_COLUMNS, *_SHARD_KEYS):
            value = getattr(self, name)
            if value is not None:
                data[name] = value
        for name in _SCHEDULE_KEYS:
            data[name] = getattr(self.schedule, name)
        data["total_lengths_local"] = self.local_total_lengths
        data.update(self.extra)
        return data

    def with_rollout_data(self, data: dict[str, Any]) -> "TrainBatch":
        """This record with the values of ``data`` (a dict view a hook may have edited): known keys
        replace columns, unknown ones are kept in ``extra``; the schedule and shard keys are fixed."""
        fixed = set(_SCHEDULE_KEYS) | {"total_lengths_local", "dp_rank", "dp_size", "partition", "num_dropped_samples"}
        changes: dict[str, Any] = {}
        extra = dict(self.extra)
        for key, value in data.items():
            if key in fixed:
                continue
            if key in PER_SAMPLE_COLUMNS or key in COMPUTED_COLUMNS or key in ("raw_reward", "total_lengths"):
                changes[key] = value
            else:
                extra[key] = value
        for key in COMPUTED_COLUMNS:  # a hook may delete a computed column
            if key not in data and getattr(self, key) is not None:
                changes[key] = None
        return dataclasses.replace(self, **changes, extra=extra)

    @classmethod
    def from_rollout_data(cls, data: dict[str, Any]) -> "TrainBatch":
        """A record from a ``rollout_data`` dict with the docs/INTERFACES.md §7.7 keys (e.g. built by hand in a test)."""
        known = {f.name for f in dataclasses.fields(cls)} - {"schedule", "extra"}
        fields = {k: v for k, v in data.items() if k in known}
        schedule = StepSchedule(**{k: data[k] for k in _SCHEDULE_KEYS})
        extra = {k: v for k, v in data.items() if k not in known and k not in _SCHEDULE_KEYS and k != "total_lengths_local"}
        return cls(schedule=schedule, extra=extra, **fields)


@dataclass
class _PackedColumn:
    flat: torch.Tensor
    lengths: list[int]


def _packable(value: Any) -> bool:
    """A non-empty list of 1-D CPU tensors of one dtype, none needing gradients."""
    if not isinstance(value, list) or not value or not all(isinstance(t, torch.Tensor) for t in value):
        return False
    dtype = value[0].dtype
    return all(t.dim() == 1 and t.dtype == dtype and t.device.type == "cpu" and not t.requires_grad for t in value)
