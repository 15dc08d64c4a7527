"""CLI: ``python -m slime.backends.embedded_engine --model-path DIR [--host H --port P ...]``.

Start-up order: load model + tokenizer, allocate the KV cache, start the engine thread, run one
warm-up request, then serve HTTP (``/health`` answers 503 until the warm-up passed). Shutdown on
SIGTERM/SIGINT: abort every queued and running request (their callers get HTTP 200 with partial
output and ``finish_reason.type == "abort"``), let uvicorn finish those responses, stop the engine
thread, exit.
"""

from __future__ import annotations

import logging
import sys

from slime.backends.embedded_engine.config import ServerArgs, parse_args


def build_server(args: ServerArgs):
    """Return (uvicorn server, state); nothing is started yet except the engine thread."""
    import torch
    import uvicorn

    from slime.backends.embedded_engine.engine import Engine
    from slime.backends.embedded_engine.io_struct import GenerateRequest, SamplingParams
    from slime.backends.embedded_engine.model_runner import ModelRunner
    from slime.backends.embedded_engine.serving.server import ServerState, build_app
    from slime.backends.update_weight.wire_format import use_file_system_sharing

    use_file_system_sharing()
    # on CPU the engine thread does the compute: it takes the threads, the main thread keeps one (docs/performance.md)
    threads = None
    if args.device == "cpu":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
    torch.manual_seed(args.random_seed)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was given but torch sees no CUDA device")
    runner = ModelRunner(args.model_path, device=args.device, dtype=args.dtype,
                         num_slots=args.max_running_requests, slot_capacity=args.context_length,
                         mem_fraction_static=args.mem_fraction_static if args.device == "cuda" else None,
                         max_total_tokens=args.max_total_tokens, cuda_graph=not args.disable_cuda_graph,
                         cuda_graph_max_bs=args.cuda_graph_max_bs, cuda_graph_bs=args.cuda_graph_bs,
                         attention_backend=args.attention_backend, mla_decode=args.mla_decode,
                         quantization=args.quantization,
                         fp8_gemm_backend=args.fp8_gemm_backend, kv_cache_dtype=args.kv_cache_dtype,
                         routed_experts=args.enable_return_routed_experts, memory_saver=args.enable_memory_saver,
                         weights_cpu_backup=args.enable_weights_cpu_backup, true_on_policy=args.enable_deterministic_inference)
    if args.enable_deterministic_inference and args.speculative_algorithm:
        raise SystemExit("--enable-deterministic-inference: speculative decoding verifies drafts in a multi-token pass that is not "
                         "batch-invariant; drop --speculative-algorithm")
    prefill = args.chunked_prefill_size or (8192 if args.device == "cuda" else 2048)
    engine = Engine(runner, chunked_prefill_size=prefill, weight_version=args.weight_version, seed=args.random_seed,
                    speculative=build_speculative(args, runner, prefill), num_threads=threads)
    engine.start()
    warmup = GenerateRequest(rid="WARMUP", input_ids=[0], params=SamplingParams(max_new_tokens=2, temperature=0.0))
    done = engine.call(lambda: engine.add_request(warmup, lambda seq, finished: None))
    done.result(timeout=300)
    state = ServerState(args, engine)
    app = build_app(state)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # Abort first so waiting /generate calls return their partial output, then drain HTTP.
            state.status = "Shutting down"
            engine.call(lambda: engine.abort(None, abort_all=True))
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=10)
    return _Server(config), state


def build_speculative(args: ServerArgs, runner, prefill_tokens: int):
    """The speculative decoder of ``--speculative-algorithm`` (None when off); STANDALONE loads its draft
    model here, with as many slots as the target and the target's device, dtype and attention backend;
    NEXTN builds the model's MTP layer from its checkpoint (``speculative/mtp.py``)."""
    from slime.backends.embedded_engine.config import speculative_config
    from slime.backends.embedded_engine.model_runner import ModelRunner
    from slime.backends.embedded_engine.speculative.decoder import DraftModel, SpeculativeDecoder

    config = speculative_config(args)
    if config is None:
        return None
    draft = None
    if config.algorithm == "NEXTN":
        from slime.backends.embedded_engine.speculative.mtp import NextNDrafter

        try:
            draft = NextNDrafter(runner, prefill_tokens)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    elif config.draft_model_path:
        draft_runner = ModelRunner(config.draft_model_path, device=args.device, dtype=args.dtype,
                                   num_slots=runner.max_slots, slot_capacity=runner.context_length,
                                   cuda_graph=not args.disable_cuda_graph, cuda_graph_max_bs=args.cuda_graph_max_bs,
                                   cuda_graph_bs=args.cuda_graph_bs,
                                   attention_backend=args.attention_backend, mla_decode=args.mla_decode,
                                   kv_cache_dtype=args.kv_cache_dtype)  # SGLang: the draft caches like the target
        draft = DraftModel(draft_runner, runner, prefill_tokens)
    # adaptive slots pick by the decode graphs' batch sizes (none without graphs), as SGLang's by its own
    return SpeculativeDecoder(config, draft, batch_buckets=runner.graphs.batch_buckets)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server, state = build_server(args)
    state.status = "Up"
    print(f"embedded engine serving {args.model_path} on http://{args.host}:{args.port}", flush=True)
    try:
        server.run()
    finally:
        state.engine.stop()


if __name__ == "__main__":
    sys.exit(main())
