"""A scripted stand-in for an SGLang engine: ``/generate`` and ``/abort_request`` with exact, chosen outputs.

A test gives a ``script(payload) -> Reply`` deciding the tokens, log-probs, finish reason and
per-token delay of each request. Tokens are "generated" one at a time (``delay_s`` apart), so an
``/abort_request {"abort_all": true}`` arriving mid-way returns the partial output with
``finish_reason.type == "abort"``, exactly as SGLang does. ``max_new_tokens`` is honoured
(``finish_reason.type == "length"``). Every request (payload and headers) is recorded; a batched
``/generate`` (``input_ids`` a list of lists) is scripted and recorded prompt by prompt and answered
with the list of outputs, as SGLang does. ``"stream": true`` answers server-sent events, a chunk per token
(cumulative, or only the new token with ``incremental``), the final chunk then ``[DONE]``; a reply may drop
the connection or send an error event after some tokens, and a client that leaves the stream aborts its
request (counted in ``disconnects``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from dataclasses import dataclass, field
from typing import Callable

from aiohttp import web


@dataclass
class Reply:
    tokens: list[int]
    logprobs: list[float] | None = None  # default: -0.01 * (position + 1)
    finish: dict | None = None  # when all tokens are emitted; default stop on the last token
    delay_s: float = 0.0  # per token
    http_status: int = 200
    error: dict | None = None  # body for a non-200 answer
    extra_meta: dict = field(default_factory=dict)
    omit_logprobs: bool = False  # answer like an engine that ignored return_logprob
    drop_after: int | None = None  # streamed: close the connection after this many tokens, no final chunk
    error_after: int | None = None  # streamed: after this many tokens, send error_event and [DONE]
    error_event: dict | None = None


class _Dropped(Exception):
    """A scripted stream ends its connection here."""


class _ScriptedError(Exception):
    """A scripted stream sends its error event here."""


def default_detokenize(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


class StandInEngine:
    def __init__(self, script: Callable[[dict], Reply], detokenize=default_detokenize, weight_version: str = "7",
                 incremental: bool = False, split_events: bool = False):
        self.script = script
        self.incremental = incremental  # streamed chunks carry only their new tokens (--incremental-streaming-output)
        self.split_events = split_events  # write each streamed event in two pieces, the cut inside its JSON
        self.disconnects = 0  # streamed requests whose client left before the end
        self.detokenize = detokenize
        self.weight_version = weight_version
        self.requests: list[dict] = []  # one per prompt (a batch's prompts are recorded one by one)
        self.batches: list[dict] = []  # the batched bodies as sent
        self.headers: list[dict] = []
        self.abort_calls = 0
        self._in_flight: set[asyncio.Event] = set()
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ handlers

    async def _generate(self, request: web.Request) -> web.Response:
        payload = await request.json()
        ids = payload.get("input_ids")
        if ids and isinstance(ids[0], list):  # a batch (docs/SGLANG_PROTOCOL.md §2.1): every prompt scripted on its own
            self.batches.append(payload)
            parts = [{**payload, "input_ids": prompt} for prompt in ids]
            answers = await asyncio.gather(*(self._one(part, dict(request.headers)) for part in parts))
            failed = next((a for a in answers if a[1] != 200), None)
            if failed is not None:
                return web.json_response(failed[0], status=failed[1])
            return web.json_response([body for body, _ in answers])
        if payload.get("stream"):
            return await self._stream(request, payload)
        body, status = await self._one(payload, dict(request.headers))
        return web.json_response(body, status=status)

    async def _stream(self, request: web.Request, payload: dict) -> web.StreamResponse:
        reply = self.script(payload)
        if reply.http_status != 200:
            self.requests.append(payload)
            self.headers.append(dict(request.headers))
            return web.json_response(reply.error or {"error": {"message": "scripted error"}}, status=reply.http_status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        sent = {"tokens": 0}

        async def send(body: dict) -> None:
            meta = body["meta_info"]
            if self.incremental:  # only what the previous chunks did not carry
                start = sent["tokens"]
                body = {**body, "text": self.detokenize(body["output_ids"][start:]),
                        "output_ids": body["output_ids"][start:],
                        "meta_info": {**meta, "output_token_logprobs": meta["output_token_logprobs"][start:]}}
            sent["tokens"] = len(meta["output_token_logprobs"])
            event = b"data: " + json.dumps(body).encode() + b"\n\n"
            if self.split_events:  # the client must join pieces that arrive apart
                await response.write(event[: len(event) // 2])
                await asyncio.sleep(0.01)
                event = event[len(event) // 2:]
            await response.write(event)

        async def on_token(partial: dict) -> None:
            count = len(partial["output_ids"])
            if reply.error_after is not None and count > reply.error_after:
                raise _ScriptedError
            if reply.drop_after is not None and count > reply.drop_after:
                raise _Dropped
            await send(partial)

        try:
            body, _ = await self._one(payload, dict(request.headers), on_token=on_token, reply=reply)
            await send(body)
        except _ScriptedError:
            await response.write(b"data: " + json.dumps(reply.error_event).encode() + b"\n\n")
        except _Dropped:
            request.transport.close()  # mid-stream: the client sees the connection end without the final chunk
            return response
        except ConnectionError:  # the client left (a reset)
            self.disconnects += 1
            return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _one(self, payload: dict, headers: dict, on_token=None, reply: Reply | None = None) -> tuple[dict, int]:
        self.requests.append(payload)
        self.headers.append(headers)
        reply = reply or self.script(payload)
        if reply.http_status != 200:
            return reply.error or {"error": {"message": "scripted error"}}, reply.http_status
        max_new = payload.get("sampling_params", {}).get("max_new_tokens")
        logprobs = reply.logprobs or [-0.01 * (i + 1) for i in range(len(reply.tokens))]
        abort = asyncio.Event()
        self._in_flight.add(abort)
        emitted: list[int] = []
        finish = None
        rid = f"req-{next(self._ids)}"
        try:
            for token in reply.tokens:
                if max_new is not None and len(emitted) >= max_new:
                    finish = {"type": "length", "length": max_new}
                    break
                if reply.delay_s:
                    try:
                        await asyncio.wait_for(abort.wait(), reply.delay_s)
                    except asyncio.TimeoutError:
                        pass
                if abort.is_set():
                    finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                    break
                emitted.append(token)
                if on_token is not None and (len(emitted) < len(reply.tokens) and (max_new is None
                                                                                   or len(emitted) < max_new)):
                    await on_token(self._answer(rid, payload, reply, emitted, logprobs, None))
        finally:
            self._in_flight.discard(abort)
        if finish is None:
            finish = reply.finish or {"type": "stop", "matched": emitted[-1] if emitted else None}
        return self._answer(rid, payload, reply, emitted, logprobs, finish), 200

    def _answer(self, rid: str, payload: dict, reply: Reply, emitted: list[int], logprobs: list[float],
                finish) -> dict:
        """The answer (or, with ``finish`` None, a streamed chunk: without ``extra_meta``, which SGLang sends with the
        final chunk) after ``emitted`` tokens."""
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(payload["input_ids"]) if "input_ids" in payload else len(payload.get("text", "")),
            "completion_tokens": len(emitted),
            "cached_tokens": 1,
            "weight_version": self.weight_version,
            "e2e_latency": 0.01,
            "output_token_logprobs": [[logprobs[i], t, None] for i, t in enumerate(emitted)],
            "output_token_logprobs_length": len(emitted),
            **(reply.extra_meta if finish is not None else {}),
        }
        if reply.omit_logprobs:
            del meta["output_token_logprobs"], meta["output_token_logprobs_length"]
        return {"text": self.detokenize(emitted), "output_ids": list(emitted), "meta_info": meta}

    async def _abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("abort_all"):
            self.abort_calls += 1
            for event in list(self._in_flight):
                event.set()
        return web.Response(status=200)

    async def _loads(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"timestamp": "", "version": "stand-in", "loads": [
                {"dp_rank": 0, "num_running_reqs": len(self._in_flight), "num_waiting_reqs": 0}]}
        )  # fmt: skip

    async def _ok(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "stand-in", "weight_version": self.weight_version})

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "StandInEngine":
        started = threading.Event()

        def serve():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            app = web.Application()
            app.router.add_post("/generate", self._generate)
            app.router.add_post("/abort_request", self._abort)
            app.router.add_get("/v1/loads", self._loads)
            for path in ("/health", "/health_generate", "/server_info", "/model_info", "/version"):
                app.router.add_get(path, self._ok)
            self._runner = web.AppRunner(app, access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="stand-in-engine", daemon=True)
        self._thread.start()
        started.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
