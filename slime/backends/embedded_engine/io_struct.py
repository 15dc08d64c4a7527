"""Request records and validation for ``/generate`` (SGLang field names, defaults and errors).

``parse_generate`` turns one JSON body into a list of :class:`GenerateRequest` (a batch, ``n``
samples, or one). Validation raises :class:`RequestError` carrying the HTTP status SGLang uses:
400 for invalid values (a ``sampling_params`` value of the wrong JSON type, such as
``"max_new_tokens": "5"``, included, naming the field), 500 for unknown keys inside ``sampling_params`` (SGLang splats the dict into
a struct and the ``TypeError`` escapes). Unknown *top-level* keys are ignored, as SGLang does (the
router adds some of its own). ``read_json`` reads any route's body as a JSON object; :class:`JSONResponse`
writes answers with orjson (as SGLang's server does).
"""

from __future__ import annotations

import difflib

import json
import math
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from starlette.responses import JSONResponse as _StarletteJSONResponse

from slime.utils.http_utils import json_dumps, json_loads

TOP_K_ALL = 1 << 30


class RequestError(Exception):
    """A request the server refuses; ``status`` is the HTTP status, ``shape`` the error envelope."""

    def __init__(self, message: str, status: int = 400, shape: str = "native"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.shape = shape  # "native": {"error": {"message"}}, "openai": {"object": "error", ...}


async def read_json(request, required: bool = True) -> dict:
    """The body of ``request`` (anything with an async ``body()``, e.g. a Starlette request) as a JSON
    object; an empty body is ``{}`` unless ``required``. Raises :class:`RequestError` (400) otherwise."""
    raw = await request.body()
    if not raw.strip():
        if required:
            raise RequestError("request body is empty; send a JSON object", shape="openai")
        return {}
    try:
        body = json_loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestError(f"JSON decode error: {exc.msg} at line {exc.lineno} column {exc.colno}", shape="openai")
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", shape="openai")
    return body


class JSONResponse(_StarletteJSONResponse):
    """Starlette's ``JSONResponse`` encoded by orjson: a burst of answers with their log-probs encodes ~20x
    faster than with ``json.dumps``, on the server's event loop, which the whole burst waits for
    (docs/embedded_engine.md, "HTTP"). As in SGLang (orjson too), NaN and infinities are written as ``null``; numpy
    arrays and scalars are written as lists and numbers."""

    def render(self, content: Any) -> bytes:
        return json_dumps(content)


@dataclass
class SamplingParams:
    """SGLang ``SamplingParams`` (the subset this engine executes; others are refused, not ignored)."""

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict | None = None
    custom_params: dict | None = None
    stream_interval: int | None = None
    sampling_seed: int | None = None

    @classmethod
    def from_dict(cls, raw: dict | None) -> "SamplingParams":
        raw = dict(raw or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:  # a client error: 400 (SGLang answers 500, which clients retry)
            close = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise RequestError(f"sampling_params: unknown key {unknown[0]!r}{hint} (sampling_params keys: "
                               f"{sorted(known)})")
        for name, value in raw.items():
            _check_type(name, value)
        params = cls(**raw)
        params.verify()
        return params

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    def verify(self) -> None:
        """Same checks (and messages naming the field) as SGLang's ``SamplingParams.verify``."""
        if self.top_k == -1 or self.top_k is None:
            self.top_k = TOP_K_ALL
        checks = [
            (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be non-negative, got {self.temperature}."),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}."),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}."),
            (isinstance(self.top_k, int) and self.top_k >= 1,
             f"top_k must be -1 (disable), or at least 1, got {self.top_k}."),
            (self.max_new_tokens is None or (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0),
             f"max_new_tokens must be at least 0, got {self.max_new_tokens}."),
            (isinstance(self.min_new_tokens, int) and 0 <= self.min_new_tokens
             and (self.max_new_tokens is None or self.min_new_tokens <= self.max_new_tokens),
             f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}."),
            (isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}."),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)
        unsupported = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "stop_regex": None,
                       "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "logit_bias": None}
        for name, default in unsupported.items():
            if getattr(self, name) not in (default, None) and not (name == "stop_regex" and not self.stop_regex):
                raise RequestError(f"sampling_params.{name} is not supported by the embedded engine yet "
                                   f"(got {getattr(self, name)!r}); leave it at its default")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return _is_int(value) or isinstance(value, float)


def _is_str_or_strs(value) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


# sampling_params field -> (accepts a non-None value?, what it must be); None is each field's "unset"
# except where the dataclass default is not None (then None is refused too, as SGLang's arithmetic would)
_SAMPLING_TYPES = {
    "max_new_tokens": (_is_int, "an integer"), "min_new_tokens": (_is_int, "an integer"),
    "top_k": (_is_int, "an integer"), "n": (_is_int, "an integer"),
    "stream_interval": (_is_int, "an integer"), "sampling_seed": (_is_int, "an integer"),
    "temperature": (_is_number, "a number"), "top_p": (_is_number, "a number"), "min_p": (_is_number, "a number"),
    "frequency_penalty": (_is_number, "a number"), "presence_penalty": (_is_number, "a number"),
    "repetition_penalty": (_is_number, "a number"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
    "skip_special_tokens": (lambda v: isinstance(v, bool), "true or false"),
    "spaces_between_special_tokens": (lambda v: isinstance(v, bool), "true or false"),
    "no_stop_trim": (lambda v: isinstance(v, bool), "true or false"),
    "stop": (_is_str_or_strs, "a string or a list of strings"),
    "stop_regex": (_is_str_or_strs, "a string or a list of strings"),
    "stop_token_ids": (lambda v: isinstance(v, list) and all(_is_int(t) for t in v), "a list of integers"),
    "json_schema": (lambda v: isinstance(v, str), "a string"), "regex": (lambda v: isinstance(v, str), "a string"),
    "ebnf": (lambda v: isinstance(v, str), "a string"), "structural_tag": (lambda v: isinstance(v, str), "a string"),
    "logit_bias": (lambda v: isinstance(v, dict), "an object"), "custom_params": (lambda v: isinstance(v, dict), "an object"),
}
_NONE_ALLOWED = {f.name for f in fields(SamplingParams) if f.default is None} | {"max_new_tokens", "top_k"}


def _check_type(name: str, value) -> None:
    """400 naming the field for a value of the wrong JSON type (``"max_new_tokens": "5"``)."""
    if value is None and name in _NONE_ALLOWED:
        return
    accepts, expected = _SAMPLING_TYPES[name]
    if not accepts(value):
        raise RequestError(f"sampling_params.{name} must be {expected}, got {value!r} ({type(value).__name__})")


@dataclass
class GenerateRequest:
    """One sequence to generate (a batch or ``n > 1`` body becomes several)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_routed_experts: bool = False  # the MoE experts of positions [routed_experts_start_len, seqlen - 1)
    routed_experts_start_len: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    image_data: list | None = None  # the request's images as sent (paths, data URLs, base64)
    vision: Any = None  # vision.RequestVision once the images are processed (vision-language models)

    @property
    def return_top_p_token_ids(self) -> bool:
        """[slime-patch] ``custom_params.return_top_p_token_ids`` with ``return_logprob``: top-p replay."""
        return self.return_logprob and bool((self.params.custom_params or {}).get("return_top_p_token_ids"))


def _as_list(value, batch: int | None):
    if batch is None:
        return [value]
    if isinstance(value, list):
        if len(value) != batch:
            raise RequestError(f"list field of length {len(value)} does not match the batch size {batch}")
        return value
    return [value] * batch


def parse_generate(body: Any, tokenize, vocab_size: int, context_length: int) -> tuple[list[GenerateRequest], bool]:
    """Validate a ``/generate`` body; return (requests, whether the answer is a list)."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", shape="openai")
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise RequestError("Either text or input_ids should be provided.")
    if body.get("input_embeds") is not None:
        raise RequestError("input_embeds is not supported by the embedded engine yet")
    for media in ("video_data", "audio_data"):
        if body.get(media) is not None:
            raise RequestError(f"{media} is not supported by the embedded engine yet (images: image_data)")
    is_batch = isinstance(text, list) if text is not None else bool(input_ids) and isinstance(input_ids[0], list)
    batch = len(text if text is not None else input_ids) if is_batch else None
    if batch == 0:
        raise RequestError("text/input_ids: an empty batch was given")
    prompts = _prompts(text, input_ids, batch, tokenize)
    sampling = body.get("sampling_params") or {}
    sampling_list = _as_list(sampling, batch)
    if not all(isinstance(entry, dict) for entry in sampling_list):
        raise RequestError(f"sampling_params must be an object (or, for a batch, a list of objects), got "
                           f"{sampling!r:.100}")
    rids = _rids(body.get("rid"), batch)
    logprob_flags = _as_list(bool(body.get("return_logprob", False)), batch) if not isinstance(
        body.get("return_logprob"), list) else _as_list(body["return_logprob"], batch)
    start_lens = _as_list(body.get("logprob_start_len", -1), batch)
    routed_flags = _as_list(body.get("return_routed_experts", False), batch)
    routed_starts = _as_list(body.get("routed_experts_start_len", 0), batch)
    images = _image_data(body.get("image_data"), batch)
    requests = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams.from_dict(sampling_list[i])
        _check_prompt(prompt, params, vocab_size, context_length)
        start_len = -1 if start_lens[i] is None else int(start_lens[i])
        if logprob_flags[i] and start_len > len(prompt):
            raise RequestError(f"logprob_start_len ({start_len}) is larger than the prompt ({len(prompt)} tokens).")
        routed_start = _routed_experts_start(bool(routed_flags[i]), routed_starts[i], len(prompt))
        for k in range(params.n):
            rid = rids[i] if params.n == 1 else uuid.uuid4().hex
            requests.append(GenerateRequest(rid=rid, input_ids=list(prompt), params=params,
                                            return_logprob=bool(logprob_flags[i]), logprob_start_len=start_len,
                                            return_text_in_logprobs=bool(body.get("return_text_in_logprobs")),
                                            stream=bool(body.get("stream", False)),
                                            return_routed_experts=bool(routed_flags[i]),
                                            routed_experts_start_len=routed_start, image_data=images[i]))
    return requests, is_batch or len(requests) > 1


def _image_data(value, batch: int | None) -> list[list | None]:
    """``image_data`` per prompt: one image or a list of them (a batch: a list with one such entry per prompt)."""
    if value is None:
        return [None] * (batch or 1)
    if batch is None:
        return [value if isinstance(value, list) else [value]]
    if not isinstance(value, list) or len(value) != batch:
        raise RequestError(f"image_data: a batch of {batch} prompts needs a list of {batch} entries (an image, a "
                           f"list of images or null per prompt)")
    return [None if v is None else v if isinstance(v, list) else [v] for v in value]


def _routed_experts_start(wanted: bool, start, prompt_len: int) -> int:
    """``routed_experts_start_len``, checked as SGLang's scheduler does when routed experts are asked for."""
    if not wanted:
        return 0
    if not _is_int(start):
        raise RequestError(f"routed_experts_start_len must be an integer, got {start!r}")
    if start < 0:
        raise RequestError(f"recv_req.routed_experts_start_len={start} is lower than 0. Please use a non-negative "
                           "routed_experts_start_len.")
    if start > prompt_len:
        raise RequestError(f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
                           f"len(req.origin_input_ids)={prompt_len}. Please use a smaller routed_experts_start_len.")
    return start


def _prompts(text, input_ids, batch, tokenize) -> list[list[int]]:
    if input_ids is not None:
        prompts = input_ids if batch is not None else [input_ids]
        for prompt in prompts:
            if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise RequestError("input_ids must be a list of ints or a list of lists of ints")
        return prompts
    texts = text if batch is not None else [text]
    if not all(isinstance(t, str) for t in texts):
        raise RequestError("text must be a string or a list of strings")
    return [tokenize(t) for t in texts]


def _rids(rid, batch) -> list[str]:
    if batch is None:
        return [str(rid) if rid is not None else uuid.uuid4().hex]
    if rid is None:
        return [uuid.uuid4().hex for _ in range(batch)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(batch)]
    return [str(r) for r in _as_list(rid, batch)]


def _check_prompt(prompt: list[int], params: SamplingParams, vocab_size: int, context_length: int) -> None:
    if not prompt:
        raise RequestError("input_ids cannot be empty.")
    bad = [t for t in prompt if t < 0 or t >= vocab_size]
    if bad:
        raise RequestError(f"input_ids: token id {bad[0]} is out of the vocabulary range [0, {vocab_size}).")
    if len(prompt) >= context_length:
        raise RequestError(f"The input ({len(prompt)} tokens) is longer than the model's context length "
                           f"({context_length} tokens).")
    if params.max_new_tokens is not None and len(prompt) + params.max_new_tokens > context_length:
        raise RequestError(f"Requested token count exceeds the model's maximum context length of {context_length} "
                           f"tokens. You requested a total of {len(prompt) + params.max_new_tokens} tokens: "
                           f"{len(prompt)} tokens from the input messages and {params.max_new_tokens} tokens for "
                           f"the completion (sampling_params.max_new_tokens). Please reduce the number of tokens "
                           f"in the input messages or the completion to fit within the limit.")
