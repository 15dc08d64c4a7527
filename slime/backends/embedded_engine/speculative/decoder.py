"""Speculative decoding for the embedded engine: draft k tokens cheaply, verify them in one forward.

A decode step with speculation (``--speculative-algorithm NGRAM``, ``STANDALONE`` or ``NEXTN``):

1. **Draft.** Every running row proposes up to ``k = --speculative-num-draft-tokens - 1`` tokens
   ``x_1..x_k`` (fewer near its ``max_new_tokens``):
   * ``NGRAM`` (prompt lookup): find the earlier occurrence of the longest suffix (at most
     ``--speculative-ngram-max-trie-depth`` tokens) of prompt + output, the most recent one on ties,
     and propose the tokens that followed it. The draft distribution ``q`` is a point mass.
   * ``STANDALONE``: a second, small HF checkpoint (``--speculative-draft-model-path``) with its own
     :class:`ModelRunner` and slot cache samples ``x_j ~ q_j``, ``q_j`` processed exactly like the
     target's (temperature, top-k, top-p, min-p, banned stop ids). Its cache catches up lazily: a row
     first feeds the draft what it has not seen (the prompt, then the tokens accepted since).
   * ``NEXTN`` (SGLang's ``EAGLE`` with the model's own MTP layer, :mod:`mtp`): the model's
     multi-token-prediction block, fed the target's hidden states of the verified positions and its
     own output when chained, samples ``x_j ~ q_j`` the same way, in its own one-layer slot cache.
2. **Verify.** One batched forward of the target over ``[last token, x_1..x_k]`` per row gives
   ``p_1..p_{k+1}``: a decode step of ``T = --speculative-num-draft-tokens`` tokens a row
   (``ModelRunner.verify``; on CUDA replayed from a CUDA graph), rows with fewer drafts padded after
   them; where that does not apply (``--mla-decode expanded``, a row whose ``T`` positions would pass
   its slot's end) the generic forward, rows left-padded.
3. **Accept** (:mod:`acceptance`; Leviathan et al. 2023, "Fast Inference from Transformers via
   Speculative Decoding"; Chen et al. 2023): ``x_j`` is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``, in order;
   at the first rejection the row emits a token from the residual ``norm(max(p_j - q_j, 0))``, and if
   all ``k`` are accepted a bonus token from ``p_{k+1}``. The emitted tokens then follow the target's
   distribution exactly; a greedy row (``p`` one-hot) accepts exactly the drafts that equal the
   argmax, so greedy output equals non-speculative greedy output.
4. **Emit** the tokens one by one through the engine's usual stop checks (stop ids, stop strings,
   ``max_new_tokens``), with the *target's* log-probs ``log_softmax(logits / T)`` of each emitted
   token. A row's slot length becomes ``prompt + output - 1`` again; the keys/values written for
   rejected drafts lie past it, are masked out of every later read and are overwritten before any
   position is read again.

When no row has a draft the step is an ordinary decode step (on CUDA it may run ahead). Per-request
counters go to ``meta_info`` under SGLang's names (:func:`spec_meta_info`).
"""

from __future__ import annotations

import abc
import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from slime.backends.embedded_engine.model_runner import ForwardRow, ModelRunner
from slime.backends.embedded_engine.sampler import RowSampling, greedy_distribution, sampling_distribution, to_device
from slime.backends.embedded_engine.speculative.acceptance import accept_drafts, accept_greedy, draw

if TYPE_CHECKING:
    from slime.backends.embedded_engine.scheduler import Scheduler, Sequence


class DecodingEngine(Protocol):
    """What a speculative step uses of the engine that runs it (``engine.Engine``): its runner, its scheduler's
    counters and generator, each row's sampling settings, and emitting tokens through its stop checks. The engine
    hands itself to :meth:`SpeculativeDecoder.step`; this module does not import it."""

    runner: ModelRunner
    scheduler: "Scheduler"
    generator: torch.Generator

    def row_sampling(self, seq: "Sequence", ahead: int = 0) -> RowSampling: ...

    def append_tokens(self, results: list[tuple["Sequence", int, float]]) -> int: ...


ALGORITHMS = ("NGRAM", "STANDALONE", "NEXTN")
#: SGLang routes NEXTN to EAGLE, whose draft for a DeepSeek-V3-family model with no
#: --speculative-draft-model-path is the model's own MTP layer: both spellings run NEXTN here
ALIASES = {"EAGLE": "NEXTN"}
#: SGLang's algorithms the embedded engine does not run, and why
UNSUPPORTED_ALGORITHMS = {
    "EAGLE3": "EAGLE3 needs an EAGLE3 draft head trained on the target's hidden states",
    "FROZEN_KV_MTP": "FROZEN_KV_MTP needs a frozen-KV MTP assistant draft",
    "DFLASH": "DFLASH needs a DFlash block-diffusion draft",
    "DSPARK": "DSPARK needs a DSpark draft",
    "UNO": "UNO needs an UNO draft LoRA",
}
#: SGLang's defaults: NGRAM verifies 12 tokens (11 drafts), STANDALONE and NEXTN (DeepSeek-V3) draft 3 steps
DEFAULT_DRAFT_TOKENS = {"NGRAM": 12, "STANDALONE": 4, "NEXTN": 4}
#: seeded requests: the draws of drafts come from their own stream (acceptance.ACCEPT_STREAM: the acceptance
#: tests'; integers: ``hash`` of a tuple of ints is the same in every process, unlike that of a string)
DRAFT_STREAM = 1
NGRAM_CANDIDATES = 64  # earlier occurrences of the last token examined per proposal (bounds host time)
NGRAM_MAX_BACKOFF = 16  # output tokens an NGRAM row pauses its lookups at most (doubling from 1)
#: verify steps as T-token decode steps (ModelRunner.verify; CUDA graphs on CUDA) where the runner can;
#: SLIME_SPEC_VERIFY_DECODE=0 keeps the generic forward (the A/B of bench/spec_decode.py's "-eager" engines)
VERIFY_AS_DECODE_STEP = os.environ.get("SLIME_SPEC_VERIFY_DECODE", "1") != "0"


@dataclass(frozen=True)
class SpeculativeConfig:
    algorithm: str  # NGRAM, STANDALONE or NEXTN
    num_draft_tokens: int  # verified tokens per step: the last token + num_draft_tokens - 1 drafts
    draft_model_path: str | None = None
    ngram_max_match: int = 18  # --speculative-ngram-max-trie-depth
    adaptive: bool = False  # --speculative-adaptive: the drafts a step follow acceptance and batch size
    adaptive_config: str | None = None  # --speculative-adaptive-config (JSON; None: SGLang's defaults)

    @property
    def max_drafts(self) -> int:
        return self.num_draft_tokens - 1


def resolve_config(algorithm: str | None, draft_model_path: str | None, num_steps: int | None,
                   num_draft_tokens: int | None, eagle_topk: int | None, ngram_max_trie_depth: int,
                   model_path: str | None = None, adaptive: bool = False,
                   adaptive_config: str | None = None) -> SpeculativeConfig | None:
    """The engine's speculative settings from SGLang's flags (None: speculation off); raises with the
    flag names for values the engine does not implement."""
    if adaptive_config is not None and not adaptive:
        raise ValueError(f"--speculative-adaptive-config {adaptive_config} needs --speculative-adaptive")
    if algorithm is None and adaptive:
        raise ValueError("--speculative-adaptive needs --speculative-algorithm (NGRAM, STANDALONE or NEXTN)")
    if algorithm is None:
        for flag, value in (("--speculative-draft-model-path", draft_model_path), ("--speculative-num-steps", num_steps),
                            ("--speculative-num-draft-tokens", num_draft_tokens)):
            if value is not None:
                raise ValueError(f"{flag} {value} needs --speculative-algorithm (NGRAM, STANDALONE or NEXTN)")
        return None
    name = ALIASES.get(algorithm.upper(), algorithm.upper())
    if name in UNSUPPORTED_ALGORITHMS:
        raise ValueError(f"--speculative-algorithm {algorithm}: {UNSUPPORTED_ALGORITHMS[name]}, which the embedded "
                         f"engine does not run; use NGRAM (prompt lookup), STANDALONE (a small draft model) or "
                         f"NEXTN (the model's own MTP layer)")
    if name not in ALGORITHMS:
        raise ValueError(f"--speculative-algorithm {algorithm!r} is unknown; the embedded engine runs {ALGORITHMS}")
    if eagle_topk not in (None, 1):
        raise ValueError(f"--speculative-eagle-topk {eagle_topk}: the embedded engine verifies one chain of drafts "
                         "(tree drafts are not implemented); use 1 or leave it unset")
    if name == "STANDALONE" and not draft_model_path:
        raise ValueError("--speculative-algorithm STANDALONE needs --speculative-draft-model-path DIR "
                         "(a small HF checkpoint with the target's tokenizer)")
    if name == "NGRAM" and draft_model_path:
        raise ValueError("--speculative-draft-model-path is for --speculative-algorithm STANDALONE; "
                         "NGRAM drafts from the prompt and output")
    if name == "NEXTN" and draft_model_path and draft_model_path != model_path:
        raise ValueError(f"--speculative-algorithm {algorithm} --speculative-draft-model-path {draft_model_path}: the "
                         "embedded engine drafts NEXTN/EAGLE with the MTP layer of --model-path itself (a separate "
                         "EAGLE draft head is not implemented); drop the draft path")
    if num_steps is not None and num_steps < 1:
        raise ValueError(f"--speculative-num-steps must be >= 1, got {num_steps}")
    if num_draft_tokens is not None and num_draft_tokens < 2:
        raise ValueError(f"--speculative-num-draft-tokens must be >= 2 (the last token + at least one draft), "
                         f"got {num_draft_tokens}")
    if num_steps is not None and num_draft_tokens is not None and num_draft_tokens != num_steps + 1:
        raise ValueError(f"--speculative-num-draft-tokens {num_draft_tokens} must be --speculative-num-steps + 1 "
                         f"({num_steps + 1}) for a chain of drafts; give one of the two")
    tokens = num_draft_tokens or (num_steps + 1 if num_steps is not None else DEFAULT_DRAFT_TOKENS[name])
    if ngram_max_trie_depth < 1:
        raise ValueError(f"--speculative-ngram-max-trie-depth must be >= 1, got {ngram_max_trie_depth}")
    if adaptive:
        from slime.backends.embedded_engine.speculative.adaptive import load_config

        load_config(adaptive_config)  # a malformed file fails at start, naming itself
    return SpeculativeConfig(name, tokens, draft_model_path if name == "STANDALONE" else None, ngram_max_trie_depth,
                             adaptive, adaptive_config)


@dataclass
class SpecState:
    """One request's speculative bookkeeping (``Sequence.spec``)."""

    verify_ct: int = 0  # decode steps (target forwards after prefill) of this request
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the verifier accepted
    histogram: list[int] = field(default_factory=list)  # histogram[a]: verify steps that accepted a drafts
    draft_computed: int = 0  # STANDALONE / NEXTN: positions of this request in the draft's slot cache
    # NEXTN: the target's final hidden states of positions draft_computed .. num_computed - 1 ([n, H]; None:
    # none), which the MTP layer has not consumed; its own last output and where its next chained step goes
    hidden: torch.Tensor | None = None
    chain_hidden: torch.Tensor | None = None
    chain_position: int = 0
    ngram_index: dict[int, list[int]] = field(default_factory=dict)  # NGRAM: token -> positions
    ngram_indexed: int = 0  # tokens of prompt + output in ngram_index
    # NGRAM back-off: after a lookup that found nothing or drafts that were all rejected the row does not
    # draft until it has resume_at output tokens (the pause doubles each time up to NGRAM_MAX_BACKOFF, and
    # ends at the first accepted draft)
    backoff: int = 0
    resume_at: int = 0

    def add_hidden(self, hidden: torch.Tensor) -> None:
        """NEXTN: the target's hidden states of the next computed positions."""
        self.hidden = hidden.clone() if self.hidden is None else torch.cat((self.hidden, hidden))

    def back_off(self, output_length: int) -> None:
        self.backoff = min(max(1, 2 * self.backoff), NGRAM_MAX_BACKOFF)
        self.resume_at = output_length + self.backoff

    def count_step(self, proposed: int, accepted: int) -> None:
        self.verify_ct += 1
        self.proposed += proposed
        self.accepted += accepted
        while len(self.histogram) <= accepted:
            self.histogram.append(0)
        self.histogram[accepted] += 1


def spec_meta_info(seq: "Sequence") -> dict:
    """SGLang's per-request speculative counters (final ``meta_info``; docs/SGLANG_PROTOCOL.md §2.4)."""
    state = seq.spec
    if state is None or not state.verify_ct:
        return {}
    completion = len(seq.output_ids)
    return {"spec_verify_ct": state.verify_ct, "spec_num_correct_drafts": state.accepted,
            "spec_num_proposed_drafts": state.proposed, "spec_accepted_drafts": state.accepted,
            "spec_proposed_drafts": state.proposed,
            "spec_accept_rate": state.accepted / state.proposed if state.proposed else 0.0,
            "spec_accept_length": completion / state.verify_ct,
            "spec_correct_drafts_histogram": list(state.histogram), "spec_accept_histogram": list(state.histogram)}


# ---------------------------------------------------------------------- drafters
def ngram_propose(state: SpecState, tokens: list[int], max_match: int, k: int) -> list[int]:
    """Prompt lookup: the ``k`` tokens that followed the most recent earlier occurrence of the longest
    suffix of ``tokens`` (up to ``max_match`` tokens long); [] when the last token never occurred.

    A match ``p`` tokens back (the text repeating with period ``p < k``, as a looping output does) has only
    ``p`` tokens after it; the drafts then continue the period (``draft[j] = draft[j - p]``) instead of
    stopping at the end of the text, so a loop gets ``k`` drafts a step rather than ``p``."""
    for pos in range(state.ngram_indexed, len(tokens) - 1):  # the last token is the query, not a candidate
        state.ngram_index.setdefault(tokens[pos], []).append(pos)
    state.ngram_indexed = max(state.ngram_indexed, len(tokens) - 1)
    last = len(tokens) - 1
    best, best_len = -1, 0
    for cand in reversed(state.ngram_index.get(tokens[last], [])[-NGRAM_CANDIDATES:]):
        length = 1
        while length < max_match and cand - length >= 0 and tokens[cand - length] == tokens[last - length]:
            length += 1
        if length > best_len:
            best, best_len = cand, length
            if length == max_match:
                break
    if best < 0:
        return []
    drafts = tokens[best + 1: best + 1 + k]
    period = last - best
    while len(drafts) < k:
        drafts.append(drafts[len(drafts) - period])
    return drafts


class ChainDrafter(abc.ABC):
    """A drafter that samples its drafts one after the other from a model with a slot cache: it feeds
    each row what its cache lacks (:meth:`_catch_up`, giving draft 1), then its drafts one by one
    (:meth:`_feed`). :class:`DraftModel` (STANDALONE) and ``mtp.NextNDrafter`` (NEXTN)."""

    #: whether the engine must hand it the target's hidden states (``record_hidden``)
    needs_hidden = False

    @abc.abstractmethod
    def num_slots(self) -> int:
        """Slots of the drafter's cache (at least the target's running rows)."""

    @abc.abstractmethod
    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Mirror the target's batch compaction in the drafter's cache."""

    @abc.abstractmethod
    def grow_cache(self, need: int) -> None:
        """Follow the target's cache growth (nothing running)."""

    @abc.abstractmethod
    def rewind(self, seq: "Sequence") -> None:
        """After a verify step: what of the drafter's cache stays valid."""

    @abc.abstractmethod
    def _catch_up(self, seqs: list["Sequence"]) -> torch.Tensor:
        """Feed each row what the drafter's cache lacks; the logits of draft 1 ``[rows, vocab]``."""

    @abc.abstractmethod
    def _feed(self, seqs: list["Sequence"], tokens: torch.Tensor, batch_size: int) -> torch.Tensor:
        """Feed each row its last draft ``tokens[i]`` (on the device: the chain reads its drafts once, at
        the end); the logits of the next draft ``[rows, vocab]``."""

    def propose(self, seqs: list["Sequence"], ks: list[int], settings: list[list[RowSampling]],
                generator: torch.Generator, batch_size: int) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Sample ``ks[i]`` draft tokens for each row of ``seqs`` (some of a running batch of
        ``batch_size``); returns the tokens and each row's ``q`` ([k_i, vocab])."""
        if self.num_slots() <= max(seq.slot for seq in seqs):
            raise RuntimeError(f"the draft's KV cache has {self.num_slots()} slots, fewer than "
                               "the target's running batch; lower --max-running-requests")
        logits = self._catch_up(seqs)
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        steps: list[tuple[list[int], torch.Tensor]] = []  # (rows drafting, their drafts on the device) per step
        live = list(range(len(seqs)))
        for step in range(max(ks)):
            rows = [dataclasses.replace(settings[i][step], seed=None if settings[i][step].seed is None
                                        else hash((settings[i][step].seed, DRAFT_STREAM)) & 0x7FFFFFFF) for i in live]
            _, q = sampling_distribution(logits, rows)
            tokens = draw(q, rows, generator)
            steps.append((live, tokens))
            for n, i in enumerate(live):
                probs[i].append(q[n])
            live_next = [n for n, i in enumerate(live) if step + 1 < ks[i]]
            if not live_next:
                break
            if len(live_next) < len(live):
                tokens = tokens[to_device(live_next, tokens.device)]
            logits = self._feed([seqs[live[n]] for n in live_next], tokens, batch_size)
            live = [live[n] for n in live_next]
        drafts: list[list[int]] = [[] for _ in seqs]
        host = torch.cat([tokens for _, tokens in steps]).tolist()  # the chain's one device->host read
        n = 0
        for rows_drafting, _ in steps:
            for i in rows_drafting:
                drafts[i].append(host[n])
                n += 1
        return drafts, [torch.stack(p) for p in probs]


class DraftModel(ChainDrafter):
    """STANDALONE drafter: a small model in its own slot cache, kept in the target's slot layout."""

    def __init__(self, runner: ModelRunner, target: ModelRunner, prefill_tokens: int):
        if runner.vocab_size != target.vocab_size:
            raise ValueError(f"--speculative-draft-model-path {runner.model_path}: its vocabulary has {runner.vocab_size} "
                             f"ids, the target's {target.vocab_size}; the draft must share the target's tokenizer")
        if runner.context_length < target.context_length:
            raise ValueError(f"--speculative-draft-model-path {runner.model_path} holds {runner.context_length} "
                             f"positions, the target {target.context_length}; lower --context-length")
        self.runner = runner
        self.prefill_tokens = prefill_tokens

    def num_slots(self) -> int:
        return self.runner.kv_cache.shape.num_slots

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.runner.kv_cache.move_slot(src, dst, length)

    def grow_cache(self, need: int) -> None:
        self.runner.grow_cache(need)

    def _catch_up(self, seqs: list["Sequence"]) -> torch.Tensor:
        """Feed every row what the draft cache lacks of prompt + output; last-position logits [rows, vocab]."""
        last: list[torch.Tensor | None] = [None] * len(seqs)
        pending = list(range(len(seqs)))
        while pending:
            chunk = max(1, self.prefill_tokens // len(pending))
            rows = []
            for i in pending:
                state, fill = seqs[i].spec, seqs[i].fill_ids
                rows.append(ForwardRow(fill[state.draft_computed: state.draft_computed + chunk], state.draft_computed))
            out, _ = self.runner.forward([seqs[i].slot for i in pending], rows)
            for n, i in enumerate(pending):
                seqs[i].spec.draft_computed += len(rows[n].tokens)
                last[i] = out[n]
            pending = [i for i in pending if seqs[i].spec.draft_computed < len(seqs[i].fill_ids)]
        return torch.stack(last)

    def _feed(self, seqs: list["Sequence"], tokens: list[int], batch_size: int) -> torch.Tensor:
        """One draft token per row at the row's next draft position. The decode path (CUDA graphs) only
        when the rows are the whole running batch in slots 0..B-1: its padding rows write into the
        slots after B, which must be free."""
        positions = [seq.spec.draft_computed for seq in seqs]
        slots = [seq.slot for seq in seqs]
        if slots == list(range(batch_size)):
            logits = self.runner.decode(tokens, positions)  # fed from the device
        else:  # the generic forward takes host tokens
            logits, _ = self.runner.forward(slots, [ForwardRow([t], p) for t, p in zip(tokens.tolist(), positions)])
        for seq in seqs:
            seq.spec.draft_computed += 1
        return logits

    def rewind(self, seq: "Sequence") -> None:
        """After verification: the draft cache is valid for the tokens still in prompt + output."""
        seq.spec.draft_computed = min(seq.spec.draft_computed, seq.num_computed)


class SpeculativeDecoder:
    """The engine's speculative step: propose (n-gram, draft model or MTP layer), verify in one target
    forward, accept, emit. Hooks in :class:`Engine`: ``step`` (decode), ``admitted``, ``move_slot``,
    ``grow_cache``, and where the drafter reads the target's hidden states (``needs_hidden``, NEXTN)
    ``record_hidden`` after each prefill forward and ``share_prefill`` for requests sharing one."""

    def __init__(self, config: SpeculativeConfig, draft: ChainDrafter | None = None,
                 batch_buckets: list[int] | None = None):
        if (config.algorithm != "NGRAM") != (draft is not None):
            raise ValueError(f"{config.algorithm} speculation needs its drafter (STANDALONE: a draft model, NEXTN: "
                             "the MTP layer), NGRAM none")
        self.config = config
        self.draft = draft
        # --speculative-adaptive: drafts a step per batch size, moved by acceptance (batch_buckets: the
        # decode graphs' batch sizes a batch is rounded up to before it picks its slot, as in SGLang)
        self.adaptive = None
        if config.adaptive:
            from slime.backends.embedded_engine.speculative.adaptive import AdaptiveSteps

            self.adaptive = AdaptiveSteps(config.max_drafts, config.adaptive_config, batch_buckets)

    def max_drafts(self, batch: int) -> int:
        """Drafts a row may propose in a step of ``batch`` rows (adaptive: that batch size's count now)."""
        return self.config.max_drafts if self.adaptive is None else self.adaptive.steps(batch)

    @property
    def needs_hidden(self) -> bool:
        return self.draft is not None and self.draft.needs_hidden

    def record_hidden(self, seqs: list["Sequence"], hidden: list[torch.Tensor]) -> None:
        """The target's final hidden states of each row's positions just computed (before ``num_computed``
        moves past them)."""
        for seq, h in zip(seqs, hidden):
            seq.spec.add_hidden(h)

    def share_prefill(self, leader: "Sequence", follower: "Sequence") -> None:
        """``follower`` took ``leader``'s prefilled cache: it takes the hidden states of those positions too."""
        if self.needs_hidden:
            follower.spec.hidden = leader.spec.hidden

    # ------------------------------------------------------------------ engine hooks
    def admitted(self, seqs: list["Sequence"]) -> None:
        """A (re)admitted request starts with an empty draft cache (a retracted one keeps its counters)."""
        for seq in seqs:
            if seq.spec is None:
                seq.spec = SpecState()
            seq.spec.draft_computed = 0
            seq.spec.hidden = seq.spec.chain_hidden = None

    def move_slot(self, src: int, dst: int, length: int) -> None:
        if self.draft is not None:
            self.draft.move_slot(src, dst, length)

    def grow_cache(self, need: int) -> None:
        if self.draft is not None:
            self.draft.grow_cache(need)

    # ------------------------------------------------------------------ one step
    def _drafting(self, seq: "Sequence") -> bool:
        """Whether ``seq`` drafts this step (NGRAM rows pause after lookups that found or won nothing)."""
        return self.draft is not None or seq.spec is None or len(seq.output_ids) >= seq.spec.resume_at

    def wants_step(self, running: list["Sequence"]) -> bool:
        """Whether this decode step goes through :meth:`step`; False when every row's NGRAM lookup is
        paused: the engine then runs its ordinary step, which may start before the previous one is read
        (a speculative step needs the previous tokens on the host)."""
        if self.needs_hidden:
            return True
        return self.max_drafts(len(running)) > 0 and any(self._drafting(seq) for seq in running)

    def count_plain_step(self, running: list["Sequence"]) -> None:
        """An ordinary step the engine ran instead of :meth:`step` (counted as a verify step without drafts)."""
        for seq in running:
            if seq.spec is None:
                seq.spec = SpecState()
            seq.spec.count_step(0, 0)
        if self.adaptive is not None and running:
            self.adaptive.observe(len(running), [])

    def step(self, engine: DecodingEngine, running: list["Sequence"]) -> int | None:
        """Draft, verify and emit for ``running`` (no step in flight); None when no row has a draft
        (the engine then runs an ordinary decode step, counted as a verify step with no drafts)."""
        for seq in running:
            if seq.spec is None:
                seq.spec = SpecState()
        capacity = engine.runner.kv_cache.shape.slot_capacity
        most = self.max_drafts(len(running))
        ks = [self._budget(seq, capacity, most) if self._drafting(seq) else 0 for seq in running]
        # a draft model samples its drafts with them; NGRAM's are built after the verify step is launched
        settings = [self._run_settings(engine, seq, k) for seq, k in zip(running, ks)] if self.draft is not None else None
        draft_probs = None
        if max(ks) == 0:
            drafts = [[] for _ in running]
        elif self.draft is None:
            drafts = [ngram_propose(seq.spec, seq.fill_ids, self.config.ngram_max_match, k) if k else []
                      for seq, k in zip(running, ks)]
            for seq, k, d in zip(running, ks, drafts):
                if k and not d:  # nothing to look up: pause this row's lookups
                    seq.spec.back_off(len(seq.output_ids))
        else:
            drafting = [i for i, k in enumerate(ks) if k]
            tokens, probs = self.draft.propose([running[i] for i in drafting], [ks[i] for i in drafting],
                                               [settings[i] for i in drafting], engine.generator, len(running))
            drafts, draft_probs = [[] for _ in running], [None] * len(running)
            for n, i in enumerate(drafting):
                drafts[i], draft_probs[i] = tokens[n], probs[n]
        if not any(drafts) and not self.needs_hidden:  # NEXTN verifies anyway: the MTP layer needs every hidden state
            for seq in running:
                seq.spec.count_step(0, 0)
            if self.adaptive is not None:
                self.adaptive.observe(len(running), [])
            return None
        return self._verify(engine, running, drafts, draft_probs, settings)

    @staticmethod
    def _budget(seq: "Sequence", slot_capacity: int, most: int) -> int:
        """Drafts this row may verify (at most ``most``): the step emits up to k + 1 tokens, within
        max_new_tokens and the slot."""
        room = min(seq.max_new_tokens - len(seq.output_ids), slot_capacity - seq.num_computed)
        return max(0, min(most, room - 1))

    @staticmethod
    def _run_settings(engine: DecodingEngine, seq: "Sequence", k: int) -> list[RowSampling]:
        """Sampling settings of the row's ``k + 1`` verified positions. They differ only in ``position``,
        which only seeded draws read, and in the stop ids banned before ``min_new_tokens``: where neither
        differs, one object stands for every position (its ``position`` the first's)."""
        first = engine.row_sampling(seq)
        if k == 0:
            return [first]
        if first.seed is None and first.banned_token_ids == engine.row_sampling(seq, ahead=k).banned_token_ids:
            return [first] * (k + 1)
        return [first] + [engine.row_sampling(seq, ahead=j) for j in range(1, k + 1)]

    def _windows(self, runner: ModelRunner, running: list["Sequence"], rows: list[ForwardRow]
                 ) -> tuple[list[list[int]], list[int], list[int]] | None:
        """The T tokens (T = ``--speculative-num-draft-tokens``; adaptive: 1 + the batch's draft count now,
        so a verify step costs what its drafts need) each row feeds a verify decode step, where
        they start and where its real tokens (last token + drafts) begin among them; None where the step
        does not apply (:meth:`ModelRunner.can_verify`). A row with fewer drafts is padded after its real
        tokens (they never see the padding; its outputs are not read; its keys/values land past the row's
        length, as rejected drafts' do) — or, where that padding would pass the slot's end, before them
        with the row's own previous tokens at their positions (their keys/values recomputed in place)."""
        width = self.config.num_draft_tokens if self.adaptive is None else 1 + self.max_drafts(len(running))
        width = max(width, max(len(row.tokens) for row in rows))  # never narrower than a row's tokens
        capacity = runner.kv_cache.shape.slot_capacity
        tokens, starts, offsets = [], [], []
        for seq, row in zip(running, rows):
            pad = width - len(row.tokens)
            if row.start + width <= capacity:
                tokens.append(row.tokens + [0] * pad)
                starts.append(row.start)
                offsets.append(0)
            elif row.start >= pad:  # near the slot's end: the window ends at the last draft
                tokens.append(seq.fill_ids[row.start - pad: row.start] + row.tokens)
                starts.append(row.start - pad)
                offsets.append(pad)
            else:
                return None
        return (tokens, starts, offsets) if runner.can_verify(starts, width) else None

    def _verify(self, engine: DecodingEngine, running: list["Sequence"], drafts: list[list[int]],
                draft_probs: list[torch.Tensor | None] | None, settings: list[list[RowSampling]] | None) -> int:
        runner = engine.runner
        rows = [ForwardRow([seq.output_ids[-1]] + d, seq.num_computed, want_all_logits=True)
                for seq, d in zip(running, drafts)]
        stats = engine.scheduler.stats
        windows = self._windows(runner, running, rows) if VERIFY_AS_DECODE_STEP else None
        if windows is not None:  # a decode step of T tokens a row (a CUDA graph on CUDA)
            tokens, starts, offsets = windows
            logits, hidden = runner.verify(tokens, starts, with_hidden=self.needs_hidden)
            width = logits.shape[1]  # every row's real positions, in one gather
            index = [i * width + o + j for i, (o, r) in enumerate(zip(offsets, rows)) for j in range(len(r.tokens))]
            flat_logits = logits.reshape(-1, logits.shape[-1]).index_select(0, to_device(index, logits.device))
            if hidden is not None:
                hidden = [hidden[i, o: o + len(r.tokens)] for i, (o, r) in enumerate(zip(offsets, rows))]
            stats.spec_verify_decode_steps += 1
        elif self.needs_hidden:
            _, all_logits, hidden = runner.forward_with_hidden([seq.slot for seq in running], rows)
            flat_logits = torch.cat(all_logits)
        else:
            _, all_logits = runner.forward([seq.slot for seq in running], rows)
            flat_logits = torch.cat(all_logits)
        stats.decode_steps += 1
        stats.spec_verify_forwards += 1
        stats.decode_rows += len(running)
        stats.decode_kv_tokens += sum(r.start + len(r.tokens) for r in rows)
        stats.max_running_batch = max(stats.max_running_batch, len(running))
        offsets, n = [], 0
        for d in drafts:
            offsets.append(n)
            n += len(d) + 1
        if settings is None:  # while the device runs the verify step
            settings = [self._run_settings(engine, seq, len(d)) for seq, d in zip(running, drafts)]
        flat_settings = [settings[i][j] for i, d in enumerate(drafts) for j in range(len(d) + 1)]
        want_kept = [bool(seq.request.return_top_p_token_ids) for seq in running]
        if all(row.greedy for row in flat_settings):  # no distributions, no random draws
            logprobs, argmax = greedy_distribution(flat_logits, flat_settings)
            result = accept_greedy(argmax, logprobs, offsets, drafts, want_kept)
        else:
            logprobs, probs = sampling_distribution(flat_logits, flat_settings)
            q = None
            if draft_probs is not None:  # rows without drafts have no q (never read)
                q = [p if p is not None else probs.new_zeros((0, probs.shape[1])) for p in draft_probs]
            result = accept_drafts(probs, logprobs, offsets, drafts, q, settings, engine.generator, want_kept)
        for i, seq in enumerate(running):  # every row's cache length first: a finishing row moves the last row
            seq.spec.count_step(len(drafts[i]), result.accepted[i])
            if self.draft is None and drafts[i]:  # NGRAM: a won draft resumes lookups, all lost pauses them
                if result.accepted[i]:
                    seq.spec.backoff = seq.spec.resume_at = 0
                else:
                    seq.spec.back_off(len(seq.output_ids))
            if self.needs_hidden:  # the positions now verified: the last token and the accepted drafts
                seq.spec.add_hidden(hidden[i][: 1 + result.accepted[i]])
            seq.num_computed += 1 + result.accepted[i]  # the last token and the accepted drafts are cached
            if self.draft is not None:
                self.draft.rewind(seq)
        # every row's run in one _append, row by row: a stop inside a run drops the rest of it, as a plain
        # decode never made it (_append skips a finished sequence's later tokens); top-p replay rows token by token
        produced, batch = 0, []
        for i, seq in enumerate(running):
            if result.kept[i] is None:
                batch += [(seq, token, lp) for token, lp in zip(result.tokens[i], result.logprobs[i])]
                continue
            produced += engine.append_tokens(batch)
            batch = []
            for j, (token, lp) in enumerate(zip(result.tokens[i], result.logprobs[i])):
                if seq.finished is not None:
                    break
                seq.text_cache.setdefault("top_p_token_ids", []).append(result.kept[i][j])
                produced += engine.append_tokens([(seq, token, lp)])
        produced += engine.append_tokens(batch)
        stats.spec_proposed_drafts += sum(len(d) for d in drafts)
        stats.spec_accepted_drafts += sum(result.accepted)
        if self.adaptive is not None:  # the drafts accepted per request that drafted
            self.adaptive.observe(len(running), [a for a, d in zip(result.accepted, drafts) if d])
        return produced
