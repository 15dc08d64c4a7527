"""The default generator over SGLang's streaming ``/generate``: ``--custom-generate-function-path
slime.rollout.sglang_streaming_rollout.generate_streaming``.

Same contract as :func:`slime.rollout.sglang_rollout.generate` (the budget is ``max_new_tokens`` minus what the
sample already holds, capped by the context; a 4xx answer marks the sample FAILED; the output is appended with its
log-probs and ``meta_info``), but the answer is read as it streams (``"stream": true``, server-sent events), so
what the engine has produced is kept when the request does not end normally:

* the task is cancelled (a request-mode abort, the rollout shutting down): the tokens received so far are
  appended with their log-probs and the sample is ABORTED, for a partial rollout to continue from; leaving the
  stream makes the server abort the request (SGLang ~2 s after the disconnect, the embedded engine at once);
* the connection drops mid-stream (an engine restarted under ``--use-fault-tolerance``, a proxy timeout): the
  tokens so far are appended and generation resumes with a new request for the rest of the budget, its input the
  prompt plus the partial response (as a partial rollout continues), within the same retry budget as a
  non-streamed request (:data:`RETRIES` failures, a second apart);
* a server-wide abort (``/abort_request``) ends the stream with the final chunk the non-streamed call would get.

Chunks are cumulative (SGLang's default: every chunk holds everything so far) or, under SGLang's
``--incremental-streaming-output``, only the new tokens; each chunk's ``completion_tokens`` says which. Per-token
replay data (routed experts, top-p token sets) arrives with the final chunk only, so where a request asks for it
an interrupted request keeps nothing of its partial output (the sample is ABORTED as it was), and incremental
chunks, whose final chunk would carry only its own slice of that data, are refused.
"""

from __future__ import annotations

import asyncio
import logging

from slime.observability.trace_utils import trace_span
from slime.rollout.sglang_rollout import (_append_output, _generate_payload, _mark_rejected, _request_budget,
                                          get_model_url)
from slime.utils.http_utils import TRANSPORT_ERRORS, HTTPRequestError, get_client, json_dumps, json_loads
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

RETRIES = 60  # transport failures a call survives (http_utils.post's attempts), one second apart
REPLAY_FIELDS = ("routed_experts", "top_p_token_ids", "top_p_token_offsets")


class StreamInterrupted(ConnectionError):
    """The stream ended, or the server failed, before the final chunk: retried like a dropped connection."""


class StreamedOutput:
    """What the chunks of one streamed ``/generate`` have delivered, kept as one cumulative output."""

    def __init__(self):
        self.text = ""
        self.token_logprobs: list = []  # SGLang's [log-prob, token id, text] entries
        self.meta_info: dict = {}
        self.finished = False
        self.incremental = False

    def add(self, chunk: dict) -> None:
        if chunk.get("index", 0) != 0:
            raise ValueError(f"a streamed /generate of one prompt answered a chunk of batch index {chunk['index']}")
        meta = chunk.get("meta_info") or {}
        entries = meta.get("output_token_logprobs")
        if entries is None and chunk.get("output_ids"):
            raise ValueError("engine streamed output_ids without meta_info.output_token_logprobs (return_logprob=True)")
        entries = entries or []
        total = meta.get("completion_tokens")
        if total is None or len(entries) == total:  # cumulative (also an incremental stream's first chunk)
            if len(entries) < len(self.token_logprobs):
                raise ValueError(f"a cumulative chunk holds {len(entries)} tokens after {len(self.token_logprobs)}")
            self.token_logprobs, self.text = list(entries), chunk.get("text", "")
        elif len(self.token_logprobs) + len(entries) == total:  # --incremental-streaming-output: the new ones
            self.token_logprobs.extend(entries)
            self.text += chunk.get("text", "")
            self.incremental = True
        else:
            raise ValueError(f"a streamed chunk holds {len(entries)} token log-probs with completion_tokens {total} "
                             f"after {len(self.token_logprobs)} received: neither cumulative nor incremental")
        self.meta_info = meta
        self.finished = meta.get("finish_reason") is not None
        if self.finished and self.incremental and any(key in meta for key in REPLAY_FIELDS):
            raise ValueError("incremental streaming chunks (SGLang's --incremental-streaming-output) cannot carry the "
                             "whole request's routed experts / top-p token sets: drop that server flag, or use "
                             "slime.rollout.sglang_rollout.generate")

    def output(self, meta_info: dict | None = None) -> dict:
        """The non-streamed ``/generate`` answer these chunks add up to (``meta_info``: instead of the last chunk's)."""
        meta = {**(self.meta_info if meta_info is None else meta_info), "output_token_logprobs": self.token_logprobs}
        return {"text": self.text, "output_ids": [entry[1] for entry in self.token_logprobs], "meta_info": meta}


async def read_stream(url: str, payload: dict, headers: dict | None, streamed: StreamedOutput) -> None:
    """POST ``payload`` and feed each server-sent event's JSON to ``streamed`` until ``[DONE]``. A 4xx answer, or an
    error event the server marks not retryable, raises :class:`HTTPRequestError`; a 5xx answer, a retryable error
    event or a stream that ends before its final chunk raise :class:`StreamInterrupted`; transport errors propagate."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream", **(headers or {})}
    async with get_client().post(url, data=json_dumps(payload), headers=headers) as response:
        if response.status >= 400:
            text = (await response.read()).decode("utf-8", errors="replace")
            if response.status < 500:
                raise HTTPRequestError(f"POST {url} answered {response.status}: {text[:2000]}",
                                       status_code=response.status, body=text)
            raise StreamInterrupted(f"HTTP {response.status}: {text[:500]}")
        buffer = bytearray()
        async for piece in response.content.iter_any():
            buffer += piece
            while (end := buffer.find(b"\n\n")) >= 0:
                event, buffer = bytes(buffer[:end]), buffer[end + 2:]
                data = b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
                if not data:
                    continue
                if data == b"[DONE]":
                    if not streamed.finished:
                        raise StreamInterrupted("the stream ended ([DONE]) before its final chunk")
                    return
                chunk = json_loads(data)
                if isinstance(chunk, dict) and "error" in chunk:
                    error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                    message = f"POST {url} (stream) failed: {error.get('message')}"
                    if error.get("retryable"):
                        raise StreamInterrupted(message)
                    raise HTTPRequestError(message, status_code=int(error.get("code") or 400), body=data.decode())
                streamed.add(chunk)
    if not streamed.finished:
        raise StreamInterrupted("the connection closed before the stream's final chunk")


def _keep_partial(args, sample: Sample, streamed: StreamedOutput, span, why: str, replay: bool) -> None:
    """Append what an interrupted request produced (none of it where it needs replay data the final chunk would
    have carried) and mark the sample ABORTED."""
    if replay or not streamed.token_logprobs:
        sample.status = Sample.Status.ABORTED
        return
    meta = {key: value for key, value in streamed.meta_info.items() if key not in REPLAY_FIELDS}
    meta["finish_reason"] = {"type": "abort", "message": f"stream interrupted: {why}"}
    _append_output(args, sample, streamed.output(meta), span)


async def generate_streaming(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    """One streamed ``/generate`` on the router (more after a dropped connection), appended to the sample."""
    url = get_model_url(args, "default")
    headers = None
    if args.router_policy == "consistent_hashing" and sample.session_id:
        headers = {"X-SMG-Routing-Key": sample.session_id}
    replay = bool(args.use_rollout_routing_replay
                  or (sampling_params.get("custom_params") or {}).get("return_top_p_token_ids"))
    failures = 0
    while True:
        max_new_tokens = _request_budget(args, sample, sampling_params, evaluation)
        if max_new_tokens is not None and max_new_tokens <= 0:
            sample.status = Sample.Status.TRUNCATED
            return sample
        payload = {**_generate_payload(args, list(sample.tokens), sampling_params, max_new_tokens), "stream": True}
        streamed = StreamedOutput()
        attrs = {"max_new_tokens": max_new_tokens, "stream": True}
        async with trace_span(sample, "sglang_generate", attrs=attrs) as span:
            try:
                await read_stream(url, payload, headers, streamed)
            except HTTPRequestError as error:
                _mark_rejected([sample], error)
                return sample
            except asyncio.CancelledError:
                _keep_partial(args, sample, streamed, span, "cancelled", replay)
                raise
            except TRANSPORT_ERRORS as error:  # StreamInterrupted is a ConnectionError
                failures += 1
                reason = f"{type(error).__name__}: {error}"
                _keep_partial(args, sample, streamed, span, reason, replay)
                if failures >= RETRIES:
                    raise HTTPRequestError(f"POST {url} (stream) failed {failures} times; last: {reason}") from error
                logger.warning("streamed generate of sample %s interrupted after %d tokens (%s); resuming in 1 s",
                               sample.index, len(streamed.token_logprobs), reason)
            else:
                _append_output(args, sample, streamed.output(), span)
                return sample
        await asyncio.sleep(1.0)
