"""Public record types: :class:`Sample` (the unit of rollout and training data) and friends.

``Sample`` is a plain mutable dataclass on purpose: plugins attach attributes to it, compare it,
deep-copy it and serialise it with :meth:`Sample.to_dict` / :meth:`Sample.from_dict`.
"""

from __future__ import annotations

import base64
import functools
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple, Union

from slime.utils.passthrough import sglang_value

if TYPE_CHECKING:  # torch is heavy; only needed for annotations here
    import torch


def _to_int_list(values) -> list[int]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [int(v) for v in values]


def _to_float_list(values) -> list[float]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [float(v) for v in values]


def _decode_int32_list(value) -> list[int]:
    """Decode top-p / routed-expert payloads: base64 of little-endian int32, raw bytes, tensor or list."""
    if value is None:
        return []
    if isinstance(value, str):
        value = base64.b64decode(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        import numpy as np

        return np.frombuffer(bytes(value), dtype="<i4").astype(int).tolist()
    return _to_int_list(value)


def routed_experts_layout(args) -> tuple[int, int]:
    """``(layers, top-k)`` of the engine's ``routed_experts`` rows: Megatron's ``--num-layers`` /
    ``--moe-router-topk`` when given, else the HF config of ``--hf-checkpoint`` (the FSDP backend)."""
    if args.num_layers:
        return int(args.num_layers), int(args.moe_router_topk)
    path = args.hf_checkpoint
    if not path:
        raise ValueError("routed_experts in meta_info: set --num-layers / --moe-router-topk or --hf-checkpoint "
                         "(the layout of the engine's routed experts)")
    return _hf_routed_layout(str(path))


@functools.lru_cache(maxsize=8)
def _hf_routed_layout(path: str) -> tuple[int, int]:
    from transformers import AutoConfig

    from slime.utils.moe_routing import routed_layout

    return routed_layout(AutoConfig.from_pretrained(path))


def _first_of(meta_info: dict, *names: str):
    """The first of ``names`` present (not None) in ``meta_info``, else 0."""
    for name in names:
        if meta_info.get(name) is not None:
            return meta_info[name]
    return 0


@dataclass
class Sample:
    """One generated response (or one segment of a multi-turn rollout) and everything known about it.

    Invariant: ``len(tokens) - response_length`` is the prompt length; ``loss_mask``,
    ``rollout_log_probs`` and ``teacher_log_probs`` are indexed over the last ``response_length``
    tokens.
    """

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    @dataclass
    class SpecInfo:
        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        @property
        def spec_accept_rate(self) -> float:
            return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num else 0

        @property
        def spec_accept_length(self) -> float:
            return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct else 0

        def add(self, meta_info: dict) -> None:
            # SGLang >= 0.5.15 names the counters spec_num_correct_drafts / spec_num_proposed_drafts (aliases
            # spec_accepted_drafts / spec_proposed_drafts); older and patched builds spec_accept_token_num /
            # spec_draft_token_num (docs/SGLANG_PROTOCOL.md §2.4, §13)
            self.spec_accept_token_num += int(_first_of(meta_info, "spec_accept_token_num", "spec_num_correct_drafts",
                                                        "spec_accepted_drafts"))
            self.spec_draft_token_num += int(_first_of(meta_info, "spec_draft_token_num", "spec_num_proposed_drafts",
                                                       "spec_proposed_drafts"))
            self.spec_verify_ct += int(meta_info.get("spec_verify_ct") or 0)
            self.completion_token_num += int(meta_info.get("completion_tokens") or 0)

        def to_dict(self) -> dict:
            return {
                "spec_accept_token_num": self.spec_accept_token_num,
                "spec_draft_token_num": self.spec_draft_token_num,
                "spec_verify_ct": self.spec_verify_ct,
                "completion_token_num": self.completion_token_num,
            }

        @staticmethod
        def from_dict(d: dict | None) -> "Sample.SpecInfo":
            d = d or {}
            return Sample.SpecInfo(**{f.name: int(d.get(f.name, 0)) for f in fields(Sample.SpecInfo)})

    @dataclass
    class PrefixCacheInfo:
        cached_tokens: int = 0
        total_prompt_tokens: int = 0

        @property
        def prefix_cache_hit_rate(self) -> float:
            return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0

        def add(self, meta_info: dict) -> None:
            self.cached_tokens += int(meta_info.get("cached_tokens") or 0)
            self.total_prompt_tokens += int(meta_info.get("prompt_tokens") or 0)

        def to_dict(self) -> dict:
            return {"cached_tokens": self.cached_tokens, "total_prompt_tokens": self.total_prompt_tokens}

        @staticmethod
        def from_dict(d: dict | None) -> "Sample.PrefixCacheInfo":
            d = d or {}
            return Sample.PrefixCacheInfo(
                cached_tokens=int(d.get("cached_tokens", 0)), total_prompt_tokens=int(d.get("total_prompt_tokens", 0))
            )

    group_index: int | None = None
    """Prompt-group index assigned by the data source; shared by the group's samples."""
    index: int | None = None
    """Globally unique sample index assigned by the data source (join key for dumps)."""
    rollout_id: int | None = None
    """Identity of the rollout execution; samples of one fan-out share it. None = own rollout."""
    prompt: Union[str, list[dict[str, Any]]] = ""
    """Prompt text (chat-templated) or a list of chat messages."""
    tokens: list[int] = field(default_factory=list)
    """Prompt token ids followed by response token ids."""
    multimodal_inputs: dict[str, Any] | None = None
    """Raw multimodal data extracted from the prompt messages."""
    multimodal_train_inputs: dict[str, Any] | None = None
    """Processor outputs the trainer needs (pixel values, grids), without input ids."""
    multimodal_train_input_id: str | None = None
    """Optional cache key for ``multimodal_train_inputs``."""
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    """Per-sample chat-template keyword arguments (for custom code)."""
    response: str = ""
    """Decoded response text."""
    response_length: int = 0
    """Number of trailing entries of ``tokens`` that form the response region."""
    label: str | None = None
    """Ground truth from ``--label-key``."""
    reward: float | dict[str, Any] | None = None
    """Reward; None = not yet scored. A dict needs ``--reward-key``."""
    loss_mask: list[int] | None = None
    """Per response token: 1 = trained, 0 = context only. None = all ones."""
    weight_versions: list[str] = field(default_factory=list)
    """Engine weight version of every generation call that produced this sample."""
    rollout_log_probs: list[float] | None = None
    """Engine log-probs of the response tokens (0.0 for non-trainable tokens)."""
    rollout_top_p_token_ids: Any = None
    """Ragged token ids kept by the engine's top-p nucleus (CSR values)."""
    rollout_top_p_token_offsets: Any = None
    """CSR offsets into ``rollout_top_p_token_ids``; ``response_length + 1`` entries."""
    rollout_routed_experts: Any = None
    """MoE routing captured at rollout, ``[len(tokens)-1, num_layers, topk]``."""
    remove_sample: bool = False
    """Keep in bookkeeping but train on none of its tokens."""
    teacher_log_probs: list[float] | None = None
    """Teacher log-probs over the response (on-policy distillation)."""
    status: Status = Status.PENDING
    """Generation status."""
    metadata: dict = field(default_factory=dict)
    """Free-form per-sample data (``--metadata-key`` content and framework keys)."""
    generate_function_path: str | None = None
    """Per-sample override of ``--custom-generate-function-path``."""
    custom_rm_path: str | None = None
    """Per-sample override of ``--custom-rm-path``."""
    train_metadata: dict | None = None
    """Opaque info forwarded to the trainer as ``metadata``."""
    session_id: str | None = None
    """Session identity for router affinity (``X-SMG-Routing-Key``)."""
    non_generation_time: float = 0.0
    """Seconds spent outside generation (tools, sandboxes)."""
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    """Speculative-decoding counters."""
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)
    """Prefix-cache counters."""

    def __post_init__(self):
        if isinstance(self.status, str):
            self.status = Sample.Status(self.status)

    # ---------------------------------------------------------------- accessors

    def get_reward_value(self, args) -> float:
        """The scalar reward: ``reward`` itself, or ``reward[args.reward_key]`` when a key is set."""
        key = args.reward_key
        if not key:
            return self.reward
        if not isinstance(self.reward, dict):
            raise TypeError(f"--reward-key {key!r} is set but sample {self.index} has a non-dict reward {self.reward!r}")
        if key not in self.reward:
            raise KeyError(f"--reward-key {key!r} not in reward of sample {self.index}: keys {sorted(self.reward)}")
        return self.reward[key]

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    # ---------------------------------------------------------------- serialisation

    def to_dict(self) -> dict:
        value = dict(self.__dict__)
        value["status"] = self.status.value
        value["spec_info"] = self.spec_info.to_dict()
        value["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return value

    @staticmethod
    def from_dict(data: dict) -> "Sample":
        data = dict(data)
        if "status" not in data:
            raise KeyError("Sample.from_dict needs a 'status' key (one of %s)" % [s.value for s in Sample.Status])
        data["status"] = Sample.Status(data["status"])
        data["spec_info"] = Sample.SpecInfo.from_dict(data.get("spec_info"))
        data["prefix_cache_info"] = Sample.PrefixCacheInfo.from_dict(data.get("prefix_cache_info"))
        known = {f.name for f in fields(Sample)}
        sample = Sample(**{k: v for k, v in data.items() if k in known})
        for key, value in data.items():
            if key not in known:
                setattr(sample, key, value)
        return sample

    # ---------------------------------------------------------------- growing a sample

    def append_response_tokens(
        self,
        args=None,
        *,
        tokens=None,
        log_probs=None,
        trainable: bool = True,
        meta_info: dict | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """Append generated (trainable) or environment (non-trainable) tokens to the response.

        Trainable tokens need their engine log-probs; non-trainable tokens get log-prob 0.0 and mask 0.
        ``meta_info`` (SGLang's ``meta_info``) also carries top-p replay data, routed experts and the
        terminal info (finish reason → status, weight version, cache/spec counters).
        """
        new_tokens = _to_int_list(tokens) if tokens is not None else []
        new_log_probs = _to_float_list(log_probs) if log_probs is not None else None
        n = len(new_tokens)
        if new_log_probs is not None and len(new_log_probs) != n:
            raise ValueError(f"log_probs has {len(new_log_probs)} entries but tokens has {n}")
        if trainable and n and new_log_probs is None:
            raise ValueError("trainable tokens need log_probs (pass trainable=False for environment tokens)")
        if not trainable and new_log_probs is not None:
            raise ValueError("non-trainable tokens must not carry log_probs; they get 0.0")
        if trainable and n and self.rollout_log_probs is None and self.response_length > 0:
            raise ValueError(
                "cannot append trainable log-probs to a sample whose existing response has no rollout_log_probs"
            )

        if not n and not text and meta_info is not None:
            # meta_info alone (e.g. a turn that ended without new tokens): only the terminal info moves;
            # the response, its mask and log-probs stay exactly as they were
            if update_terminal_info and "finish_reason" in meta_info:
                self._update_terminal_info(args, meta_info)
            return

        old_response_length = self.response_length
        if text:
            self.response += text
        if self.loss_mask is None:
            self.loss_mask = [1] * old_response_length
        if self.rollout_log_probs is None:
            self.rollout_log_probs = [0.0] * old_response_length
        self.tokens = list(self.tokens) + new_tokens
        self.response_length = old_response_length + n
        self.loss_mask = list(self.loss_mask) + [1 if trainable else 0] * n
        self.rollout_log_probs = list(self.rollout_log_probs) + (new_log_probs if trainable else [0.0] * n)

        top_p_active = self.rollout_top_p_token_offsets is not None
        if meta_info is not None or (not trainable and top_p_active):
            self._merge_top_p(meta_info or {}, n, old_response_length, trainable)
            if meta_info is not None and meta_info.get("routed_experts") is not None:
                self._merge_routed_experts(args, meta_info)

        if update_terminal_info and meta_info is not None and "finish_reason" in meta_info:
            self._update_terminal_info(args, meta_info)
        self._validate_lengths()

    def _merge_top_p(self, meta_info: dict, n: int, old_response_length: int, trainable: bool) -> None:
        ids = meta_info.get("top_p_token_ids", meta_info.get("top_p_kept_token_ids"))
        offsets = meta_info.get("top_p_token_offsets", meta_info.get("top_p_kept_token_offsets"))
        if ids is None and offsets is None and self.rollout_top_p_token_offsets is None:
            return
        if self.rollout_top_p_token_offsets is None:
            self.rollout_top_p_token_ids = []
            self.rollout_top_p_token_offsets = [0] * (old_response_length + 1)
        base_ids = _to_int_list(self.rollout_top_p_token_ids)
        base_offsets = _to_int_list(self.rollout_top_p_token_offsets)
        if trainable and (ids is not None or offsets is not None):
            new_ids, new_offsets = _decode_int32_list(ids), _decode_int32_list(offsets)
            if len(new_offsets) != n + 1 or new_offsets[0] != 0 or new_offsets[-1] != len(new_ids):
                raise ValueError(
                    f"top-p offsets must have {n + 1} entries starting at 0 and ending at {len(new_ids)}; "
                    f"got {len(new_offsets)} entries"
                )
            shift = base_offsets[-1]
            base_ids += new_ids
            base_offsets += [shift + o for o in new_offsets[1:]]
        else:  # non-trainable (or no data): empty spans
            base_offsets += [base_offsets[-1]] * n
        self.rollout_top_p_token_ids = base_ids
        self.rollout_top_p_token_offsets = base_offsets

    def _merge_routed_experts(self, args, meta_info: dict) -> None:
        if args is None:
            raise ValueError("routed_experts in meta_info needs args (num_layers, moe_router_topk)")
        import numpy as np

        flat = np.asarray(_decode_int32_list(meta_info["routed_experts"]), dtype=np.int64)
        layers, topk = routed_experts_layout(args)
        start = int(meta_info.get("routed_experts_start_len", 0) or 0)
        rows = len(self.tokens) - 1 - start
        if flat.size != rows * layers * topk:
            raise ValueError(f"meta_info.routed_experts holds {flat.size} ids, expected [len(tokens) - 1 - start = {rows}, "
                             f"layers = {layers}, top-k = {topk}] (sample {self.index})")
        experts = flat.reshape(rows, layers, topk).tolist()
        existing = self.rollout_routed_experts
        if hasattr(existing, "tolist"):
            existing = existing.tolist()
        self.rollout_routed_experts = (list(existing or [])[:start]) + experts

    def _update_terminal_info(self, args, meta_info: dict) -> None:
        if args is not None and sglang_value(args, "sglang_speculative_algorithm"):
            self.spec_info.add(meta_info)
        self.prefix_cache_info.add(meta_info)
        if meta_info.get("weight_version") is not None:
            self.weight_versions.append(str(meta_info["weight_version"]))
        finish = meta_info["finish_reason"]
        finish_type = finish.get("type") if isinstance(finish, dict) else finish
        status = {"length": Sample.Status.TRUNCATED, "abort": Sample.Status.ABORTED, "stop": Sample.Status.COMPLETED}
        if finish_type in status:
            self.status = status[finish_type]

    def _validate_lengths(self) -> None:
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries, response_length is {self.response_length}")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
            raise ValueError(
                f"rollout_log_probs has {len(self.rollout_log_probs)} entries, response_length is {self.response_length}"
            )
        ids, offsets = self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets
        if (ids is None) != (offsets is None):
            raise ValueError("rollout_top_p_token_ids and rollout_top_p_token_offsets must be set together")
        if offsets is not None:
            if len(offsets) != self.response_length + 1 or int(offsets[-1]) != len(ids):
                raise ValueError(
                    f"top-p offsets must have response_length + 1 = {self.response_length + 1} entries ending at "
                    f"{len(ids)}; got {len(offsets)} ending at {int(offsets[-1]) if len(offsets) else None}"
                )


@dataclass(frozen=True)
class ParamInfo:
    """Describes one parameter for weight-update bucketing."""

    name: str
    dtype: "torch.dtype"
    shape: "torch.Size"
    attrs: dict
    size: int
    src_rank: int


RolloutBatch = dict[str, Union[list, list[int], list[float], list[str]]]
"""Training data: per-sample lists of tensors or scalars, keyed by field name (docs/INTERFACES.md §7.7)."""


class MultimodalType(NamedTuple):
    name: str
    placeholder: str


class MultimodalTypes:
    IMAGE = MultimodalType("image", "<image>")
    VIDEO = MultimodalType("video", "<video>")
    AUDIO = MultimodalType("audio", "<audio>")

    @classmethod
    def all(cls) -> list[MultimodalType]:
        return [cls.IMAGE, cls.VIDEO, cls.AUDIO]

    @classmethod
    def get(cls, name: str) -> MultimodalType | None:
        return next((t for t in cls.all() if t.name == name), None)
