"""The engine loop: one thread that owns the model, the cache and the scheduler.

Everything that touches engine state runs on that thread: request arrival, aborts, weight loads,
cache flushes and pauses are posted as commands (:meth:`Engine.call`) and executed between steps,
so a forward pass never sees half-updated weights. One step = admit waiting requests (a burst is
gathered for a few milliseconds so that it is prefilled in few forwards), prefill them
(batched, in chunks of at most ``chunked_prefill_size`` tokens per forward), then decode one token
for every running request in a single batched forward.

On CUDA the decode loop runs one step ahead of the host: when the running batch did not change and
every row samples on the sampler's fast path, step k+1 is launched from step k's sampled tokens
(still on the device) *before* the host reads step k's results and does its per-request
bookkeeping, so the GPU does not idle while Python works. A row that step k finishes (a stop token)
has computed one token too many in step k+1; it is dropped. Anything that changes the batch
(admissions, finished rows, commands such as aborts or weight updates) first completes the step in
flight ("drains").

With speculative decoding (``speculative``, :mod:`speculative`) a decode step drafts tokens for every
row, verifies them in one forward of the target and emits the accepted run per row; that step does
not run ahead (a step where no row has a draft is an ordinary one and may).

Outputs leave through each sequence's ``on_event`` callback (called on the engine thread; the
HTTP layer hops back to its event loop with ``call_soon_threadsafe``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from slime.backends.embedded_engine.io_struct import GenerateRequest
from slime.backends.embedded_engine.model_runner import ForwardRow, ModelRunner
from slime.backends.embedded_engine.profiler import EngineProfiler
from slime.backends.embedded_engine.sampler import (GREEDY_EPS, RowSampling, exact_log_probs, kept_token_ids, on_fast_path, sample,
                                                    sample_on_device)
from slime.backends.embedded_engine.scheduler import Scheduler, Sequence, SlotMove
from slime.backends.embedded_engine.speculative.decoder import SpeculativeDecoder

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, runner: ModelRunner, chunked_prefill_size: int = 2048, weight_version: str = "default",
                 seed: int = 0, speculative: "SpeculativeDecoder | None" = None, num_threads: int | None = None):
        self.runner = runner
        self.num_threads = num_threads  # torch intra-op threads of the engine thread (None: leave as is)
        self.speculative = speculative  # draft + verify decode steps (speculative/decoder.py), None: one token a step
        if speculative is not None and getattr(runner, "linear_state", None) is not None:
            raise ValueError(f"{runner.model_path}: speculative decoding over linear-attention (gated-DeltaNet) layers "
                             "is not implemented: their per-request state cannot be rolled back past rejected drafts; "
                             "drop --speculative-algorithm for this model")
        self.tokenizer = runner.tokenizer
        shape = runner.kv_cache.shape
        self.scheduler = Scheduler(shape.num_slots, max_prefill_tokens=chunked_prefill_size,
                                   slot_capacity=shape.slot_capacity)
        self.chunked_prefill_size = chunked_prefill_size
        self.weight_version = weight_version
        self.eos_token_ids = self._eos_ids()
        self.generator = torch.Generator(device=runner.device).manual_seed(seed)
        self.paused = False
        self.last_gen_throughput = 0.0
        self.profiler = EngineProfiler(runner.device.type)  # /start_profile, /stop_profile
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="embedded-engine", daemon=True)
        self._inflight: _Launched | None = None  # a decode step launched whose results are not read yet
        self._host_out: list[torch.Tensor] = []  # two pinned [2, slots] result buffers, alternating

    def _eos_ids(self) -> set[int]:
        ids = set()
        for source in (getattr(self.runner.model, "generation_config", None), self.runner.config):
            eos = getattr(source, "eos_token_id", None)
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ------------------------------------------------------------------ thread plumbing
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.call(lambda: self.abort(None, abort_all=True)).result(timeout)
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the engine thread between steps; the future holds its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # delivered to the caller, the loop keeps serving
                    future.set_exception(exc)

        self._commands.put(run)
        return future

    def _loop(self) -> None:
        if self.num_threads:  # OpenMP settings are per thread: the engine thread's own
            torch.set_num_threads(self.num_threads)
        hold = 0.0  # > 0: nothing runs and the waiting requests are being gathered for one prefill
        while not self._stop.is_set():
            idle = self.paused or not self.scheduler.has_work()
            try:
                command = self._commands.get(timeout=0.5 if idle else hold) if idle or hold else self._commands.get_nowait()
            except queue.Empty:
                command = None
            if command is not None:
                self._drain()  # commands see (and may change) a batch with no step in flight
            while command is not None:
                command()
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            hold = 0.0
            if not self.paused and self.scheduler.has_work():
                try:
                    hold = self.step()
                except Exception:  # a broken step must not kill the server: fail the batch, keep serving
                    logger.exception("engine step failed; aborting running requests")
                    self.abort(None, abort_all=True, message="Internal error in engine step")

    # ------------------------------------------------------------------ requests
    def add_request(self, request: GenerateRequest, on_event: Callable[[Sequence, bool], None]) -> Sequence:
        """Engine thread only (post it with :meth:`call`)."""
        capacity = self.runner.context_length - len(request.input_ids)
        if request.params.max_new_tokens is None:  # as long as an open request may grow
            budget = max(1, min(capacity, self.runner.open_length - len(request.input_ids)))
        else:
            budget = min(request.params.max_new_tokens, capacity)
        seq = Sequence(request=request, max_new_tokens=budget, on_event=on_event)
        self.scheduler.add(seq)
        return seq

    def abort(self, rid: str | None, abort_all: bool = False, message: str | None = None) -> int:
        targets = self.scheduler.select_abort(rid, abort_all)
        finished = []
        for seq in targets:
            reason = self.scheduler.abort_reason(seq)
            if message:
                reason["message"] = message
            finished.append((seq, reason))
        if finished:
            self._finish_all(finished)
        return len(targets)

    def _refuse_all(self, reason: dict) -> None:
        self._drain()
        self._finish_all([(seq, dict(reason)) for seq in self.scheduler.select_abort(None, abort_all=True)])

    def _finish(self, seq: Sequence, reason: dict) -> None:
        self._finish_all([(seq, reason)])

    def _finish_all(self, finished: list[tuple[Sequence, dict]]) -> None:
        """Finish sequences together: one compaction of the batch for all of them (``Scheduler.finish_all``:
        no cache moves when the whole batch ends at the same step), then their answers."""
        now = time.monotonic()
        for seq, _ in finished:
            seq.finished = seq.finished or now
            self._read_routed_experts(seq)  # before its slot is freed or refilled
        self._apply_moves(self.scheduler.finish_all(finished))
        for seq, _ in finished:
            seq.on_event(seq, True)

    def _read_routed_experts(self, seq: Sequence) -> None:
        """``return_routed_experts`` on a server with ``--enable-return-routed-experts``: the finished
        request's experts of positions ``[routed_experts_start_len, seqlen − 1)`` (seqlen = prompt +
        output), read before its slot is freed. A request whose positions are not all in its slot (it
        never ran, or was retracted and not re-prefilled) gets none, as SGLang's without a capture."""
        experts, req = self.runner.routed_experts, seq.request
        if experts is None or not req.return_routed_experts or seq.slot is None:
            return
        seqlen = len(req.input_ids) + len(seq.output_ids)
        if seq.num_computed < seqlen - 1:
            return
        start = min(req.routed_experts_start_len, seqlen - 1)
        seq.routed_experts = experts.read(seq.slot, start, seqlen - 1)

    def _apply_moves(self, moves: list[SlotMove]) -> None:
        if len(moves) > 1:  # one indexed copy per cache buffer for all of them (sources and targets are disjoint:
            # Scheduler.finish_all moves rows from beyond the new end to below it), not one per row and buffer
            self.runner.copy_slots([m.src for m in moves], [m.dst for m in moves], max(m.length for m in moves))
        elif moves:
            self.runner.move_slot(moves[0].src, moves[0].dst, moves[0].length)
        if self.speculative is not None:  # the draft model's cache keeps the same slot layout
            for move in moves:
                self.speculative.move_slot(move.src, move.dst, move.length)

    # ------------------------------------------------------------------ one step
    #: a burst of requests is gathered into few prefills (each pays a launch overhead; docs/performance.md):
    #: waiting requests join once arrivals paused this long, or the oldest has waited ADMIT_MAX_WAIT_S, or they
    #: fill every free slot
    ARRIVAL_PAUSE_S = 0.003
    ADMIT_MAX_WAIT_S = 0.03

    def _admission_hold(self) -> float:
        """Seconds the waiting requests should still gather before they are admitted (0: now)."""
        sched = self.scheduler
        if not sched.waiting or len(sched.waiting) >= sched.num_slots - len(sched.running):
            return 0.0
        now = time.monotonic()
        since_last = now - max(seq.created for seq in sched.waiting)
        since_first = now - min(seq.created for seq in sched.waiting)
        return max(0.0, min(self.ARRIVAL_PAUSE_S - since_last, self.ADMIT_MAX_WAIT_S - since_first))

    def step(self) -> float:
        """One engine step; returns how long the caller may wait for more requests before the next
        one when nothing could run because waiting requests are being gathered (else 0)."""
        start = time.perf_counter()
        produced = 0
        if not self.runner.weights_ready:  # released without a host backup and not all pushed since the resume
            self._refuse_all({"type": "abort", "message": self.runner.unwritten_weights, "status_code": 409,
                              "err_type": "Conflict"})
            return 0.0
        if self.scheduler.waiting and self.scheduler.waiting[0].need > self.scheduler.slot_capacity:
            produced += self._grow_cache_when_idle()
        hold = self._admission_hold()
        if hold and not self.scheduler.running:
            return hold
        if not hold and self.scheduler.waiting and len(self.scheduler.running) < self.scheduler.num_slots:
            produced += self._drain()  # admission changes the batch (with every slot taken, admit() is a no-op)
        admitted = self.scheduler.admit() if not hold else []
        if admitted:
            now = time.monotonic()
            for seq in admitted:
                seq.admitted = seq.admitted or now  # a retracted request keeps its first admission
            if self.speculative is not None:
                self.speculative.admitted(admitted)
            prefill_start = time.perf_counter()
            with self.profiler.stage("prefill"):
                produced += self._prefill(admitted)
            self.scheduler.stats.prefill_seconds += time.perf_counter() - prefill_start
        if self.scheduler.running:  # everyone running now has a sampled token to feed
            with self.profiler.stage("decode"):
                produced += self._decode()
        self.profiler.step_done()
        elapsed = time.perf_counter() - start
        self.scheduler.stats.busy_seconds += elapsed
        if produced:
            self.last_gen_throughput = produced / max(elapsed, 1e-9)
        return 0.0

    def _grow_cache_when_idle(self) -> int:
        """The next request needs longer slots: once the running batch is done, reallocate the cache."""
        if self.scheduler.running:
            return 0  # it waits (admit() stops at it); the batch drains first
        produced = self._drain()
        self.runner.grow_cache(self.scheduler.waiting[0].need)
        if self.speculative is not None:
            self.speculative.grow_cache(self.scheduler.waiting[0].need)
        shape = self.runner.kv_cache.shape
        self.scheduler.num_slots, self.scheduler.slot_capacity = shape.num_slots, shape.slot_capacity
        return produced

    def _prefill(self, admitted: list[Sequence]) -> int:
        """Fill the cache with each admitted sequence's prompt (+ output so far), then sample its next token.

        Requests admitted together with the same tokens to fill (a prompt group's samples) share
        one prefill: the first is computed, the others copy its keys/values into their slots and
        sample their own first token from its logits."""
        leaders, followers = self._share_prefills(admitted)
        pending = leaders
        produced = 0
        while pending:
            chunk = max(1, self.chunked_prefill_size // len(pending))
            rows = []
            for seq in pending:
                tokens = seq.fill_ids[seq.num_computed: seq.num_computed + chunk]
                rows.append(ForwardRow(tokens, seq.num_computed, want_all_logits=self._wants_input_logprobs(seq),
                                       vision=seq.request.vision))
            slots = [seq.slot for seq in pending]
            if self.speculative is not None and self.speculative.needs_hidden:  # NEXTN: the MTP layer's input
                last_logits, all_logits, hidden = self.runner.forward_with_hidden(slots, rows)
                self.speculative.record_hidden(pending, hidden)
            else:
                last_logits, all_logits = self.runner.forward(slots, rows)
            self.scheduler.stats.prefill_forwards += 1
            self.scheduler.stats.prefill_tokens += sum(len(row.tokens) for row in rows)
            done = []
            for i, seq in enumerate(pending):
                if all_logits[i] is not None:
                    self._record_input_logprobs(seq, rows[i], all_logits[i])
                seq.num_computed += len(rows[i].tokens)
                if seq.num_computed >= len(seq.fill_ids):
                    done.append((seq, last_logits[i]))
            pending = [s for s in pending if s.num_computed < len(s.fill_ids)]
            done += self._copy_shared(done, followers)
            finished = [s for s, _ in done if len(s.output_ids) >= s.max_new_tokens]
            if finished:
                self._finish_all([(seq, {"type": "length", "length": seq.max_new_tokens}) for seq in finished])
            ready = [(s, l) for s, l in done if s not in finished]
            if ready:
                produced += self._sample_and_append([s for s, _ in ready], torch.stack([l for _, l in ready]))
        return produced

    def _share_prefills(self, admitted: list[Sequence]) -> tuple[list[Sequence], dict[int, list[Sequence]]]:
        """(sequences to prefill, {id(leader): sequences that take the leader's cache}). Only
        requests starting from an empty slot and not asking for prompt log-probs share."""
        leaders, followers, by_tokens = [], {}, {}
        for seq in admitted:
            key = ((tuple(seq.fill_ids), seq.request.vision and seq.request.vision.key)
                   if seq.num_computed == 0 and not self._wants_input_logprobs(seq) else None)  # same images too
            leader = by_tokens.get(key) if key is not None else None
            if leader is None:
                leaders.append(seq)
                if key is not None:
                    by_tokens[key] = seq
            else:
                followers.setdefault(id(leader), []).append(seq)
        return leaders, followers

    def _copy_shared(self, done: list[tuple[Sequence, torch.Tensor]],
                     followers: dict[int, list[Sequence]]) -> list[tuple[Sequence, torch.Tensor]]:
        """Give the followers of the leaders just prefilled their cache rows and logits."""
        copies, srcs, dsts = [], [], []
        for leader, logits in done:
            for seq in followers.get(id(leader), ()):
                srcs.append(leader.slot)
                dsts.append(seq.slot)
                seq.num_computed = seq.cached_tokens = leader.num_computed
                if self.speculative is not None:
                    self.speculative.share_prefill(leader, seq)
                copies.append((seq, logits))
        if copies:
            self.runner.copy_slots(srcs, dsts, max(seq.num_computed for seq, _ in copies))
            self.scheduler.stats.prefill_shared_rows += len(copies)
        return copies

    def _decode(self) -> int:
        start = time.perf_counter()
        running = list(self.scheduler.running)  # the batch sits in slots 0..B-1 (the scheduler keeps it compact)
        previous, produced = self._inflight, 0
        if self.speculative is not None and not self.speculative.wants_step(running):
            self.speculative.count_plain_step(running)  # every row's lookup paused: an ordinary (run-ahead) step
        elif self.speculative is not None:  # draft + verify; a step where no row has a draft decodes as usual
            produced = self._drain()
            running = list(self.scheduler.running)
            verified = self.speculative.step(self, running) if running else 0
            if verified is not None:
                self.scheduler.stats.decode_seconds += time.perf_counter() - start
                return produced + verified
            previous = None
        if previous is not None and self._can_run_ahead(running, previous):
            self._inflight = self._launch(running, previous)  # step k+1 from step k's tokens on the device ...
            produced = self._complete(previous)  # ... while the host reads step k
        else:
            produced = self._drain()
            running = list(self.scheduler.running)
            if running:
                launched = self._launch(running, None)
                if launched.chainable:
                    self._inflight = launched  # read next step, after launching the one after it
                else:
                    produced += self._complete(launched)
        self.scheduler.stats.decode_seconds += time.perf_counter() - start
        return produced

    def _launch(self, running: list[Sequence], previous: "_Launched | None") -> "_Launched":
        """Launch one decode step (forward + sampling) of ``running``; ``previous`` feeds it from the device."""
        positions = [seq.num_computed for seq in running]
        settings = [self.row_sampling(seq) for seq in running]
        if previous is None:
            logits = self.runner.decode([seq.output_ids[-1] for seq in running], positions)
        else:
            logits = self.runner.decode_next(previous.tokens, positions)
        for seq in running:
            seq.num_computed += 1
        stats = self.scheduler.stats
        stats.decode_steps += 1
        stats.max_running_batch = max(stats.max_running_batch, len(running))
        stats.decode_rows += len(running)
        stats.decode_kv_tokens += sum(positions) + len(running)
        chainable = (self.runner.device.type == "cuda" and self.runner.graphs.can_run(len(running), positions)
                     and on_fast_path(settings, self.runner.vocab_size)
                     and not any(seq.request.return_top_p_token_ids for seq in running))
        if not chainable:
            return _Launched(running, settings, logits, None, None, None, False)
        tokens, logprobs = sample_on_device(logits, settings, self.generator)
        if self.runner.true_on_policy:  # the trainer's log-softmax, bit for bit (as _sample_and_append)
            logprobs = exact_log_probs(logits, settings, tokens)
        if not self._host_out:
            self._host_out = [torch.empty((2, self.runner.max_slots), dtype=torch.float64,
                                          pin_memory=True) for _ in range(2)]
        host = self._host_out[stats.decode_steps % 2][:, :len(running)]  # the other one may still be read
        host.copy_(torch.stack([tokens.double(), logprobs.double()]), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _Launched(running, settings, None, tokens, host, event, True)

    def _can_run_ahead(self, running: list[Sequence], previous: "_Launched") -> bool:
        """Step k+1 may start before step k is read: same rows, and no row can reach its length limit
        (or the end of its slot) at step k, so the only rows step k can finish are stop-token ones."""
        if len(running) != len(previous.seqs) or any(a is not b for a, b in zip(running, previous.seqs)):
            return False
        capacity = self.runner.kv_cache.shape.slot_capacity
        return all(len(seq.output_ids) + 1 < seq.max_new_tokens and seq.num_computed < capacity for seq in running)

    def _complete(self, launched: "_Launched") -> int:
        """Read a launched step's tokens and append them (rows finished meanwhile are skipped)."""
        if not launched.chainable:
            return self._sample_and_append(launched.seqs, launched.logits, launched.settings)
        launched.event.synchronize()
        tokens, logprobs = launched.host.tolist()
        live = [(seq, int(t), lp) for seq, t, lp in zip(launched.seqs, tokens, logprobs) if seq.finished is None]
        return self.append_tokens(live)

    def _drain(self) -> int:
        """Complete the step in flight, if any."""
        launched, self._inflight = self._inflight, None
        return self._complete(launched) if launched is not None else 0

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor,
                           settings: list[RowSampling] | None = None) -> int:
        settings = settings or [self.row_sampling(seq) for seq in seqs]
        tokens, logprobs = sample(logits, settings, self.generator)
        if self.runner.true_on_policy:  # the trainer's log-softmax, bit for bit
            logprobs = exact_log_probs(logits, settings, tokens).tolist()
        replay = [i for i, seq in enumerate(seqs) if seq.request.return_top_p_token_ids]
        if replay:  # top-p replay: the kept set of each position (docs/SGLANG_PROTOCOL.md §2.4)
            kept = kept_token_ids(logits[replay], [settings[i] for i in replay])
            for i, ids in zip(replay, kept):
                seqs[i].text_cache.setdefault("top_p_token_ids", []).append(ids)
        return self.append_tokens(list(zip(seqs, tokens, logprobs)))

    def append_tokens(self, results: list[tuple[Sequence, int, float]]) -> int:
        """Append each sampled token to its sequence; finish or stream it. Returns the tokens appended: a
        sequence that finishes drops its later results (a stop inside a speculative step's accepted run)."""
        now = time.monotonic()
        appended, finished = 0, []
        for seq, token, logprob in results:
            if seq.finished is not None:
                continue
            appended += 1
            seq.first_token = seq.first_token or now
            seq.output_ids.append(token)
            seq.output_logprobs.append(logprob)
            reason = self._finish_reason(seq)
            if reason is not None:
                seq.finished = now  # its later results are dropped; the slot is freed with the others below
                finished.append((seq, reason))
            elif seq.request.stream:
                seq.on_event(seq, False)
        if finished:
            self._finish_all(finished)
        self.scheduler.stats.generated_tokens += appended
        return appended

    def row_sampling(self, seq: Sequence, ahead: int = 0) -> RowSampling:
        """Sampling settings of ``seq``'s next token, or (speculation) of the one ``ahead`` tokens later."""
        params = seq.request.params
        position = len(seq.output_ids) + ahead
        banned = ()
        if position < params.min_new_tokens and not params.ignore_eos:
            banned = tuple(self._stop_token_ids(seq))
        return RowSampling(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                           min_p=params.min_p, seed=params.sampling_seed, position=position,
                           banned_token_ids=banned)

    # ------------------------------------------------------------------ stopping
    def _stop_token_ids(self, seq: Sequence) -> set[int]:
        return self.eos_token_ids | set(seq.request.params.stop_token_ids or [])

    def _finish_reason(self, seq: Sequence) -> dict | None:
        """SGLang order: length first, then stop tokens, then stop strings."""
        params = seq.request.params
        last = seq.output_ids[-1]
        if len(seq.output_ids) >= seq.max_new_tokens:
            return {"type": "length", "length": seq.max_new_tokens}
        if not params.ignore_eos and (last in self.eos_token_ids or last in (params.stop_token_ids or ())):
            return {"type": "stop", "matched": last}
        stops = params.stop_strings
        if stops:
            longest = max(len(s) for s in stops)
            tail = self.tokenizer.decode(seq.output_ids[-(longest + 8):],
                                         skip_special_tokens=params.skip_special_tokens)
            for stop in stops:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        return None

    def output_text(self, seq: Sequence) -> str:
        """Decoded completion, stop-trimmed unless ``no_stop_trim``."""
        params = seq.request.params
        ids = seq.output_ids
        matched = (seq.finish_reason or {}).get("matched")
        if not params.no_stop_trim and isinstance(matched, int) and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        if not params.no_stop_trim and isinstance(matched, str) and seq.finish_reason.get("type") == "stop":
            cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
        return text

    # ------------------------------------------------------------------ prompt log-probs
    @staticmethod
    def _wants_input_logprobs(seq: Sequence) -> bool:
        req = seq.request
        return req.return_logprob and req.logprob_start_len >= 0 and not seq.input_logprobs

    def _record_input_logprobs(self, seq: Sequence, row: ForwardRow, logits: torch.Tensor) -> None:
        """Position p's logits score prompt token p+1; entries cover positions logprob_start_len.. (first null)."""
        prompt = seq.prompt_ids
        temperature = seq.request.params.temperature
        scale = 1.0 if temperature < GREEDY_EPS else temperature
        logprobs = torch.log_softmax(logits / scale, dim=-1)
        store = seq.text_cache.setdefault("input_logprobs", {})
        for j in range(len(row.tokens)):
            target = row.start + j + 1
            if target < len(prompt):
                store[target] = float(logprobs[j, prompt[target]])
        if row.start + len(row.tokens) >= len(prompt):
            start = seq.request.logprob_start_len
            seq.input_logprobs = [None] + [store.get(i) for i in range(start + 1, len(prompt))]
            del seq.text_cache["input_logprobs"]

    # ------------------------------------------------------------------ control (engine thread)
    def flush_cache(self) -> bool:
        """No prefix cache is kept, so flushing only requires idleness (as SGLang reports)."""
        return not self.scheduler.has_work()

    def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort(None, abort_all=True)
        elif mode == "retract":
            self.scheduler.retract_all()
        elif mode != "in_place":
            raise ValueError(f"pause_generation mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        self.paused = True

    def load_info(self) -> dict:
        sched = self.scheduler
        shape = self.runner.kv_cache.shape
        used = sum(s.num_computed for s in sched.running)
        total = shape.num_slots * shape.slot_capacity
        return {"num_running_reqs": len(sched.running), "num_waiting_reqs": len(sched.waiting),
                "num_waiting_uncached_tokens": sum(len(s.fill_ids) for s in sched.waiting),
                "num_used_tokens": used, "num_total_tokens": total, "max_total_num_tokens": total,
                "max_running_requests": shape.num_slots, "token_usage": used / total if total else 0.0,
                "gen_throughput": self.last_gen_throughput, "cache_hit_rate": 0.0,
                "utilization": len(sched.running) / shape.num_slots}


@dataclass
class _Launched:
    """A decode step on its way: rows, and either logits to sample (``chainable`` False) or device
    samples already being copied to pinned ``host`` memory behind ``event``."""

    seqs: list[Sequence]
    settings: list[RowSampling]
    logits: torch.Tensor | None
    tokens: torch.Tensor | None
    host: torch.Tensor | None
    event: Any
    chainable: bool
