"""What the OpenAI and Anthropic adapters share: sessions, the turn pipeline, the SGLang call (§6.1–6.5).

One HTTP request is one model turn: the wire body is translated to chat-template messages and a tool
schema (protocol-specific), rendered with the served model's chat template into prompt ids, sent to
SGLang's ``/generate`` as ``input_ids`` with ``return_logprob=True`` and the session id as
``X-SMG-Routing-Key``; the sampled ids and log-probs are recorded as they came back and the decoded
text is parsed into reasoning / text / tool calls for the reply. The response is flushed to the
client before the turn is recorded, so a client that went away leaves nothing half-recorded.

Sessions: the agent client carries the session id as its API key (``Authorization: Bearer <sid>``).
In strict mode (forced whenever the app is served on a non-loopback address, see
``aiohttp_threaded.run_app_in_thread``) only ids opened with ``open_session`` are served; any other
or missing id gets 401 and there is no implicit ``default`` session.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import aiohttp
from aiohttp import web

from slime.agent.parsing import ParsedModelOutput, check_parser_names, parse_model_output
from slime.agent.trajectory import TrajectoryManager, TurnRecord
from slime.utils.passthrough import sglang_value
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

ADAPTER_KEY = web.AppKey("slime_agent_adapter", object)
MAX_BODY_BYTES = 64 * 1024 * 1024
GENERATE_READ_TIMEOUT_S = 900
BASE_SAMPLING_PARAMS = {"skip_special_tokens": False, "spaces_between_special_tokens": False, "no_stop_trim": True,
                        "max_new_tokens": 4096}

__all__ = ["BaseAdapter", "Session", "Reply", "TurnRecord", "call_sglang_generate", "HTTPProblem"]


@dataclass
class Session:
    sampling_defaults: dict = field(default_factory=dict)
    max_context_tokens: int = 0
    opened: bool = True  # False for the implicit sessions of non-strict mode


@dataclass
class Reply:
    """A built reply: the canonical echo recorded in the tree, the finish reason and the wire form."""

    manager_message: dict
    finish_reason: str
    wire: object


class SGLangError(RuntimeError):
    """SGLang refused or failed a ``/generate`` call (``status`` is its HTTP status)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class HTTPProblem(Exception):
    """A request the adapter answers with an error status (bad body, unknown session, ...)."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


# ----------------------------------------------------------------------------- message helpers


def image_source(block) -> str | None:
    """The image a wire content block carries, as a path / URL / data URL string (None: not an image):
    OpenAI chat ``image_url``, Responses ``input_image``, Anthropic ``image`` with a base64 or URL source."""
    if not isinstance(block, Mapping):
        return None
    kind = block.get("type")
    if kind in ("image_url", "input_image"):
        url = block.get("image_url")
        return url.get("url") if isinstance(url, Mapping) else url
    if kind == "image":
        source = block.get("source")
        if isinstance(source, Mapping):
            if source.get("type") == "base64":
                return f"data:{source.get('media_type') or 'image/png'};base64,{source.get('data', '')}"
            return source.get("url") or source.get("path")
        return block.get("image")
    return None


def content_with_images(content):
    """Wire content of a user or tool message: plain text (as :func:`flatten_content`) when it holds no
    image, else chat-template parts ``{"type": "text"}`` / ``{"type": "image", "image": <source>}`` in order."""
    blocks = [content] if isinstance(content, Mapping) else content
    if not isinstance(blocks, list) or not any(_holds_image(b) for b in blocks):
        return flatten_content(content)
    parts, texts = [], []
    for block in blocks:
        source = image_source(block)
        if source is None and isinstance(block, Mapping) and _holds_image(block):
            nested = content_with_images(block.get("content", block.get("output")))
            nested = nested if isinstance(nested, list) else [{"type": "text", "text": nested}]
            for part in nested:
                if part["type"] == "text":
                    texts.append(part["text"])
                else:
                    _flush(parts, texts)
                    parts.append(part)
        elif source is None:
            text = flatten_content([block])
            if text or isinstance(block, str):
                texts.append(text)
        else:
            _flush(parts, texts)
            parts.append({"type": "image", "image": source})
    _flush(parts, texts)
    return parts


def _holds_image(block) -> bool:
    if image_source(block) is not None:
        return True
    nested = block.get("content", block.get("output")) if isinstance(block, Mapping) else None
    return isinstance(nested, list) and any(_holds_image(b) for b in nested)


def _flush(parts: list, texts: list) -> None:
    if texts:
        parts.append({"type": "text", "text": "\n".join(texts)})
        texts.clear()


def flatten_content(content) -> str:
    """Wire content (string or list of blocks) as plain text; images become ``[image omitted]`` (where a
    message can carry them, :func:`content_with_images` keeps them)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Mapping):
        content = [content]
    if not isinstance(content, list):
        return str(content)
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif not isinstance(block, Mapping):
            continue
        elif block.get("type") in ("image", "image_url", "input_image"):
            parts.append("[image omitted]")
        elif isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif "content" in block:
            parts.append(flatten_content(block["content"]))
        elif "output" in block:
            parts.append(flatten_content(block["output"]))
    return "\n".join(parts)


def canonical_tool_call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def canonical_assistant(content: str, tool_calls: list[dict] | None = None, reasoning: str | None = None) -> dict:
    message = {"role": "assistant", "content": content or ""}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def function_tool(name, description=None, parameters=None) -> dict:
    if not isinstance(name, str) or not name:
        raise HTTPProblem(400, "invalid_request_error", f"every tool needs a string 'name'; got {name!r}")
    return {"type": "function", "function": {"name": name, "description": description or "",
                                             "parameters": parameters or {"type": "object", "properties": {}}}}


def new_id(prefix: str, hex_chars: int = 24) -> str:
    return f"{prefix}{uuid.uuid4().hex[:hex_chars]}"


# ----------------------------------------------------------------------------- the SGLang call


CONNECT_RETRY_SECONDS = 1.0  # before the one retry of a /generate that could not connect (a router restarting)


async def call_sglang_generate(prompt_ids: list[int], session: Session, body: dict, *, adapter: "BaseAdapter",
                               session_id: str | None = None, images: "PromptImages | None" = None) -> TurnRecord:
    """One ``/generate`` call for a turn; returns the sampled ids and log-probs as the engine sent them.
    ``images``: the prompt's images (``prompt_ids`` then holds each image's expanded placeholder run)."""
    params = adapter.sampling_params(session, body, len(prompt_ids))
    if params is None:  # the prompt already fills the session's context budget
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=[], finish_reason="length")
    rid = uuid.uuid4().hex
    payload = {"rid": rid, "input_ids": list(prompt_ids), "sampling_params": params, "return_logprob": True}
    if images is not None:
        payload["image_data"] = images.image_data
    headers = {"X-SMG-Routing-Key": session_id} if session_id and session_id != "default" else {}
    for attempt in (1, 2):
        try:
            async with adapter.http_client().post(f"{adapter.sglang_url}/generate", json=payload,
                                                  headers=headers) as resp:
                if resp.status >= 400:
                    raise SGLangError(resp.status, f"SGLang /generate answered HTTP {resp.status}: "
                                                   f"{(await resp.text())[:500]}")
                output = await resp.json(content_type=None)
            break
        except aiohttp.ClientConnectorError as exc:  # no connection was made: nothing reached the server
            if attempt == 2:
                raise
            logger.warning("SGLang /generate at %s: %s; retrying once", adapter.sglang_url, exc)
            await asyncio.sleep(CONNECT_RETRY_SECONDS)
        except (asyncio.CancelledError, asyncio.TimeoutError, aiohttp.ClientConnectionError):
            await adapter.abort_request(rid)
            raise
    meta = output.get("meta_info") or {}
    triples = meta.get("output_token_logprobs") or []
    if output.get("output_ids") and len(triples) != len(output["output_ids"]):
        raise RuntimeError("SGLang answered without per-token log-probs (meta_info.output_token_logprobs); "
                           "the adapter sends return_logprob=true, is the server SGLang-compatible?")
    finish = meta.get("finish_reason") or {}
    return TurnRecord(prompt_ids=list(prompt_ids), output_ids=[int(t[1]) for t in triples],
                      finish_reason=(finish.get("type") if isinstance(finish, Mapping) else None) or "stop",
                      output_log_probs=[float(t[0]) for t in triples],
                      images=tuple(images.sources) if images is not None else (),
                      multimodal_train_inputs=images.train_inputs if images is not None else None)


@dataclass
class PromptImages:
    """A turn's images: their sources as the client sent them, what the engine is sent, the trainer's inputs."""

    sources: list
    image_data: list[str]
    train_inputs: dict


# ----------------------------------------------------------------------------- the adapter


class BaseAdapter:
    """Sessions, rendering, the SGLang call and the trajectory manager; subclasses speak one protocol."""

    #: body keys that cap max_new_tokens, in the protocol's spelling
    max_tokens_keys: tuple[str, ...] = ()
    stop_key = "stop"

    def __init__(self, *, tokenizer, sglang_url: str, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, max_turns_per_sid: int | None = None,
                 fork_threshold_tokens: int | None = None, debug_callback=None,
                 chat_template_kwargs: dict | None = None, strict: bool = False, model_name: str = "slime-actor",
                 processor=None, **unknown):
        if unknown:  # forward compatibility with newer callers (docs/INTERFACES.md §6.8); said out loud
            logger.warning("%s ignores unknown constructor arguments %s", type(self).__name__, sorted(unknown))
        if not sglang_url:
            raise ValueError("sglang_url is required, e.g. http://127.0.0.1:30000 (the router or an engine)")
        check_parser_names(tool_parser, reasoning_parser)
        if max_turns_per_sid is not None and max_turns_per_sid <= 0:
            raise ValueError(f"max_turns_per_sid must be positive or None, got {max_turns_per_sid}")
        self.tokenizer = tokenizer
        self.sglang_url = sglang_url.rstrip("/")
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.max_turns_per_sid = max_turns_per_sid
        self.debug_callback = debug_callback
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.strict = bool(strict)
        self.model_name = model_name
        self._processor = processor  # the checkpoint's image processor + tokenizer, loaded at the first image
        self.manager = TrajectoryManager(fork_threshold_tokens=fork_threshold_tokens)
        self.store: dict[str, Session] = {}
        self.closed: set[str] = set()
        self.inflight: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Task]]] = {}
        self.turn_counts: dict[str, int] = {}
        self._http_clients: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._stop_texts = [t for t in {tokenizer.eos_token, getattr(tokenizer, "pad_token", None)} if t]
        self.app = web.Application(client_max_size=MAX_BODY_BYTES)
        self.app[ADAPTER_KEY] = self
        self.app.router.add_get("/healthz", self._healthz)
        self.app.router.add_get("/v1/models", self._models)
        self.add_routes(self.app.router)
        self.app.on_cleanup.append(self._close_http_clients)

    @classmethod
    def from_args(cls, args, tokenizer=None, **kwargs) -> "BaseAdapter":
        """An adapter configured the conventional way: the router from ``--sglang-router-ip/port``,
        parsers from ``--sglang-tool-call-parser`` / ``--sglang-reasoning-parser``, template kwargs from
        ``--apply-chat-template-kwargs``."""
        if tokenizer is None:
            from slime.utils.processing_utils import load_tokenizer

            tokenizer = load_tokenizer(args.hf_checkpoint)
        if not args.sglang_router_ip or not args.sglang_router_port:
            raise ValueError("the agent adapter needs the router address (--sglang-router-ip/--sglang-router-port, "
                             "set by slime when it starts the router)")
        kwargs.setdefault("tool_parser", sglang_value(args, "sglang_tool_call_parser"))
        kwargs.setdefault("reasoning_parser", sglang_value(args, "sglang_reasoning_parser"))
        kwargs.setdefault("chat_template_kwargs", args.apply_chat_template_kwargs or {})
        return cls(tokenizer=tokenizer, sglang_url=f"http://{args.sglang_router_ip}:{args.sglang_router_port}",
                   **kwargs)

    # ------------------------------------------------------------------ protocol hooks (subclasses)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define add_routes(): the protocol's HTTP routes")

    def session_id_from(self, request: web.Request, body: dict) -> str | None:
        raise NotImplementedError(f"{type(self).__name__} must define session_id_from(): where a request names its session")

    def error_body(self, status: int, kind: str, message: str) -> dict:
        raise NotImplementedError(f"{type(self).__name__} must define error_body(): the protocol's error shape")

    # ------------------------------------------------------------------ session lifecycle

    def open_session(self, sid: str, *, sampling_defaults: dict | None = None, max_context_tokens: int = 0) -> None:
        if not isinstance(sid, str) or not sid:
            raise ValueError(f"session id must be a non-empty string, got {sid!r}")
        if sid in self.store or sid in self.closed:
            raise ValueError(f"session {sid!r} already exists or was used before; session ids must be unique per run")
        self.store[sid] = Session(sampling_defaults=dict(sampling_defaults or {}),
                                  max_context_tokens=int(max_context_tokens or 0))

    async def shutdown_session(self, sid: str, *, wait_timeout: float = 5.0) -> None:
        """Close the session (later requests get 503) and wait for, then cancel, its in-flight turns."""
        self.closed.add(sid)
        deadline = time.monotonic() + wait_timeout
        while self.inflight.get(sid) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for loop, task in list(self.inflight.get(sid, ())):
            logger.warning("session %s: cancelling a turn still running after %.1fs", sid, wait_timeout)
            loop.call_soon_threadsafe(task.cancel)
        self.store.pop(sid, None)
        if not self.inflight.get(sid):
            self.inflight.pop(sid, None)

    async def finish_session(self, sid: str, *, base_sample: Sample | None = None, reward=0.0,
                             extra_metadata: dict | None = None, wait_timeout: float = 5.0) -> list[Sample]:
        """Close the session and return its samples (§6.6), each carrying ``reward``; ``[]`` the second time."""
        session = self.store.get(sid)
        await self.shutdown_session(sid, wait_timeout=wait_timeout)
        base_sample = base_sample if base_sample is not None else Sample()
        budget = session.max_context_tokens if session is not None else 0
        samples = self.manager.get_trajectory(sid, base_sample=base_sample, reward=reward,
                                              extra_metadata=extra_metadata, max_sample_tokens=budget)
        for sample in samples:
            response_ids = sample.tokens[len(sample.tokens) - sample.response_length:]
            sample.response = self.tokenizer.decode(response_ids, skip_special_tokens=False)
        return samples

    async def drop_session(self, sid: str, *, wait_timeout: float = 5.0) -> None:
        await self.shutdown_session(sid, wait_timeout=wait_timeout)
        self.manager.drop_session(sid)

    def _session_for(self, sid: str | None) -> tuple[str, Session]:
        if sid is not None and sid in self.closed:
            raise HTTPProblem(503, "api_error", f"session {sid!r} is closed")
        if sid is not None and sid in self.store:
            return sid, self.store[sid]
        if self.strict:
            what = "no session id (send it as the API key: Authorization: Bearer <sid>)" if sid is None else \
                "an unknown session id"
            raise HTTPProblem(401, "authentication_error", f"strict mode: {what}; only opened sessions are served")
        sid = sid or "default"
        session = self.store.setdefault(sid, Session(opened=False))
        return sid, session

    # ------------------------------------------------------------------ one turn

    def render_with_images(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], PromptImages | None]:
        """:meth:`render`, or for messages with image parts: the rendered prompt through the checkpoint's
        processor (each image's placeholder expanded) and the images, loaded and checked."""
        from slime.utils.multimodal import (MediaError, encode_image, images_of_messages, load_image, process_images,
                                            unwrap_image)

        sources = [unwrap_image(part) for part in images_of_messages(messages)]
        if not sources:
            return self.render(messages, tools), None
        if self._processor is None:
            from slime.utils.processing_utils import load_processor

            self._processor = load_processor(self.tokenizer.name_or_path)
            if self._processor is None:
                raise HTTPProblem(400, "invalid_request_error", "the request holds images but the served checkpoint "
                                                                "has no image processor (not a vision-language model)")
        try:
            images = [load_image(source) for source in sources]
        except MediaError as e:
            raise HTTPProblem(400, "invalid_request_error", f"image: {e}") from e
        text = self.render(messages, tools, tokenize=False)
        ids, train_inputs = process_images(self._processor, text, images)
        return ids, PromptImages(sources=sources, image_data=[encode_image(image) for image in images],
                                 train_inputs=train_inputs)

    def render(self, messages: list[dict], tools: list[dict] | None, tokenize: bool = True):
        """Prompt ids from the model's chat template (tools and --apply-chat-template-kwargs applied);
        the rendered text with ``tokenize=False``."""
        try:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=tokenize,
                                                     add_generation_prompt=True, **self.chat_template_kwargs)
        except Exception as e:  # a template that rejects these messages is the client's problem, said clearly
            raise HTTPProblem(400, "invalid_request_error", f"the chat template could not render the request: "
                                                            f"{type(e).__name__}: {e}") from e
        if not tokenize:
            return ids
        if isinstance(ids, Mapping) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def sampling_params(self, session: Session, body: dict, prompt_length: int) -> dict | None:
        """Sampling params of one turn (§6.4 step 5); None when the context budget is already used up."""
        params = dict(BASE_SAMPLING_PARAMS)
        params.update(copy.deepcopy(session.sampling_defaults))
        caps = [body[k] for k in self.max_tokens_keys if isinstance(body.get(k), int) and not isinstance(body[k], bool)]
        if caps:
            params["max_new_tokens"] = min([min(caps)] + ([params["max_new_tokens"]] if params.get("max_new_tokens")
                                                          else []))
        for key in ("temperature", "top_p", "top_k"):
            if body.get(key) is not None:
                params[key] = body[key]
        if body.get(self.stop_key):
            params["stop"] = body[self.stop_key]
        if session.max_context_tokens > 0:
            room = session.max_context_tokens - prompt_length
            if room <= 0:
                return None
            params["max_new_tokens"] = min(params.get("max_new_tokens") or room, room)
        return params

    def decode_output(self, output_ids: list[int]) -> str:
        text = self.tokenizer.decode(output_ids, skip_special_tokens=False)
        stripped = True
        while stripped:  # the stop token the engine kept (no_stop_trim) is not part of the reply
            stripped = False
            for stop in self._stop_texts:
                if text.endswith(stop):
                    text, stripped = text[: -len(stop)], True
        return text

    def parse(self, raw: str, tools: list[dict] | None) -> ParsedModelOutput:
        return parse_model_output(raw, tools_schema=tools, tool_parser_name=self.tool_parser,
                                  reasoning_parser_name=self.reasoning_parser)

    async def run_turn(self, request: web.Request, body: dict, translate, build_reply, write_reply) -> web.StreamResponse:
        """The shared pipeline: session → translate → render → generate → parse → reply → record."""
        sid, session = self._session_for(self.session_id_from(request, body))
        count = self.turn_counts.get(sid, 0)
        if self.max_turns_per_sid is not None and count >= self.max_turns_per_sid:
            raise HTTPProblem(429, "rate_limit_error", f"session {sid!r} reached its turn cap "
                                                       f"({self.max_turns_per_sid} turns)")
        messages, tools = translate(body)
        self.turn_counts[sid] = count + 1
        prompt_ids, images = self.render_with_images(messages, tools)
        # The turn stays in flight until it is recorded (after the reply is flushed), so that a
        # finish_session called as soon as the client has its answer still sees this turn.
        entry = (asyncio.get_running_loop(), asyncio.current_task())
        self.inflight.setdefault(sid, set()).add(entry)
        try:
            # images only when there are some: a replacement of this documented seam written for text keeps working
            extra = {"images": images} if images else {}
            turn = await call_sglang_generate(prompt_ids, session, body, adapter=self, session_id=sid, **extra)
            parsed = self.parse(self.decode_output(turn.output_ids), tools)
            turn = replace(turn, ill_formed=parsed.ill_formed)
            reply = build_reply(parsed, turn, messages, tools, body)
            try:
                response = await write_reply(request, reply, body, turn)
            except ConnectionResetError:
                logger.warning("session %s: client went away before the reply was sent; the turn is not recorded", sid)
                return web.Response(status=499)
            self.manager.record_turn(sid, turn=turn, prompt_messages=messages,
                                     response_message=reply.manager_message, metadata={"sid": sid})
        finally:
            self.inflight.get(sid, set()).discard(entry)
        if self.debug_callback is not None:
            try:
                self.debug_callback(sid, messages, tools, reply.manager_message, turn)
            except Exception:  # a debugging aid must never break a session
                logger.exception("debug_callback failed for session %s", sid)
        return response

    # ------------------------------------------------------------------ HTTP plumbing

    def http_client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        client = self._http_clients.get(loop)
        if client is None or client.closed:
            timeout = aiohttp.ClientTimeout(total=None, sock_read=GENERATE_READ_TIMEOUT_S)
            client = aiohttp.ClientSession(timeout=timeout)
            self._http_clients[loop] = client
        return client

    async def abort_request(self, rid: str) -> None:
        try:
            async with self.http_client().post(f"{self.sglang_url}/abort_request", json={"rid": rid},
                                               timeout=aiohttp.ClientTimeout(total=5)):
                pass
        except Exception as e:  # best effort: the turn is being abandoned anyway
            logger.warning("could not abort SGLang request %s: %s", rid, e)

    async def _close_http_clients(self, _app=None) -> None:
        loop = asyncio.get_running_loop()
        client = self._http_clients.pop(loop, None)
        if client is not None:
            await client.close()

    async def _healthz(self, _request):
        return web.json_response({"ok": True})

    async def _models(self, _request):
        return web.json_response({"ok": True, "object": "list",
                                  "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "slime"}]})

    async def read_json(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HTTPProblem(400, "invalid_request_error", f"request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise HTTPProblem(400, "invalid_request_error", f"request body must be a JSON object, got "
                                                            f"{type(body).__name__}")
        return body

    def handler(self, translate, build_reply, write_reply):
        """An aiohttp handler running one turn, answering HTTPProblem / engine errors in protocol shape."""

        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                body = await self.read_json(request)
                return await self.run_turn(request, body, translate, build_reply, write_reply)
            except HTTPProblem as problem:
                return web.json_response(self.error_body(problem.status, problem.kind, problem.message),
                                         status=problem.status)
            except SGLangError as e:  # 4xx: the turn cannot be served as asked (e.g. over the context length)
                logger.error("agent turn failed: %s", e)
                status = 400 if 400 <= e.status < 500 else 500
                kind = "invalid_request_error" if status == 400 else "api_error"
                return web.json_response(self.error_body(status, kind, str(e)), status=status)
            except (RuntimeError, aiohttp.ClientError) as e:
                logger.error("agent turn failed: %s", e)
                return web.json_response(self.error_body(500, "api_error", str(e)), status=500)

        return handle

    @staticmethod
    def bearer_token(request: web.Request) -> str | None:
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip() or None
        return None

    @staticmethod
    def wants_stream(request: web.Request, body: dict) -> bool:
        return bool(body.get("stream")) or "text/event-stream" in request.headers.get("Accept", "")

    @staticmethod
    async def send_json(request: web.Request, payload: dict) -> web.StreamResponse:
        response = web.json_response(payload)
        await response.prepare(request)
        await response.write_eof()
        return response

    @staticmethod
    async def send_events(request: web.Request, events: list[tuple[str | None, object]]) -> web.StreamResponse:
        """Server-sent events: ``(event_name or None, data)``; data is JSON-encoded unless it is a string."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for name, data in events:
            text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
            chunk = (f"event: {name}\n" if name else "") + f"data: {text}\n\n"
            await response.write(chunk.encode())
        await response.write_eof()
        return response
