"""HTTP surface of the embedded engine: SGLang's native endpoints (docs/SGLANG_PROTOCOL.md §1–§6, §8).

Status codes and body shapes follow SGLang: native errors ``400 {"error": {"message"}}``, request
validation errors ``400 {"object": "error", ...}``, unknown sampling keys 400 (SGLang: 500), control endpoints
``{"success", "message"}``, ``/flush_cache`` plain text, memory endpoints JSON ``null``,
``/abort_request`` an empty 200. OpenAI routes live in :mod:`openai_api`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import datetime, timezone

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from slime.backends.embedded_engine.serving.async_engine import AsyncEngine
from slime.backends.embedded_engine.config import ServerArgs
from slime.backends.embedded_engine.engine import Engine
from slime.backends.embedded_engine.io_struct import JSONResponse, RequestError, parse_generate, read_json
from slime.backends.embedded_engine.profiler import add_profile_routes
from slime.backends.embedded_engine.vision import attach_images
from slime.backends.update_weight import wire_format
from slime.utils.http_utils import json_dumps
from slime.utils.misc import load_function

logger = logging.getLogger(__name__)

VERSION = "0.5.15.post1-slime-embedded"
UNAUTHENTICATED_PREFIXES = ("/health", "/metrics")


def error_response(exc: RequestError) -> JSONResponse:
    if exc.shape == "openai":
        return JSONResponse({"object": "error", "message": exc.message, "type": "Bad Request" if exc.status == 400
                             else str(exc.status), "param": None, "code": exc.status}, status_code=exc.status)
    return JSONResponse({"error": {"message": exc.message}}, status_code=exc.status)


class ServerState:
    """What the handlers share: args, engine, its async bridge, the weight-update groups, status."""

    def __init__(self, args: ServerArgs, engine: Engine):
        self.args = args
        self.engine = engine
        self.client = AsyncEngine(engine)
        self.groups: dict[str, object] = {}
        #: per group, the CPU buffer the last flattened bucket was received into (reused: a fresh one per
        #: update page-faults through the whole bucket); taken out while a bucket is received and loaded
        self.receive_buffers: dict[str, torch.Tensor] = {}
        self.released_tags: set[str] = set()
        self.status = "Starting"

    @property
    def model_path(self) -> str:
        return self.engine.runner.model_path


class _Auth:
    """``--api-key``: every path but /health* and /metrics needs ``Authorization: Bearer KEY`` (401 otherwise).
    A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``) runs each request
    through task groups and memory streams, Python time on the server's main thread, which the engine thread
    shares the GIL with."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode("latin-1") if api_key else None

    async def __call__(self, scope, receive, send):
        if (self.expected is not None and scope["type"] == "http"
                and not scope["path"].startswith(UNAUTHENTICATED_PREFIXES)
                and dict(scope["headers"]).get(b"authorization", b"") != self.expected):
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="slime embedded engine", default_response_class=JSONResponse)
    app.state.server = state

    app.add_middleware(_Auth, api_key=state.args.api_key)

    @app.exception_handler(RequestError)
    async def _request_error(_request: Request, exc: RequestError):
        return error_response(exc)

    _add_generate_routes(app, state)
    _add_info_routes(app, state)
    _add_control_routes(app, state)
    _add_weight_routes(app, state)
    from slime.backends.embedded_engine.serving.openai_api import add_openai_routes

    add_openai_routes(app, state)
    add_profile_routes(app, state)
    return app


# ---------------------------------------------------------------------------------------------- /generate
def _add_generate_routes(app: FastAPI, state: ServerState) -> None:
    client = state.client
    runner = state.engine.runner

    def tokenize(text: str) -> list[int]:
        return runner.tokenizer.encode(text, add_special_tokens=False)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        body = await read_json(request)
        requests, as_list = parse_generate(body, tokenize, runner.vocab_size, runner.context_length)
        if any(r.image_data for r in requests):  # loading and processing images: off the event loop
            await asyncio.to_thread(attach_images, runner, requests)
        if requests[0].stream:
            return StreamingResponse(_sse(client, requests), media_type="text/event-stream")
        results = await client.generate(requests)
        outputs = [client.output_dict(seq, latency) for seq, latency in results]
        for seq, _ in results:
            status = (seq.finish_reason or {}).get("status_code")
            if status:
                return JSONResponse({"error": {"message": seq.finish_reason.get("message")}}, status_code=status)
        return JSONResponse(outputs if as_list else outputs[0])


async def _sse(client: AsyncEngine, requests):
    try:
        async for index, seq, finished, snapshot, latency in client.stream(requests):
            chunk = client.output_dict(seq, latency, snapshot, final=finished)
            if len(requests) > 1:
                chunk["index"] = index
            yield b"data: " + json_dumps(chunk) + b"\n\n"
    except RequestError as exc:
        error = {"error": {"message": exc.message, "type": "invalid_request_error", "code": exc.status,
                           "retryable": False}}
        yield f"data: {json.dumps(error)}\n\n"
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------- info
def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    engine, runner = state.engine, state.engine.runner

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        if state.status != "Up":
            return Response(status_code=503)
        ok = await state.client.health_check(state.args.health_check_timeout)
        return Response(status_code=200 if ok else 503)

    def model_info() -> dict:
        config = runner.config
        return {"model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": engine.weight_version,
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None)}

    app.get("/model_info")(model_info)
    app.get("/get_model_info")(model_info)

    def server_info() -> dict:
        shape = runner.kv_cache.shape
        stats = engine.scheduler.stats
        info = state.args.to_dict()
        info.update({
            "model_path": state.model_path, "served_model_name": state.args.served_model_name or state.model_path,
            "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "moe_dp_size": 1, "num_gpus": 0
            if runner.device.type == "cpu" else 1, "disaggregation_mode": "null",
            "disaggregation_bootstrap_port": None, "encoder_only": False, "load_balance_method": "round_robin",
            "context_length": runner.context_length, "weight_version": engine.weight_version, "status": "ready",
            "max_total_num_tokens": shape.num_slots * shape.slot_capacity, "max_req_input_len":
            runner.context_length - 1, "max_running_requests": shape.num_slots, "version": VERSION,
            "kv_events": None, "engine": "slime-embedded",
            "batch_stats": vars(stats).copy(),  # SchedulerStats: batching and decode-time counters
        })
        info["internal_states"] = [{**info, "last_gen_throughput": engine.last_gen_throughput,
                                    "memory_usage": _memory_usage(runner),
                                    "effective_max_running_requests_per_dp": shape.num_slots,
                                    "cuda_graph": runner.graphs.enabled, "cuda_graph_captures": runner.graphs.captures,
                                    "cuda_graph_verify_captures": runner.graphs.verify_captures,
                                    "cuda_graph_capture_seconds": runner.graphs.capture_seconds,
                                    "attention_backend": runner.attention_backend, "fused_ops": runner.fused_ops,
                                    "fused_projections": runner.fused_projections,
                                    # --speculative-adaptive: per batch-size slot, the drafts a step now
                                    "speculative_adaptive": (engine.speculative.adaptive.state() if
                                                             engine.speculative is not None and
                                                             engine.speculative.adaptive is not None else None)}]
        return info

    app.get("/server_info")(server_info)
    app.get("/get_server_info")(server_info)

    @app.get("/v1/loads")
    @app.get("/loads")
    async def loads(include: str = "all", dp_rank: int | None = None, format: str = "json"):
        load = {"dp_rank": 0, **engine.load_info()}
        sections = set(include.split(",")) if include else {"all"}
        if "all" in sections or "memory" in sections:
            load["memory"] = _memory_usage(runner)
        if "all" in sections or "queues" in sections:
            load["queues"] = {"waiting": load["num_waiting_reqs"], "grammar": 0, "paused": 0, "retracted": 0}
        load["batch_stats"] = vars(engine.scheduler.stats).copy()
        rows = [load] if dp_rank in (None, 0) else []
        if format == "prometheus":
            lines = [f'sglang_{k}{{dp_rank="0"}} {v}' for k, v in load.items() if isinstance(v, (int, float))]
            return PlainTextResponse("\n".join(lines) + "\n")
        return {"timestamp": datetime.now(timezone.utc).isoformat(), "version": VERSION, "loads": rows}

    @app.get("/get_load")
    async def get_load():
        info = engine.load_info()
        return [{"dp_rank": 0, "num_reqs": info["num_running_reqs"] + info["num_waiting_reqs"],
                 "num_waiting_reqs": info["num_waiting_reqs"], "num_tokens": info["num_used_tokens"],
                 "num_pending_tokens": info["num_waiting_uncached_tokens"], "ts_tic": time.time()}]

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/metrics")
    async def metrics():
        info = engine.load_info()
        lines = [f'sglang:{k}{{model_name="{state.model_path}"}} {v}' for k, v in info.items()]
        lines.append(f'sglang:generation_tokens_total{{model_name="{state.model_path}"}} '
                     f"{engine.scheduler.stats.generated_tokens}")
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.get("/get_weight_version")
    @app.get("/weight_version")
    async def weight_version():
        return {"weight_version": engine.weight_version}


def _memory_usage(runner) -> dict:
    weight_bytes = runner.weight_bytes()
    shape = runner.kv_cache.shape
    # kv_*: what the cache stores (--kv-cache-dtype resolved), one token's bytes in it, and the token budget
    # the memory limits allow (None: unbounded); an FP8 cache halves the bytes and doubles that budget
    return {"weight": weight_bytes / 2**30, "kvcache": runner.kv_cache.nbytes() / 2**30,
            "token_capacity": shape.num_slots * shape.slot_capacity, "graph": 0.0,
            "kv_cache_dtype": str(runner.kv_cache.dtype).removeprefix("torch."),
            "kv_bytes_per_token": shape.bytes_per_token(runner.kv_cache.dtype),
            "kv_token_budget": runner.kv_token_budget}


# ---------------------------------------------------------------------------------------------- control
def _add_control_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    async def on_engine(fn):
        return await asyncio.wrap_future(engine.call(fn))

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await read_json(request, required=False)
        rid, abort_all = body.get("rid") or "", bool(body.get("abort_all", False))
        if abort_all or (rid and rid in state.client.inflight):
            await on_engine(lambda: engine.abort(rid, abort_all=abort_all, message=body.get("abort_message")))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await read_json(request, required=False)
        mode = body.get("mode", "abort")
        try:
            await on_engine(lambda: engine.pause(mode))
        except ValueError as exc:
            raise RequestError(str(exc))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await read_json(request, required=False)

        def resume():
            engine.paused = False
        await on_engine(resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = 0.0):
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            if await on_engine(engine.flush_cache):
                return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. (When there are "
                                         "running or waiting requests, the operation will not be performed.)\n")
            if time.monotonic() >= deadline:
                return PlainTextResponse("Flush cache failed.\n", status_code=400)
            await asyncio.sleep(0.05)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory(request: Request):
        return await _memory_op(state, await read_json(request, required=False), release=True)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory(request: Request):
        return await _memory_op(state, await read_json(request, required=False), release=False)


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
RELEASE_WAIT_S = 60.0  # how long a release waits for the requests in flight (body "timeout" overrides)


class _Busy(RuntimeError):
    """The engine still has requests; a release retries until they finish or its wait runs out."""


async def _memory_op(state: ServerState, body: dict, release: bool):
    engine, runner = state.engine, state.engine.runner
    tags = body.get("tags") or list(MEMORY_TAGS)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        return JSONResponse({"error": {"message": f"tags: unknown memory tag(s) {unknown}; use {MEMORY_TAGS}"}}, 400)
    wait = body.get("timeout", RELEASE_WAIT_S)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0:
        return JSONResponse({"error": {"message": f"timeout must be a number of seconds >= 0, got {wait!r}"}}, 400)

    def apply():
        if release and engine.scheduler.has_work():  # checked and released in one engine-thread call: no gap
            info = engine.load_info()
            if engine.paused:  # nothing finishes while paused
                raise RuntimeError(f"release_memory_occupation: generation is paused with {info['num_running_reqs']} "
                                   f"running and {info['num_waiting_reqs']} waiting request(s); abort them "
                                   "(/abort_request with abort_all) or continue generation first")
            raise _Busy(f"release_memory_occupation waited {wait:g} s for {info['num_running_reqs']} running and "
                        f"{info['num_waiting_reqs']} waiting request(s) to finish; abort them first "
                        "(/abort_request with abort_all) or send a longer timeout")
        for tag in tags:
            if not release and tag not in state.released_tags:
                raise RuntimeError(f"tags: {tag!r} is not released, so it cannot be resumed")
            if tag == "weights":
                runner.release_weights() if release else runner.resume_weights()
            elif tag == "kv_cache" and runner.device.type == "cuda":
                if runner.saver is None:
                    runner.graphs.clear()  # captured against the buffers, which move (the memory saver keeps them)
                runner.kv_cache.release() if release else runner.kv_cache.allocate()
            (state.released_tags.add if release else state.released_tags.discard)(tag)
        engine.paused = bool(state.released_tags & {"weights", "kv_cache"}) or engine.paused and release
        return None

    # a release waits for what the engine is running (a health probe, a warm-up, the end of a rollout): it
    # retries between engine steps until the scheduler is empty; a resume needs no idle engine
    deadline = time.monotonic() + wait
    while True:
        try:
            await asyncio.wrap_future(engine.call(apply))
            return JSONResponse(None)
        except _Busy as exc:
            if time.monotonic() >= deadline:
                return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
            await asyncio.sleep(0.01)
        except RuntimeError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)


# ---------------------------------------------------------------------------------------------- weights
def _add_weight_routes(app: FastAPI, state: ServerState) -> None:
    engine, runner = state.engine, state.engine.runner

    async def update(body: dict, load) -> JSONResponse:
        """Run ``load()`` (returns tensors loaded) on the engine thread; advance weight_version."""
        version = body.get("weight_version")

        def apply():
            if body.get("abort_all_requests"):
                engine.abort(None, abort_all=True)
            load()
            if version is not None:
                engine.weight_version = str(version)

        try:
            await asyncio.wrap_future(engine.call(apply))
        except Exception as exc:  # reported to the caller; the server keeps the weights it has
            logger.warning("weight update failed: %s", exc)
            return JSONResponse({"success": False, "message": f"Failed to update weights: {exc}. The weights may be "
                                 "partially updated; discard them and retry."}, status_code=400)
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    session = {"open": False}  # SGLang's weight-update session; loads are not refused outside one here

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request):
        if session["open"]:
            return JSONResponse({"success": False, "message": "a weight-update session is already open; call "
                                 "end_weight_update() first"}, status_code=400)
        session["open"] = True
        return {"success": True, "message": "Success"}

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request):
        if not session["open"]:
            return JSONResponse({"success": False, "message": "no weight-update session is open; call "
                                 "begin_weight_update() first"}, status_code=400)
        session["open"] = False
        return {"success": True, "message": "Success"}

    @app.post("/update_weights_from_disk")
    async def from_disk(request: Request):
        body = await read_json(request)
        if not body.get("model_path"):
            raise RequestError("model_path is required", shape="openai")
        return await update(body, lambda: runner.load_from_disk(body["model_path"]))

    @app.post("/pull_weights")
    async def pull_weights(request: Request):
        """[slime-patch] Bring a host-local checkpoint to a published version (delta disk sync);
        the caller then loads it with /update_weights_from_disk."""
        from slime.backends.update_weight.pull import PullError, pull_weights as pull

        body = await read_json(request)
        missing = [k for k in ("local_checkpoint_dir", "source_dir", "target_version") if body.get(k) is None]
        if missing:
            return JSONResponse({"success": False, "message": f"missing required field(s): {missing}"}, status_code=400)
        hook = state.args.custom_pull_weights_pre_read_hook
        try:
            hook_fn = load_function(hook) if hook else None
        except Exception as exc:
            return JSONResponse({"success": False, "message": f"--custom-pull-weights-pre-read-hook {hook!r} cannot "
                                 f"be loaded: {exc}"}, status_code=400)
        try:
            message = await asyncio.to_thread(pull, body["local_checkpoint_dir"], body["source_dir"],
                                              int(body["target_version"]), base_checkpoint=state.args.model_path,
                                              pre_read_hook=hook_fn)
        except (PullError, OSError, ValueError) as exc:
            logger.warning("pull_weights failed: %s", exc)
            return JSONResponse({"success": False, "message": f"Failed to pull weights: {exc}"}, status_code=400)
        return {"success": True, "message": message}

    @app.post("/update_weights_from_tensor")
    async def from_tensor(request: Request):
        body = await read_json(request)
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries:
            raise RequestError("serialized_named_tensors is required (one entry per TP rank)", shape="openai")
        load_format = body.get("load_format")

        def load():
            named = wire_format.deserialize_named_tensors(entries[0], load_format)
            runner.load_named_tensors(named)
        return await update(body, load)

    @app.post("/init_weights_update_group")
    async def init_group(request: Request):
        body = await read_json(request)
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
        if missing:
            raise RequestError(f"missing required field(s): {missing}", shape="openai")
        name = body.get("group_name", "weight_update_group")
        backend = body.get("backend", "nccl" if runner.device.type == "cuda" else "gloo")
        host = body["master_address"]
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        try:
            group = await asyncio.to_thread(wire_format.init_custom_process_group, backend,
                                            f"tcp://{host}:{body['master_port']}", int(body["world_size"]),
                                            int(body["rank_offset"]), name)
        except Exception as exc:
            return JSONResponse({"success": False, "message": f"Failed to initialize custom process group: {exc}"},
                                status_code=400)
        state.groups[name] = group
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request):
        body = await read_json(request, required=False)
        name = body.get("group_name", "weight_update_group")
        group = state.groups.pop(name, None)
        state.receive_buffers.pop(name, None)
        if group is None:
            return JSONResponse({"success": False, "message": "The group to be destroyed does not exist."}, 400)
        import torch.distributed as dist

        await asyncio.to_thread(dist.destroy_process_group, group)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    @app.post("/update_weights_from_distributed")
    async def from_distributed(request: Request):
        body = await read_json(request)
        missing = [k for k in ("names", "dtypes", "shapes") if k not in body]
        if missing:
            raise RequestError(f"missing required field(s): {missing}", shape="openai")
        name = body.get("group_name", "weight_update_group")
        group = state.groups.get(name)
        if group is None:
            return JSONResponse({"success": False, "message": f"group {body.get('group_name')!r} is not initialized; "
                                 "call /init_weights_update_group first"}, status_code=400)
        flattened = body.get("load_format") == "flattened_bucket"
        buffer = None
        if flattened and runner.device.type == "cpu":  # the last update's buffer, while no other bucket uses it
            import torch

            try:
                need = wire_format.bucket_nbytes(body["dtypes"], body["shapes"])
            except ValueError as exc:
                raise RequestError(str(exc), shape="openai")
            buffer = state.receive_buffers.pop(name, None)
            if buffer is None or buffer.numel() < need:
                buffer = torch.empty(need, dtype=torch.uint8)
        try:  # the broadcasts block: receive them on a worker thread, load between engine steps
            named = await asyncio.to_thread(wire_format.receive_broadcast, group, body["names"], body["dtypes"],
                                            body["shapes"], runner.device, flattened, buffer)
        except Exception as exc:
            return JSONResponse({"success": False, "message": f"Failed to receive weights: {exc}"}, status_code=400)
        response = await update(body, lambda: runner.load_named_tensors(named))
        if buffer is not None:  # loaded: the model holds copies, the buffer is free for the next bucket
            state.receive_buffers[name] = buffer
        return response

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request):
        body = await read_json(request)
        try:
            tensor = runner.get_weight(body.get("name", ""))
        except (KeyError, RuntimeError) as exc:  # unknown name; released, or not rewritten since the resume
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        truncate = int(body.get("truncate_size", 100))
        return tensor.detach().float().reshape(-1)[:truncate].tolist() if tensor.dim() <= 1 else \
            tensor.detach().float()[:truncate].tolist()

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await read_json(request)
        if "new_version" not in body:
            return JSONResponse({"success": False, "message": "new_version is required"}, status_code=400)
        return await update({"weight_version": body["new_version"],
                             "abort_all_requests": body.get("abort_all_requests", True)}, lambda: None)
