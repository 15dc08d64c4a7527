"""A stand-in SGLang server answering with the exact shapes of SGLANG_PROTOCOL.md (errors included).

Run as a process: ``python -m tests.backends.sglang_utils.sglang_stand_in --port P [--tp-size N]``.
It "generates" deterministic tokens (``prompt[-1] + 1, + 2, ...``, 4 by default, then a stop token),
reports the doc's meta_info keys (spec-decoding counters under SGLang's current names), blocks
``/generate`` while paused, answers ``/health_generate`` 503 while paused and idle, refuses
``/flush_cache`` while busy, serves batches (``input_ids`` a list of lists: a list of answers), and joins a real torch.distributed (gloo) weight-update group: the
weights it receives are kept and their checksums served at ``GET /stand_in/weights``. Errors:
an unknown ``sampling_params`` key -> 500 plain text; a prompt longer than ``--context-length`` ->
400 ``{"error": {"message"}}``; a request missing ``names`` -> 400 ``{"object": "error", ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from aiohttp import web

STOP_TOKEN = 2
SAMPLING_KEYS = {"max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                 "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "stop_regex", "ignore_eos",
                 "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n", "json_schema", "regex",
                 "ebnf", "structural_tag", "logit_bias", "custom_params", "stream_interval", "sampling_seed"}


class StandInSGLang:
    def __init__(self, port: int, tp_size: int, context_length: int, token_delay_s: float):
        self.port, self.tp_size, self.context_length, self.token_delay_s = port, tp_size, context_length, token_delay_s
        self.weight_version = "default"
        self.paused = asyncio.Event()  # set = running
        self.paused.set()
        self.running: dict[str, asyncio.Event] = {}
        self.group = None
        self.weights: dict[str, list] = {}
        self.calls: list[str] = []
        self.session_open = False  # SGLang 0.5.23 loads broadcast weights only inside a weight-update session

    # ---------------------------------------------------------------- generation

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        params = body.get("sampling_params") or {}
        unknown = set(params) - SAMPLING_KEYS
        if unknown:  # SGLang splats sampling_params into a struct: TypeError -> plain-text 500
            return web.Response(status=500, text="Internal Server Error", content_type="text/plain")
        prompt = body.get("input_ids")
        if not prompt:
            return web.json_response({"error": {"message": "input_ids cannot be empty."}}, status=400)
        prompts = prompt if isinstance(prompt[0], list) else [prompt]  # a list of lists is a batch
        for one in prompts:
            if len(one) >= self.context_length:
                return web.json_response({"error": {"message": f"The input ({len(one)} tokens) is longer than the "
                                                               f"model's context length ({self.context_length} "
                                                               f"tokens)."}}, status=400)
        await self.paused.wait()  # requests block (no error) while paused
        if prompts is prompt:  # a batch: each prompt its own request (string rid expanded to rid_i), answers in order
            rid = body.get("rid")
            rids = [f"{rid}_{i}" if rid else uuid.uuid4().hex for i in range(len(prompts))]
            outputs = await asyncio.gather(*(self._generate_one(body, params, one, r) for one, r in zip(prompts, rids)))
            return web.json_response(outputs)
        return web.json_response(await self._generate_one(body, params, prompt, body.get("rid") or uuid.uuid4().hex))

    async def _generate_one(self, body: dict, params: dict, prompt: list[int], rid: str) -> dict:
        abort = asyncio.Event()
        self.running[rid] = abort
        start = time.time()
        max_new = params.get("max_new_tokens", 128)
        planned = [(prompt[-1] + i) % 50 + 3 for i in range(1, 5)] + [STOP_TOKEN]
        output, finish = [], None
        try:
            for token in planned:
                if len(output) >= max_new:
                    finish = {"type": "length", "length": max_new}
                    break
                try:
                    await asyncio.wait_for(abort.wait(), self.token_delay_s)
                except asyncio.TimeoutError:
                    pass
                if abort.is_set():
                    finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                    break
                output.append(token)
        finally:
            self.running.pop(rid, None)
        finish = finish or {"type": "stop", "matched": STOP_TOKEN}
        logprobs = [[-0.125 * (i + 1), t, None] for i, t in enumerate(output)] if body.get("return_logprob") else None
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt), "weight_version": self.weight_version,
                "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": len(output), "cached_tokens": 0,
                "e2e_latency": time.time() - start, "response_sent_to_client_ts": time.time(),
                "spec_verify_ct": max(1, len(output) // 2), "spec_num_correct_drafts": len(output) // 2,
                "spec_num_proposed_drafts": len(output), "spec_accepted_drafts": len(output) // 2,
                "spec_proposed_drafts": len(output)}
        if logprobs is not None:
            meta.update(input_token_logprobs=[], output_token_logprobs=logprobs, output_token_logprobs_length=len(output))
        text = "".join(chr(ord("a") + t % 26) for t in output)
        return {"text": text, "output_ids": output, "meta_info": meta}

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await request.json()
        for rid, event in list(self.running.items()):
            if body.get("abort_all") or (body.get("rid") and rid.startswith(body["rid"])):
                event.set()
        return web.Response(status=200)  # empty body

    async def pause_generation(self, request: web.Request) -> web.Response:
        self.paused.clear()
        for event in list(self.running.values()):  # mode "abort" (the default)
            event.set()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.paused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    # ---------------------------------------------------------------- health, info, load

    async def health(self, request: web.Request) -> web.Response:
        if not self.paused.is_set() and not self.running:  # the probe request would block: 503 after a timeout
            await asyncio.sleep(0.5)
            return web.Response(status=503)
        return web.Response(status=200)

    def _server_args(self) -> dict:
        return {"model_path": "stand-in", "tokenizer_path": "stand-in", "tp_size": self.tp_size, "pp_size": 1,
                "dp_size": 1, "ep_size": 1, "moe_dp_size": 1, "context_length": self.context_length,
                "disaggregation_mode": "null", "disaggregation_bootstrap_port": 8998, "encoder_only": False,
                "weight_version": self.weight_version, "port": self.port, "load_balance_method": "auto"}

    async def server_info(self, request: web.Request) -> web.Response:
        args = self._server_args()
        return web.json_response({**args, "status": "ready", "max_total_num_tokens": 4096, "max_req_input_len": 4000,
                                  "internal_states": [{**args, "last_gen_throughput": 0.0}], "version": "0.5.23",
                                  "kv_events": None})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "stand-in", "tokenizer_path": "stand-in", "is_generation": True,
                                  "preferred_sampling_params": None, "weight_version": self.weight_version,
                                  "has_image_understanding": False, "has_audio_understanding": False,
                                  "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})

    async def weight_version_route(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def loads(self, request: web.Request) -> web.Response:
        core = {"dp_rank": 0, "num_running_reqs": len(self.running), "num_waiting_reqs": 0,
                "num_waiting_uncached_tokens": 0, "num_used_tokens": 0, "num_total_tokens": 4096,
                "max_total_num_tokens": 4096, "max_running_requests": 64, "token_usage": 0.0, "gen_throughput": 0.0,
                "cache_hit_rate": 0.0, "utilization": 0.0}
        return web.json_response({"timestamp": "2026-11-29T00:00:00Z", "version": "0.5.23", "loads": [core]})

    async def get_load(self, request: web.Request) -> web.Response:
        return web.json_response([{"dp_rank": 0, "num_reqs": len(self.running), "num_waiting_reqs": 0, "num_tokens": 0}])

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.5.23"})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="# stand-in\n", content_type="text/plain")

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.running:
            return web.Response(status=400, text="Cache not flushed: there are running or waiting requests.",
                                content_type="text/plain")
        return web.Response(status=200, text="Cache flushed.\nPlease check backend logs for more details. (When there "
                            "are running or waiting requests, the operation will not be performed.)",
                            content_type="text/plain")

    async def memory(self, request: web.Request) -> web.Response:
        return web.json_response(None)

    # ---------------------------------------------------------------- weights (gloo group, rank_offset + tp_rank)

    async def init_group(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.tp_size != 1:
            return web.json_response({"success": False, "message": "stand-in joins groups with tp_size 1 only"}, status=400)
        from datetime import timedelta

        from slime.backends.update_weight.wire_format import init_custom_process_group

        address = body["master_address"].strip("[]")
        init = f"tcp://{address}:{body['master_port']}"
        try:
            self.group = await asyncio.to_thread(init_custom_process_group, body.get("backend", "nccl"), init,
                                                 body["world_size"], body["rank_offset"],
                                                 body.get("group_name", "weight_update_group"), timedelta(seconds=60))
        except Exception as e:
            return web.json_response({"success": False, "message": f"Failed to initialize custom process group: {e}"},
                                     status=400)
        self.calls.append("init_weights_update_group")
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        if self.session_open:
            return web.json_response({"success": False, "message": "a weight-update session is already open; call "
                                      "end_weight_update() first"}, status=400)
        self.session_open = True
        self.calls.append("begin_weight_update")
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        if not self.session_open:
            return web.json_response({"success": False, "message": "no weight-update session is open; call "
                                      "begin_weight_update() first"}, status=400)
        self.session_open = False
        self.calls.append("end_weight_update")
        return web.json_response({"success": True, "message": "Success"})

    async def update_distributed(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not self.session_open:  # refused before the broadcast is joined, as SGLang's scheduler does
            return web.json_response({"success": False, "message": "update_weights_from_distributed must run between "
                                      "begin_weight_update() and end_weight_update()"}, status=400)
        missing = [k for k in ("names", "dtypes", "shapes") if k not in body]
        if missing:
            return web.json_response({"object": "error", "message": f"missing fields {missing}", "type": "Bad Request",
                                      "param": None, "code": 400}, status=400)
        import torch
        import torch.distributed as dist

        from slime.backends.update_weight.wire_format import FlattenedTensorMetadata, unflatten_tensors

        dtypes = [getattr(torch, d) for d in body["dtypes"]]
        sizes = [torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in zip(body["shapes"], dtypes)]
        if body.get("load_format") == "flattened_bucket":
            buffer = torch.empty(sum(sizes), dtype=torch.uint8)
            await asyncio.to_thread(dist.broadcast, buffer, 0, self.group)
            metadata, offset = [], 0
            for name, shape, dtype, size in zip(body["names"], body["shapes"], dtypes, sizes):
                metadata.append(FlattenedTensorMetadata(name, tuple(shape), dtype, offset, offset + size, size))
                offset += size
            received = unflatten_tensors(buffer, metadata)
        else:  # one broadcast per tensor, in list order
            received = []
            for name, shape, dtype in zip(body["names"], body["shapes"], dtypes):
                tensor = torch.empty(shape, dtype=dtype)
                await asyncio.to_thread(dist.broadcast, tensor, 0, self.group)
                received.append((name, tensor))
        for name, tensor in received:
            self.weights[name] = tensor.float().reshape(-1).tolist()
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        self.calls.append("update_weights_from_distributed")
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def destroy_group(self, request: web.Request) -> web.Response:
        if self.group is None:
            return web.json_response({"success": False, "message": "The group to be destroyed does not exist."},
                                     status=400)
        self.group = None
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def stand_in_weights(self, request: web.Request) -> web.Response:
        return web.json_response({"weights": self.weights, "calls": self.calls})

    # ---------------------------------------------------------------- app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024**2)
        post = {"/generate": self.generate, "/abort_request": self.abort_request,
                "/pause_generation": self.pause_generation, "/continue_generation": self.continue_generation,
                "/release_memory_occupation": self.memory, "/resume_memory_occupation": self.memory,
                "/init_weights_update_group": self.init_group, "/update_weights_from_distributed": self.update_distributed,
                "/destroy_weights_update_group": self.destroy_group, "/flush_cache": self.flush_cache,
                "/begin_weight_update": self.begin_weight_update, "/end_weight_update": self.end_weight_update}
        get = {"/health": self.health, "/health_generate": self.health, "/server_info": self.server_info,
               "/get_server_info": self.server_info, "/model_info": self.model_info,
               "/get_model_info": self.model_info, "/get_weight_version": self.weight_version_route,
               "/weight_version": self.weight_version_route, "/v1/loads": self.loads, "/get_load": self.get_load,
               "/version": self.version, "/metrics": self.metrics, "/flush_cache": self.flush_cache,
               "/stand_in/weights": self.stand_in_weights}
        for path, handler in post.items():
            app.router.add_post(path, handler)
        for path, handler in get.items():
            app.router.add_get(path, handler)
        return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--context-length", type=int, default=64)
    parser.add_argument("--token-delay-s", type=float, default=0.01)
    opts = parser.parse_args()
    server = StandInSGLang(opts.port, opts.tp_size, opts.context_length, opts.token_delay_s)
    web.run_app(server.app(), host=opts.host, port=opts.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
