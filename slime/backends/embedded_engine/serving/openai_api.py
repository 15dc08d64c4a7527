"""OpenAI-compatible routes: ``/v1/chat/completions`` (chat template, tools) and ``/v1/completions``.

Both translate to :class:`GenerateRequest` objects and run through the same engine as
``/generate``. Errors use the OpenAI envelope (``{"object": "error", "type": "BadRequest", ...}``).
``return_meta_info: true`` adds the native ``meta_info`` (token-id log-probs) to each choice.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Request

from slime.agent.tool_parser import get_tool_parser
from slime.backends.embedded_engine.io_struct import GenerateRequest, JSONResponse, RequestError, SamplingParams, read_json
from slime.utils.multimodal import images_of_messages, unwrap_image

FINISH_TYPES = {"stop": "stop", "length": "length", "abort": "abort"}


def _openai_error(message: str, status: int = 400) -> RequestError:
    return RequestError(message, status=status, shape="openai")


def _sampling(body: dict, max_tokens_default: int | None) -> SamplingParams:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", max_tokens_default))
    raw = {"max_new_tokens": max_tokens, "temperature": body.get("temperature", 1.0) if body.get("temperature")
           is not None else 1.0, "top_p": body.get("top_p") or 1.0, "top_k": body.get("top_k") or -1,
           "min_p": body.get("min_p") or 0.0, "stop": body.get("stop"), "stop_token_ids": body.get("stop_token_ids"),
           "ignore_eos": bool(body.get("ignore_eos", False)), "n": int(body.get("n") or 1),
           "skip_special_tokens": body.get("skip_special_tokens", True),
           "no_stop_trim": bool(body.get("no_stop_trim", False)), "min_new_tokens": body.get("min_tokens") or 0,
           "sampling_seed": body.get("seed")}
    try:
        return SamplingParams.from_dict(raw)
    except RequestError as exc:
        raise _openai_error(exc.message)


def _requests(state, prompt_ids: list[int], params: SamplingParams, body: dict) -> list[GenerateRequest]:
    runner = state.engine.runner
    if not prompt_ids:
        raise _openai_error("prompt: the prompt is empty")
    if len(prompt_ids) >= runner.context_length:
        raise _openai_error(f"The input ({len(prompt_ids)} tokens) is longer than the model's context length "
                            f"({runner.context_length} tokens).")
    if params.max_new_tokens is None:
        params.max_new_tokens = max(1, runner.open_length - len(prompt_ids))
    params.max_new_tokens = min(params.max_new_tokens, runner.context_length - len(prompt_ids))
    base = body.get("rid") or uuid.uuid4().hex
    want_logprobs = bool(body.get("logprobs")) or bool(body.get("return_meta_info"))
    return [GenerateRequest(rid=base if params.n == 1 else f"{base}_{i}", input_ids=list(prompt_ids), params=params,
                            return_logprob=want_logprobs) for i in range(params.n)]


def add_openai_routes(app: FastAPI, state) -> None:
    engine, client, runner = state.engine, state.client, state.engine.runner
    tokenizer = runner.tokenizer
    model_name = lambda: state.args.served_model_name or state.model_path  # noqa: E731

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        if body.get("stream"):
            raise _openai_error("stream: streaming chat completions are not supported by the embedded engine yet")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _openai_error("messages: a non-empty list of messages is required")
        tools = body.get("tools") or None
        tool_choice = body.get("tool_choice", "auto" if tools else "none")
        if isinstance(body.get("input_ids"), list):
            prompt_ids = body["input_ids"]
        else:
            try:
                prompt_ids = tokenizer.apply_chat_template(
                    messages, tools=tools if tool_choice != "none" else None, add_generation_prompt=True,
                    tokenize=False, **(body.get("chat_template_kwargs") or {}))
            except Exception as exc:  # template errors are the caller's messages, not a server fault
                raise _openai_error(f"messages: the chat template failed: {exc}")
            prompt_ids = tokenizer.encode(prompt_ids, add_special_tokens=False)
        images = [unwrap_image(part) for part in images_of_messages(messages)]
        vision = None
        if images:  # image_url / image parts: placeholders expanded, images processed off the event loop
            if runner.vision is None:
                raise _openai_error("messages: image parts were given but the served model has no vision tower")
            try:
                prompt_ids, vision = await asyncio.to_thread(runner.vision.prepare, list(prompt_ids), images)
            except RequestError as exc:
                raise _openai_error(exc.message)
        params = _sampling(body, None)
        if tools and tool_choice != "none":
            params.skip_special_tokens = False  # the <tool_call> markers are special tokens; the parser needs them
        requests = _requests(state, prompt_ids, params, body)
        for request in requests:
            request.vision = vision
        results = await client.generate(requests)
        parser = get_tool_parser(state.args.tool_call_parser) if tools and tool_choice != "none" else None
        choices = [_chat_choice(client, i, seq, latency, parser, tools, body) for i, (seq, latency) in enumerate(results)]
        return _envelope("chat.completion", results, choices, model_name(), prompt_ids)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        if body.get("stream") or body.get("echo"):
            raise _openai_error("stream/echo are not supported by /v1/completions of the embedded engine yet")
        prompt = body.get("prompt")
        if prompt is None:
            raise _openai_error("prompt is required")
        if body.get("max_tokens", 16) is not None and body.get("max_tokens", 16) <= 0:
            raise _openai_error("max_tokens must be positive")
        prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        params = _sampling(body, 16)
        choices, all_results, index = [], [], 0
        for item in prompts:
            ids = item if isinstance(item, list) else tokenizer.encode(item, add_special_tokens=False)
            results = await client.generate(_requests(state, ids, params, body))
            for seq, latency in results:
                choices.append(_completion_choice(client, index, seq, latency, body))
                index += 1
            all_results.extend(results)
        return _envelope("text_completion", all_results, choices, model_name(), None)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name(), "object": "model", "created": int(time.time()),
                                            "owned_by": "sglang", "root": model_name(), "parent": None,
                                            "max_model_len": runner.context_length}]}


def _finish(seq) -> tuple[str, object]:
    reason = seq.finish_reason or {}
    return FINISH_TYPES.get(reason.get("type"), reason.get("type")), reason.get("matched")


def _chat_choice(client, index, seq, latency, parser, tools, body) -> dict:
    text = client.engine.output_text(seq)
    finish, matched = _finish(seq)
    message = {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None}
    if parser is not None and parser.has_tool_call(text):
        parsed = parser.parse(text, tools)
        if parsed.tool_calls:
            message["content"] = parsed.content or None
            message["tool_calls"] = [call.to_openai(i) for i, call in enumerate(parsed.tool_calls)]
            if finish == "stop":
                finish, matched = "tool_calls", None
    choice = {"index": index, "message": message, "logprobs": None, "finish_reason": finish, "matched_stop": matched}
    if body.get("logprobs"):
        tok = client.engine.tokenizer
        choice["logprobs"] = {"content": [
            {"token": tok.decode([t]), "bytes": list(tok.decode([t]).encode()), "logprob": lp, "top_logprobs": []}
            for t, lp in zip(seq.output_ids, seq.output_logprobs)]}
    if body.get("return_meta_info"):
        choice["meta_info"] = client.meta_info(seq, latency)
    return choice


def _completion_choice(client, index, seq, latency, body) -> dict:
    finish, matched = _finish(seq)
    choice = {"index": index, "text": client.engine.output_text(seq), "logprobs": None, "finish_reason": finish,
              "matched_stop": matched}
    if body.get("logprobs") is not None:
        tok = client.engine.tokenizer
        choice["logprobs"] = {"text_offset": [-1] * len(seq.output_ids), "token_logprobs": list(seq.output_logprobs),
                              "tokens": [tok.decode([t]) for t in seq.output_ids],
                              "top_logprobs": [None] * len(seq.output_ids)}
    if body.get("return_meta_info"):
        choice["meta_info"] = client.meta_info(seq, latency)
    return choice


def _envelope(kind: str, results, choices, model: str, prompt_ids) -> JSONResponse:
    prompt_tokens = len(results[0][0].request.input_ids) if results else 0
    completion = sum(len(seq.output_ids) for seq, _ in results)
    return JSONResponse({"id": results[0][0].rid if results else uuid.uuid4().hex, "object": kind,
                         "created": int(time.time()), "model": model, "choices": choices,
                         "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                   "total_tokens": prompt_tokens + completion, "reasoning_tokens": 0}})
