"""SGLang 0.5.23's own HTTP front end on the CPU, for slime's clients to talk to.

Run as ``python -m tests.backends.sglang_utils.sglang_front_end --port P`` with SGLang on the path
(``sglang_env.subprocess_env()``). What answers is SGLang's code wherever it can run here:

* SGLang's FastAPI ``app`` from ``sglang.srt.entrypoints.http_server``: its routes, its parsing of
  every body into SGLang's request classes (``io_struct``), its ``/generate`` contract check, its
  status codes and error envelopes.
* Behind it, in the tokenizer manager's place (whose scheduler and model need CUDA), a stand-in
  that hands each request to SGLang's own request-handling code: ``normalize_batch_and_arguments``
  and ``SamplingParams(**...).normalize/verify`` for ``/generate``; SGLang's payload normalizer,
  ``MultiprocessingSerializer`` (``SafeUnpickler``) and the model runner's ``WeightUpdater``
  (``FlattenedTensorBucket``) for ``/update_weights_from_tensor``; the same ``WeightUpdater`` to
  join the trainer's process group (gloo) and receive ``/update_weights_from_distributed``
  broadcasts; and the scheduler's weight-update session rule (tensor and broadcast loads only
  between ``/begin_weight_update`` and ``/end_weight_update``).

What is not SGLang's: generation itself (deterministic tokens ``prompt[-1] + 1 ...`` then token 2,
as ``sglang_stand_in`` makes) and the ``meta_info`` it is reported with, which uses the key names
SGLang's tokenizer manager writes. ``GET /probe/state`` (the probe's own route) shows what arrived.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from tests.backends.sglang_utils.sglang_env import prepare_imports

STOP_TOKEN = 2


class _RecordingModel:
    """The model's ``load_weights``, as the weight updater calls it: keeps what it was given."""

    def __init__(self):
        self.loaded: dict[str, dict] = {}

    def modules(self):
        return iter(())

    def load_weights(self, named_tensors):
        for name, tensor in named_tensors:
            self.loaded[name] = {"dtype": str(tensor.dtype).replace("torch.", ""), "shape": list(tensor.shape),
                                 "values": tensor.float().reshape(-1).tolist()}


class TokenizerManagerStandIn:
    def __init__(self, model_path: str, vocab_size: int, context_length: int):
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
        from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer

        self.tokenizer = get_tokenizer(model_path)  # SGLang's loader: stop strings are checked against it

        self.vocab_size, self.context_length = vocab_size, context_length
        self.model = _RecordingModel()
        self.weight_updater = WeightUpdater(
            tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
            get_model=lambda: self.model, update_model_fields=lambda **_: None, recapture_cuda_graph=lambda: None,
            get_model_runner=lambda: None)
        self.session_open = False
        self.weight_version = "default"
        self.paused = False
        self.log: list[dict] = []  # every request, as SGLang's request class parsed it
        # attributes the app reads
        self.gracefully_exit = False
        self.server_status = None
        self.is_generation = True
        self.last_receive_tstamp = 0.0
        self.server_args = None
        self.rid_to_state: dict = {}
        self.startup_time = time.time()

    async def get_internal_state(self):
        return [{"weight_version": self.weight_version}]

    def _record(self, route: str, obj) -> None:
        from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

        fields = msgspec_to_builtins(obj) if not hasattr(obj, "__dataclass_fields__") else {
            k: getattr(obj, k) for k in obj.__dataclass_fields__ if getattr(obj, k) is not None}
        if route == "/update_weights_from_tensor":
            fields = {k: v for k, v in fields.items() if k != "serialized_named_tensors"}
            fields["num_serialized_named_tensors"] = len(obj.serialized_named_tensors)
        self.log.append({"route": route, "class": type(obj).__name__, "fields": _plain(fields)})

    # ------------------------------------------------------------------ generation

    async def generate_request(self, obj, request=None):
        from sglang.srt.sampling.sampling_params import SamplingParams

        self._record("/generate", obj)
        obj.normalize_batch_and_arguments()  # what TokenizerManager.generate_request does first
        if not obj.is_single:
            raise ValueError("this probe serves single requests only")
        params = SamplingParams(**dict(obj.sampling_params or {}))
        params.normalize(self.tokenizer)
        params.verify(self.vocab_size)
        prompt = list(obj.input_ids)
        if len(prompt) >= self.context_length:
            raise ValueError(f"The input ({len(prompt)} tokens) is longer than the model's context length "
                             f"({self.context_length} tokens).")
        while self.paused:
            await asyncio.sleep(0.02)
        start = time.time()
        planned = [(prompt[-1] + i) % 50 + 3 for i in range(1, 5)] + [STOP_TOKEN]
        output = planned[:params.max_new_tokens] if params.max_new_tokens is not None else planned
        finish = {"type": "stop", "matched": STOP_TOKEN} if output == planned else \
            {"type": "length", "length": len(output)}
        meta = {"id": obj.rid or uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(prompt),
                "weight_version": self.weight_version, "completion_tokens": len(output), "cached_tokens": 0,
                "e2e_latency": time.time() - start}
        if obj.return_logprob:
            meta["output_token_logprobs"] = [[-0.125 * (i + 1), t, None] for i, t in enumerate(output)]
        self.last_receive_tstamp = time.time()
        yield {"text": "".join(chr(ord("a") + t % 26) for t in output), "output_ids": output, "meta_info": meta}

    def create_abort_task(self, obj):
        return None

    def abort_request(self, rid: str = "", abort_all: bool = False):
        self.log.append({"route": "/abort_request", "class": "AbortReq", "fields": {"rid": rid, "abort_all": abort_all}})

    async def pause_generation(self, obj):
        self._record("/pause_generation", obj)
        self.paused = True

    async def continue_generation(self, obj):
        self._record("/continue_generation", obj)
        self.paused = False

    async def flush_cache(self, timeout_s: float = 0.0):
        from sglang.srt.managers.io_struct import FlushCacheReqOutput

        self.log.append({"route": "/flush_cache", "class": "FlushCacheReqInput", "fields": {}})
        return FlushCacheReqOutput(success=True)

    async def release_memory_occupation(self, obj, request=None):
        self._record("/release_memory_occupation", obj)

    async def resume_memory_occupation(self, obj, request=None):
        self._record("/resume_memory_occupation", obj)

    # ------------------------------------------------------------------ weights

    async def begin_weight_update(self, obj, request=None):
        self._record("/begin_weight_update", obj)
        if self.session_open:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session_open = True
        return True, "Success"

    async def end_weight_update(self, obj, request=None):
        self._record("/end_weight_update", obj)
        if not self.session_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session_open = False
        return True, "Success"

    def _loaded(self, obj, success: bool, message: str):
        if success and obj.weight_version is not None:
            self.weight_version = obj.weight_version
            message += f" Weight version updated to {obj.weight_version}."
        return success, message

    async def update_weights_from_tensor(self, obj, request=None):
        from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payloads
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        self._record("/update_weights_from_tensor", obj)
        if not self.session_open:
            return False, ("update_weights_from_tensor must run between begin_weight_update() and "
                           "end_weight_update()")
        payloads = normalize_serialized_named_tensor_payloads(obj.serialized_named_tensors)
        monkey_patch_torch_reductions()
        try:  # TP rank 0's entry, as TpModelWorker.deserialize_own_rank reads it
            named_tensors = await asyncio.to_thread(MultiprocessingSerializer.deserialize, payloads[0])
            success, message = self.weight_updater.update_weights_from_tensor(
                named_tensors=named_tensors, load_format=obj.load_format)
        except Exception as e:
            return False, f"{type(e).__name__}: {e}"
        return self._loaded(obj, success, message)

    async def init_weights_update_group(self, obj, request=None):
        self._record("/init_weights_update_group", obj)
        return await asyncio.to_thread(self.weight_updater.init_weights_update_group, obj.master_address,
                                       obj.master_port, obj.rank_offset, obj.world_size, obj.group_name, obj.backend)

    async def destroy_weights_update_group(self, obj, request=None):
        self._record("/destroy_weights_update_group", obj)
        return self.weight_updater.destroy_weights_update_group(obj.group_name)

    async def update_weights_from_distributed(self, obj, request=None):
        self._record("/update_weights_from_distributed", obj)
        if not self.session_open:
            return False, ("update_weights_from_distributed must run between begin_weight_update() and "
                           "end_weight_update()")
        try:
            weights = await asyncio.to_thread(self.weight_updater.receive_weights_from_distributed, names=obj.names,
                                              dtypes=obj.dtypes, shapes=obj.shapes, group_name=obj.group_name,
                                              load_format=obj.load_format)
        except Exception as e:
            return False, f"Failed to receive weights: {e}"
        success, message = self.weight_updater.load_weights_from_distributed(weights)
        return self._loaded(obj, success, message)

    async def update_weights_from_disk(self, obj, request=None):
        self._record("/update_weights_from_disk", obj)
        success, message = self._loaded(obj, True, "Succeeded to update model weights.")
        return success, message, 0


def _plain(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-path", required=True, help="an HF model directory (its config is read)")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--context-length", type=int, default=64)
    opts = parser.parse_args()

    prepare_imports()
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import uvicorn

    from sglang.srt.entrypoints import http_server
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    # The process-wide config SGLang's routes and weight updater read, from SGLang's own ServerArgs.
    server_args_parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(server_args_parser)
    server_args = ServerArgs.from_cli_args(server_args_parser.parse_args(
        ["--model-path", opts.model_path, "--device", "cpu", "--context-length",
         str(opts.context_length)]))
    publish(server_args, role="tokenizer")
    mp.set_sharing_strategy("file_system")  # the CPU tensor payloads are shared-memory files
    # SGLang's weight updater asserts a default process group exists before it builds its own group.
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    manager = TokenizerManagerStandIn(opts.model_path, opts.vocab_size, opts.context_length)
    manager.server_args = server_args
    http_server.set_global_state(http_server._GlobalState(tokenizer_manager=manager, template_manager=None,
                                                          scheduler_info={}))
    app = http_server.app

    @app.get("/probe/state")
    async def probe_state():
        return {"log": manager.log, "loaded": manager.model.loaded, "weight_version": manager.weight_version,
                "session_open": manager.session_open}

    @app.post("/probe/clear")
    async def probe_clear():
        manager.model.loaded.clear()
        return {}

    app.router.lifespan_context = None  # SGLang's lifespan starts its warm-up and workers; nothing of that runs here
    config = uvicorn.Config(app, host="127.0.0.1", port=opts.port, log_level="warning", lifespan="off")
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
