"""asyncio bridge between the HTTP handlers and the engine thread, plus SGLang output formatting.

A handler submits :class:`GenerateRequest` objects and awaits their :class:`Sequence` (or iterates
stream snapshots); the engine thread hands events back with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np

from slime.backends.embedded_engine.engine import Engine
from slime.backends.embedded_engine.io_struct import GenerateRequest, RequestError, SamplingParams
from slime.backends.embedded_engine.scheduler import Sequence
from slime.backends.embedded_engine.speculative.decoder import spec_meta_info


@dataclass
class _Tracked:
    seq_future: asyncio.Future
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.time)


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.inflight: dict[str, _Tracked] = {}

    async def _submit(self, requests: list[GenerateRequest]) -> list[_Tracked]:
        """Hand every request of one HTTP call to the engine in ONE command, so a batch (a prompt
        group's samples) reaches the scheduler together and is prefilled together."""
        seen: set[str] = set()
        for request in requests:
            if request.rid in self.inflight or request.rid in seen:
                raise RequestError(f"Duplicate request ID detected: {request.rid}")
            seen.add(request.rid)
        loop = asyncio.get_running_loop()
        tracked = []
        for request in requests:
            item = _Tracked(seq_future=loop.create_future())
            self.inflight[request.rid] = item
            tracked.append(item)

        def on_event_of(item: _Tracked):
            def on_event(seq: Sequence, finished: bool) -> None:
                snapshot = (list(seq.output_ids), list(seq.output_logprobs)) if not finished else None
                loop.call_soon_threadsafe(item.events.put_nowait, (seq, finished, snapshot))
            return on_event

        def add_all() -> None:
            for request, item in zip(requests, tracked):
                self.engine.add_request(request, on_event_of(item))

        try:
            await asyncio.wrap_future(self.engine.call(add_all))
        except BaseException:  # none of them is served: those already added are aborted
            self.engine.call(lambda: [self.engine.abort(request.rid) for request in requests])
            for request in requests:
                self.inflight.pop(request.rid, None)
            raise
        return tracked

    async def generate(self, requests: list[GenerateRequest]) -> list[tuple[Sequence, float]]:
        """Run requests to completion; returns (sequence, e2e latency) in request order."""
        tracked = []
        try:
            tracked = await self._submit(requests)
            results = []
            for request, item in zip(requests, tracked):
                while True:
                    seq, finished, _ = await item.events.get()
                    if finished:
                        break
                results.append((seq, time.time() - item.submitted))
            return results
        except asyncio.CancelledError:  # client went away: abort what it asked for
            for request in requests:
                self.engine.call(lambda rid=request.rid: self.engine.abort(rid))
            raise
        finally:
            for request in requests[: len(tracked)]:
                self.inflight.pop(request.rid, None)

    async def stream(self, requests: list[GenerateRequest]) -> AsyncIterator[tuple[int, Sequence, bool, tuple, float]]:
        """Yield (index, sequence, finished, (output_ids, logprobs) snapshot, latency) as tokens arrive."""
        merged: asyncio.Queue = asyncio.Queue()
        tracked = []
        try:
            tracked = await self._submit(requests)
            pumps = [asyncio.create_task(self._pump(i, t, merged), name=f"stream-{r.rid}")
                     for i, (r, t) in enumerate(zip(requests, tracked))]
            remaining = len(requests)
            while remaining:
                index, seq, finished, snapshot = await merged.get()
                if finished:
                    remaining -= 1
                    snapshot = (list(seq.output_ids), list(seq.output_logprobs))
                yield index, seq, finished, snapshot, time.time() - tracked[index].submitted
            await asyncio.gather(*pumps)
        except (asyncio.CancelledError, GeneratorExit):
            for request in requests:
                self.engine.call(lambda rid=request.rid: self.engine.abort(rid))
            raise
        finally:
            for request in requests[: len(tracked)]:
                self.inflight.pop(request.rid, None)

    @staticmethod
    async def _pump(index: int, tracked: _Tracked, merged: asyncio.Queue) -> None:
        while True:
            seq, finished, snapshot = await tracked.events.get()
            await merged.put((index, seq, finished, snapshot))
            if finished:
                return

    async def health_check(self, timeout: float) -> bool:
        """SGLang's probe: a 1-token greedy request; healthy as soon as any output is produced."""
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        generated_before = self.engine.scheduler.stats.generated_tokens
        task = asyncio.create_task(self.generate([GenerateRequest(rid=rid, input_ids=[0], params=params)]),
                                   name=f"health-{rid}")
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if task.done() or self.engine.scheduler.stats.generated_tokens > generated_before:
                    return True
                await asyncio.sleep(0.02)
            return False
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    # ------------------------------------------------------------------ formatting
    def meta_info(self, seq: Sequence, latency: float, output: tuple | None = None, final: bool = True) -> dict:
        req = seq.request
        output_ids, logprobs = output or (seq.output_ids, seq.output_logprobs)
        reason = seq.finish_reason if final else None
        waiting_abort = bool(reason and reason.get("message") == "Abort in waiting queue")
        meta = {"id": req.rid, "finish_reason": reason, "weight_version": self.engine.weight_version,
                "completion_tokens": len(output_ids)}
        if not waiting_abort:
            meta.update({"prompt_tokens": len(req.input_ids), "num_retractions": seq.num_retractions,
                         "reasoning_tokens": 0, "cached_tokens": seq.cached_tokens})
        if req.return_logprob:
            decode = self.engine.tokenizer.decode if req.return_text_in_logprobs else None
            meta["input_token_logprobs"] = [
                [lp, tok, decode([tok]) if decode else None]
                for lp, tok in zip(seq.input_logprobs, req.input_ids[max(req.logprob_start_len, 0):])
            ] if req.logprob_start_len >= 0 else []
            meta["output_token_logprobs"] = [[lp, tok, decode([tok]) if decode else None]
                                             for lp, tok in zip(logprobs, output_ids)]
            meta["output_token_logprobs_length"] = len(output_ids)
            if final and req.return_top_p_token_ids:
                meta.update(_top_p_replay(seq.text_cache.get("top_p_token_ids", []), len(output_ids)))
        if final and seq.routed_experts is not None:  # SGLang's wire format: base64 of little-endian int32
            meta["routed_experts"] = base64.b64encode(seq.routed_experts.astype("<i4").tobytes()).decode("ascii")
        if final:
            meta.update(spec_meta_info(seq))  # speculative decoding's per-request counters (empty when off)
            meta["e2e_latency"] = latency
            meta.update(self.phase_times(seq, latency))
        meta["response_sent_to_client_ts"] = time.time()
        return meta

    @staticmethod
    def phase_times(seq: Sequence, latency: float) -> dict:
        """Where the request's time went on this server (seconds): queueing (from the HTTP handler's
        submit until the first admission, so waiting for the engine thread counts), prefill up to the
        first token, decode of the rest (what the trace viewer draws as lanes); and SGLang's unix
        timestamps of the engine's receipt and finish (``request_received_ts``, ``request_finished_ts``),
        so a client can place a burst's phases on one clock (bench/engine_decode.py's timeline)."""
        wall, mono = time.time(), time.monotonic()
        times = {"request_received_ts": wall - (mono - seq.created)}
        if seq.finished is not None:
            times["request_finished_ts"] = wall - (mono - seq.finished)
        if seq.admitted is not None:
            served = (seq.finished or time.monotonic()) - seq.admitted  # prefill + decode
            times["queue_time"] = max(latency - served, seq.admitted - seq.created, 0.0)
            if seq.first_token is not None:
                times["prefill_duration"] = seq.first_token - seq.admitted
                if seq.finished is not None:
                    decode = seq.finished - seq.first_token
                    times["decode_duration"] = decode
                    if decode > 0 and len(seq.output_ids) > 1:
                        times["decode_throughput"] = (len(seq.output_ids) - 1) / decode
        return times

    def output_dict(self, seq: Sequence, latency: float, output: tuple | None = None, final: bool = True) -> dict:
        if final:
            text = self.engine.output_text(seq)
            output_ids = list(seq.output_ids)
        else:
            output_ids = output[0]
            text = self.engine.tokenizer.decode(output_ids, skip_special_tokens=seq.request.params.skip_special_tokens)
        return {"text": text, "output_ids": output_ids, "meta_info": self.meta_info(seq, latency, output, final)}


def _top_p_replay(kept: list, num_tokens: int) -> dict:
    """``top_p_token_ids`` / ``top_p_token_offsets``: base64 little-endian int32, CSR over the
    ``num_tokens`` generated tokens (offsets has ``num_tokens + 1`` entries starting at 0)."""
    kept = kept[:num_tokens]
    ids = np.concatenate(kept).astype("<i4") if kept else np.zeros(0, dtype="<i4")
    offsets = np.zeros(num_tokens + 1, dtype="<i4")
    offsets[1 : len(kept) + 1] = np.cumsum([len(k) for k in kept])
    return {"top_p_token_ids": base64.b64encode(ids.tobytes()).decode("ascii"),
            "top_p_token_offsets": base64.b64encode(offsets.tobytes()).decode("ascii")}
