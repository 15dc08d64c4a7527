"""Turn an agent session's model turns into trainable samples (docs/INTERFACES.md §6.6).

Each recorded turn carries the exact prompt ids sent to the engine and the ids and log-probs it
sampled. The manager keeps one message tree per session: a turn's prompt messages are matched from
the root (same dict), the unmatched rest is appended as context-only nodes, and the reply becomes a
generated node. Sub-agents, context compaction or edited histories therefore branch the tree.

``get_trajectory`` walks every root→leaf chain and packs its generated turns into sample builders:

* CLEAN: the builder's tokens are a prefix of the turn's prompt ids → append the prompt's new tail
  (loss mask 0) and the sampled ids (mask 1, their log-probs). Consecutive turns merge exactly when
  each prompt extends what is already held.
* REALIGN: the prompt departs from the held tokens inside the most recent response (the template
  re-rendered the previous reply, e.g. dropped its reasoning) and this turn's output is shorter than
  ``fork_threshold_tokens``: that response is replaced by the prompt's rendering (mask 0, it is no
  longer trained in this sample) and the turn is appended.
* FORK: anything else closes the builder; the turn starts a new sample.

A generated turn reached by several chains is trained only in the first; later chains hold it with
mask 0. Every sample of a session gets the same ``rollout_id`` (fan-out, §1.8) and reward.
"""

from __future__ import annotations

import copy
import logging
import threading
from dataclasses import dataclass, field

from slime.utils.types import Sample

logger = logging.getLogger(__name__)

DEFAULT_FORK_THRESHOLD_TOKENS = 1024


@dataclass(frozen=True)
class TurnRecord:
    """One model turn as the engine saw it: prompt ids in, sampled ids and their log-probs out."""

    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    output_log_probs: list[float] = field(default_factory=list)  # one per output id
    ill_formed: bool = False  # the reply held a tool call whose arguments were not a JSON object
    images: tuple = ()  # the prompt's images as the client sent them (paths, URLs, data URLs)
    multimodal_train_inputs: dict | None = None  # the processor's pixel values and grids of those images


@dataclass
class _Node:
    message: dict | None  # None for the root
    turn: TurnRecord | None = None  # set on generated (assistant reply) nodes
    metadata: dict = field(default_factory=dict)
    children: list["_Node"] = field(default_factory=list)


@dataclass
class _Builder:
    tokens: list[int]
    loss_mask: list[int]
    log_probs: list[float]
    prompt_length: int
    last_response_start: int = 0
    truncated: bool = False
    use_tool: bool = False
    ill_formed: bool = False
    images: tuple = ()  # of the last turn, whose prompt the held tokens extend: every image in them
    multimodal_train_inputs: dict | None = None

    @classmethod
    def start(cls, prompt_ids: list[int]) -> "_Builder":
        n = len(prompt_ids)
        return cls(tokens=list(prompt_ids), loss_mask=[0] * n, log_probs=[0.0] * n, prompt_length=n)

    def extend_context(self, ids: list[int]) -> None:
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)

    def add_turn(self, node: _Node, trained: bool) -> None:
        turn = node.turn
        self.last_response_start = len(self.tokens)
        self.tokens += turn.output_ids
        if trained:
            self.loss_mask += [1] * len(turn.output_ids)
            self.log_probs += [float(x) for x in turn.output_log_probs]
        else:
            self.loss_mask += [0] * len(turn.output_ids)
            self.log_probs += [0.0] * len(turn.output_ids)
        self.truncated = turn.finish_reason == "length"
        self.use_tool = self.use_tool or bool(node.message.get("tool_calls"))
        self.ill_formed = self.ill_formed or turn.ill_formed
        self.images, self.multimodal_train_inputs = turn.images, turn.multimodal_train_inputs


def _same_message(a: dict, b: dict) -> bool:
    """Messages match when equal apart from ``reasoning_content``: some clients echo the reasoning we
    sent, others strip it; either way it is the same turn (its tokens are compared separately)."""
    return {k: v for k, v in a.items() if k != "reasoning_content"} == \
        {k: v for k, v in b.items() if k != "reasoning_content"}


def _divergence(held: list[int], prompt: list[int]) -> int:
    n = min(len(held), len(prompt))
    for i in range(n):
        if held[i] != prompt[i]:
            return i
    return n


class TrajectoryManager:
    """Per-session message trees of recorded turns; thread-safe (turns are recorded on the adapter's
    event loop, trajectories are taken from the rollout's)."""

    def __init__(self, *, fork_threshold_tokens: int | None = None):
        self.fork_threshold = DEFAULT_FORK_THRESHOLD_TOKENS if fork_threshold_tokens is None else fork_threshold_tokens
        if self.fork_threshold < 0:
            raise ValueError(f"fork_threshold_tokens must be >= 0 (0 disables realignment), got {self.fork_threshold}")
        self._trees: dict[str, _Node] = {}
        self._turns: dict[str, int] = {}
        self._lock = threading.Lock()

    def has_session(self, sid: str) -> bool:
        with self._lock:
            return sid in self._trees

    def turn_count(self, sid: str) -> int:
        with self._lock:
            return self._turns.get(sid, 0)

    def drop_session(self, sid: str) -> None:
        with self._lock:
            self._trees.pop(sid, None)
            self._turns.pop(sid, None)

    def record_turn(self, sid: str, *, turn: TurnRecord, prompt_messages: list[dict], response_message: dict,
                    metadata: dict | None = None) -> None:
        if len(turn.output_log_probs) != len(turn.output_ids):
            raise ValueError(f"turn of session {sid!r}: {len(turn.output_ids)} output ids but "
                             f"{len(turn.output_log_probs)} log-probs")
        with self._lock:
            node = self._trees.setdefault(sid, _Node(message=None))
            self._turns[sid] = self._turns.get(sid, 0) + 1
            remaining = list(prompt_messages)
            while remaining:
                message = remaining[0]
                child = next((c for c in node.children if _same_message(c.message, message)), None)
                if child is None:
                    child = self._rewritten_echo(node, message)
                if child is None:
                    break
                node = child
                remaining.pop(0)
            for message in remaining:
                child = _Node(message=copy.deepcopy(message))
                node.children.append(child)
                node = child
            node.children.append(_Node(message=copy.deepcopy(response_message), turn=turn, metadata=dict(metadata or {})))

    def _rewritten_echo(self, node: _Node, message: dict) -> _Node | None:
        """Rewrite merge: the client sent back our last reply re-rendered (whitespace, key order...).
        The reply stops being trained; its replacement is matched instead."""
        if message.get("role") != "assistant" or self.fork_threshold <= 0:
            return None
        replies = [c for c in node.children if c.message.get("role") == "assistant"]
        if len(replies) != 1 or replies[0].turn is None:
            return None
        reply = replies[0]
        if len(reply.turn.output_ids) >= self.fork_threshold:
            return None
        reply.message = copy.deepcopy(message)
        reply.turn = None
        return reply

    def get_trajectory(self, sid: str, *, base_sample: Sample, reward=0.0, extra_metadata: dict | None = None,
                       max_sample_tokens: int = 0) -> list[Sample]:
        """Consume the session and return its samples (empty if it recorded no trainable turn)."""
        with self._lock:
            root = self._trees.pop(sid, None)
            self._turns.pop(sid, None)
        if root is None:
            return []
        builders: list[_Builder] = []
        trained_nodes: set[int] = set()
        for chain in _chains(root):
            builder = None
            for node in chain:
                if node.turn is None:
                    continue
                trained = id(node) not in trained_nodes
                trained_nodes.add(id(node))
                builder = self._place(builder, builders, node)
                builder.add_turn(node, trained)
            if builder is not None:
                builders.append(builder)
        rollout_id = base_sample.rollout_id if base_sample.rollout_id is not None else base_sample.index
        samples = []
        for builder in builders:
            sample = _emit(builder, base_sample, rollout_id, reward, extra_metadata, max_sample_tokens)
            if sample is not None:
                samples.append(sample)
        return samples

    def _place(self, builder: _Builder | None, closed: list[_Builder], node: _Node) -> _Builder:
        """The builder this turn goes into: the same one (CLEAN / REALIGN) or a new one (FORK)."""
        prompt = node.turn.prompt_ids
        if builder is not None:
            split = _divergence(builder.tokens, prompt)
            if split == len(builder.tokens):  # CLEAN
                builder.extend_context(prompt[split:])
                return builder
            realign = (self.fork_threshold > 0 and split >= builder.last_response_start
                       and len(node.turn.output_ids) < self.fork_threshold)
            if realign:
                start = builder.last_response_start
                del builder.tokens[start:], builder.loss_mask[start:], builder.log_probs[start:]
                builder.extend_context(prompt[start:])
                return builder
            closed.append(builder)
        return _Builder.start(prompt)


def _chains(root: _Node) -> list[list[_Node]]:
    chains, stack = [], [(root, [])]
    while stack:
        node, path = stack.pop()
        path = path + [node] if node.message is not None else path
        if not node.children:
            if path:
                chains.append(path)
            continue
        stack.extend((child, path) for child in reversed(node.children))
    return chains


def _emit(builder: _Builder, base: Sample, rollout_id, reward, extra_metadata, max_tokens: int) -> Sample | None:
    tokens, mask, log_probs = builder.tokens, builder.loss_mask, builder.log_probs
    if max_tokens and max_tokens > 0 and len(tokens) > max_tokens:
        tokens, mask, log_probs = tokens[:max_tokens], mask[:max_tokens], log_probs[:max_tokens]
    start = min(builder.prompt_length, len(tokens))
    if not any(mask[start:]):
        return None
    metadata = dict(extra_metadata or {})
    metadata.update(truncated=builder.truncated, use_tool=builder.use_tool, ill_formed=builder.ill_formed)
    return Sample(
        index=base.index,
        group_index=base.group_index,
        rollout_id=rollout_id,
        prompt=copy.deepcopy(base.prompt),
        label=copy.deepcopy(base.label),
        tokens=list(tokens),
        response_length=len(tokens) - start,
        loss_mask=list(mask[start:]),
        rollout_log_probs=list(log_probs[start:]),
        reward=reward,
        status=Sample.Status.COMPLETED,
        metadata=metadata,
        multimodal_inputs={"images": list(builder.images)} if builder.images else None,
        multimodal_train_inputs=builder.multimodal_train_inputs,
    )


def failed_episode(sample: Sample, reason: str, **metadata) -> Sample:
    """The slot of an episode that broke (docs/INTERFACES.md §6.6): aborted, removed from training, reward 0, a
    one-token placeholder response; ``reason`` in ``metadata["agent_error"]`` with any further ``metadata``."""
    sample.status = Sample.Status.ABORTED
    sample.remove_sample = True
    sample.tokens, sample.response_length, sample.loss_mask, sample.rollout_log_probs = [0, 0], 1, [0], [0.0]
    sample.reward = 0.0
    sample.metadata = {**(sample.metadata or {}), "agent_error": reason, **metadata}
    return sample
