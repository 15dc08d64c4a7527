"""Command-line flags of the embedded engine (SGLang's names where SGLang has the flag)."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass


@dataclass
class ServerArgs:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    context_length: int | None = None
    max_total_tokens: int | None = None
    max_running_requests: int = 64
    mem_fraction_static: float = 0.8
    chunked_prefill_size: int | None = None
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: list[int] | None = None
    attention_backend: str | None = None
    tool_call_parser: str = "qwen25"
    served_model_name: str | None = None
    weight_version: str = "default"
    random_seed: int = 0
    health_check_timeout: float = 20.0
    log_level: str = "warning"
    custom_pull_weights_pre_read_hook: str | None = None
    mla_decode: str = "absorbed"
    quantization: str | None = None
    fp8_gemm_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    enable_return_routed_experts: bool = False
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_ngram_max_trie_depth: int = 18
    speculative_adaptive: bool = False
    speculative_adaptive_config: str | None = None
    enable_deterministic_inference: bool = False

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("api_key")
        return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m slime.backends.embedded_engine",
                                description="Embedded inference engine speaking SGLang's HTTP protocol.")
    p.add_argument("--model-path", required=True, help="local Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address; anything but loopback requires --api-key")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all paths but /health*)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--context-length", type=int, default=None,
                   help="max prompt+output tokens per request (default: the model's max_position_embeddings)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV cache token budget (CPU sizing; default: max-running-requests x context length)")
    p.add_argument("--max-running-requests", type=int, default=64, help="max requests decoding together")
    p.add_argument("--mem-fraction-static", type=float, default=0.8,
                   help="CUDA: fraction of GPU memory for weights + KV cache")
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="max prompt tokens per prefill forward (default: 8192 on CUDA, 2048 on CPU)")
    p.add_argument("--disable-cuda-graph", action="store_true", default=False,
                   help="CUDA: run decode steps eagerly instead of replaying captured CUDA graphs")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="CUDA: largest decode batch run through a CUDA graph (default: --max-running-requests)")
    p.add_argument("--cuda-graph-bs", type=int, nargs="+", default=None, metavar="N",
                   help="CUDA: the decode batch sizes captured as CUDA graphs (SGLang's --cuda-graph-bs-decode); a "
                        "batch pads up to the next one, a batch above the largest runs eagerly (default: 1, 2, 4, 8, "
                        "then every 8 up to --cuda-graph-max-bs)")
    p.add_argument("--attention-backend", default=None, choices=["triton", "torch_native"],
                   help="triton (CUDA; the default there): flash-decoding attention plus fused RMSNorm, rotary "
                        "and SiLU-gate kernels; torch_native (the default on CPU): plain PyTorch ops")
    p.add_argument("--tool-call-parser", default="qwen25", help="qwen25 or hermes (OpenAI endpoints)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--enable-deterministic-inference", action="store_true", default=False,
                   help="batch-invariant forward and log-probs (slime/backends/batch_invariant.py; fp32 or bf16 on the CPU): "
                        "a request's results do not depend on the batch it runs in, and equal the FSDP trainer's "
                        "under --true-on-policy bit for bit; refuses quantization and speculative decoding")
    p.add_argument("--health-check-timeout", type=float, default=20.0)
    p.add_argument("--log-level", default="warning")
    p.add_argument("--custom-pull-weights-pre-read-hook", default=None,
                   help="module.attr of hook(source_dir, target_version), called by /pull_weights before it reads "
                        "a published version (e.g. to refresh an object-store mount)")
    p.add_argument("--mla-decode", default="absorbed", choices=["absorbed", "expanded"],
                   help="multi-latent attention (DeepSeek-V3) decode: absorbed (kv_b_proj folded into the query and "
                        "output, reads the compressed cache once) or expanded (transformers' reference: the cached "
                        "latent expanded to per-head keys/values every step)")
    p.add_argument("--quantization", default=None,
                   help="fp8: serve the decoder's linear layers (attention, MLP, experts) as block-wise FP8 e4m3 "
                        "with one fp32 scale per 128x128 block, quantized at load and at every weight update; "
                        "w8a8_fp8: one scale per output channel and the activations per token (SGLang's W8A8 FP8, "
                        "its online form on Hopper); embeddings, lm_head, norms and the KV cache stay "
                        "in --dtype (SGLang's flag; these two are the values the embedded engine implements)")
    p.add_argument("--fp8-gemm-backend", default="auto",
                   help="with --quantization fp8: weight_only (CUDA) keeps the activations in --dtype and "
                        "dequantizes the e4m3 weight tiles in registers inside a Triton GEMM (W8A16: the numbers of "
                        "dequant, one byte read a weight; near bf16's speed up to 16 tokens, slower above: for its "
                        "smaller train/rollout gap); triton (CUDA) runs Triton kernels that quantize "
                        "activations per token and 128-channel group and multiply e4m3 x e4m3 (W8A8, SGLang's "
                        "block-FP8 recipe; one fused kernel up to 16 tokens, a quantize kernel + GEMM above); "
                        "cublas (Hopper, torch built with CUDA >= 12.9) runs cuBLASLt's 1x128/128x128 "
                        "block-scaled FP8 GEMM (torch._scaled_mm, W8A8), shapes it refuses on the Triton GEMM; "
                        "dequant (the default on CPU) dequantizes the weight to --dtype and runs an ordinary "
                        "matmul; auto (the default) on CUDA: the fused W8A8 Triton kernel up to 16 tokens, the "
                        "two-kernel one (TMA loads on Hopper) up to 256, cublas above where it runs, else Triton. "
                        "With --quantization w8a8_fp8: cutlass (torch._scaled_mm's row-wise FP8 GEMM, sm_90, after "
                        "a check at start), triton (a Triton GEMM with the per-token and per-channel scales applied "
                        "after its K loop and the residual add in its epilogue; sm_89+), cublas (cuBLASLt's "
                        "scalar-scale FP8 GEMM for the attention's q/k/v and output projections and the MLP's down "
                        "projection at decode sizes, their scales applied by the fused kernels that read the "
                        "product; every other GEMM on triton; sm_89+, Triton, and a bf16 or fp32 --dtype: the "
                        "product overflows fp16), dequant, or auto (cublas where it runs, else triton, else cutlass, "
                        "else dequant)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="what the KV cache stores (SGLang's flag): auto (= --dtype), bf16/bfloat16, fp8_e4m3 "
                        "(float8_e4m3fn) or fp8_e5m2 (float8_e5m2). FP8 halves the cache's bytes (twice the "
                        "tokens in the same memory, half the bytes a decode step reads); values are divided by a "
                        "per-layer scale (the checkpoint's self_attn.k_scale/v_scale, else 1.0) and saturated "
                        "to the format's range. Not for multi-latent attention (DeepSeek-V3). fp4/mxfp8 refused")
    p.add_argument("--enable-return-routed-experts", action="store_true", default=False,
                   help="record every MoE layer's top-k experts per token (prefill and decode; CUDA graphs capture the "
                        "recording) so that requests with return_routed_experts get meta_info.routed_experts: base64 "
                        "little-endian int32 [seqlen - 1 - routed_experts_start_len, num_hidden_layers, top_k], dense "
                        "layers 0 (SGLang's flag and format; routing replay R3, --use-rollout-routing-replay)")
    p.add_argument("--enable-memory-saver", action="store_true", default=False,
                   help="CUDA: /release_memory_occupation frees the weights' and KV cache's device memory and "
                        "/resume_memory_occupation maps it back at the same addresses (torch-memory-saver, as SGLang's "
                        "flag), so the CUDA graphs survive a colocated training step; needs the torch-memory-saver "
                        "package. Without it a released engine moves its weights to host memory and recaptures its "
                        "graphs after the resume. No effect on CPU")
    p.add_argument("--enable-weights-cpu-backup", action="store_true", default=False,
                   help="with --enable-memory-saver: keep the parameters' content across a release in pinned host "
                        "memory (SGLang's flag). Off (the default, as in SGLang), a release drops it and the engine "
                        "refuses to generate until every parameter was rewritten by a weight update (the colocated "
                        "cycle pushes all of them after each resume); buffers, a NEXTN layer and FP8 weights are "
                        "always kept")
    spec = p.add_argument_group("speculative decoding (SGLang's flags; see docs/embedded_engine.md)")
    spec.add_argument("--speculative-algorithm", default=None, type=str.upper,
                      help="NGRAM (prompt lookup: propose the tokens that followed the longest earlier match of the "
                           "text's suffix), STANDALONE (a small draft model) or NEXTN (alias EAGLE, as in SGLang: the "
                           "model's own multi-token-prediction layer, DeepSeek-V3 family); drafts are verified in one "
                           "forward with exact rejection sampling. EAGLE3/DFLASH/... are refused")
    spec.add_argument("--speculative-draft-model-path", "--speculative-draft-model", default=None,
                      help="STANDALONE: local HF checkpoint of the draft model (the target's tokenizer)")
    spec.add_argument("--speculative-num-steps", type=int, default=None,
                      help="draft tokens proposed per step (= --speculative-num-draft-tokens - 1); NEXTN chains its "
                           "MTP layer this many times")
    spec.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                      help="tokens verified per step: the last token + the drafts (default 12 NGRAM, 4 STANDALONE "
                           "and NEXTN)")
    spec.add_argument("--speculative-eagle-topk", type=int, default=None,
                      help="drafts per step form one chain: only 1 is accepted")
    spec.add_argument("--speculative-ngram-max-trie-depth", type=int, default=18,
                      help="NGRAM: longest suffix of prompt + output matched against its earlier text")
    spec.add_argument("--speculative-adaptive", action="store_true",
                      help="choose the drafts a step proposes at run time, per batch size, from the drafts accepted "
                           "(SGLang's adaptive speculation; 0 = plain decode steps, e.g. for large batches). "
                           "--speculative-num-steps is the starting count")
    spec.add_argument("--speculative-adaptive-config", default=None,
                      help="with --speculative-adaptive: JSON of batch sizes -> candidate_steps and tuning knobs "
                           "(SGLang's format; default 1 row: 1/3/5/7 drafts, 8: 0/1/3, 32: 0/1, 64 and up: none)")
    return p


LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def is_loopback(host: str) -> bool:
    """localhost or an address of the loopback network (all of 127.0.0.0/8, ::1): this machine only."""
    import ipaddress

    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    ns = build_parser().parse_args(argv)
    args = ServerArgs(**vars(ns))
    validate_args(args)
    return args


def validate_args(args: ServerArgs) -> None:
    if not is_loopback(args.host) and not args.api_key:
        raise SystemExit(f"--host {args.host} exposes the engine beyond this machine; pass --api-key too "
                         "(or bind 127.0.0.1)")
    if args.attention_backend == "triton" and args.device != "cuda":
        raise SystemExit("--attention-backend triton runs on --device cuda only; use torch_native on CPU")
    if args.quantization is not None and args.quantization not in ("fp8", "w8a8_fp8"):
        raise SystemExit(f"--quantization {args.quantization!r} is not supported by the embedded engine; it "
                         "implements fp8 (block-wise) and w8a8_fp8 (per channel), quantized online; use "
                         "--rollout-backend sglang for SGLang's other methods")
    if args.fp8_gemm_backend not in ("auto", "weight_only", "triton", "cublas", "cutlass", "dequant"):
        raise SystemExit(f"--fp8-gemm-backend {args.fp8_gemm_backend!r}: choose auto, weight_only, triton, cublas, "
                         "cutlass or dequant")
    if args.quantization == "w8a8_fp8" and args.fp8_gemm_backend not in ("auto", "cutlass", "triton", "cublas",
                                                                           "dequant"):
        raise SystemExit(f"--fp8-gemm-backend {args.fp8_gemm_backend} is a block-wise (--quantization fp8) kernel; "
                         "with --quantization w8a8_fp8 choose auto, cutlass (torch._scaled_mm's row-wise GEMM on "
                         "sm_90), triton (the per-channel Triton GEMM), cublas (cuBLASLt's FP8 GEMM with the "
                         "scales applied by the kernels that read it) or dequant")
    if args.quantization != "w8a8_fp8" and args.fp8_gemm_backend == "cutlass":
        raise SystemExit("--fp8-gemm-backend cutlass is the per-channel (--quantization w8a8_fp8) GEMM; with "
                         "--quantization fp8 choose auto, weight_only, triton, cublas or dequant")
    if args.fp8_gemm_backend in ("weight_only", "triton", "cublas", "cutlass") and args.device != "cuda":
        raise SystemExit(f"--fp8-gemm-backend {args.fp8_gemm_backend} runs on --device cuda only; use dequant "
                         "(the default) on CPU")
    if args.kv_cache_dtype != "auto":
        from slime.backends.embedded_engine.kv_cache import KV_CACHE_DTYPES

        if args.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise SystemExit(f"--kv-cache-dtype {args.kv_cache_dtype!r} is not supported by the embedded engine; "
                             f"choose auto, {', '.join(KV_CACHE_DTYPES)} (fp4/mxfp8 caches: use --rollout-backend "
                             "sglang)")
    if args.max_running_requests < 1:
        raise SystemExit(f"--max-running-requests must be >= 1, got {args.max_running_requests}")
    if args.cuda_graph_bs is not None:
        limit = min(args.cuda_graph_max_bs or args.max_running_requests, args.max_running_requests)
        if any(size < 1 for size in args.cuda_graph_bs):
            raise SystemExit(f"--cuda-graph-bs: batch sizes must be >= 1, got {args.cuda_graph_bs}")
        if min(args.cuda_graph_bs) > limit:
            raise SystemExit(f"--cuda-graph-bs {' '.join(map(str, args.cuda_graph_bs))}: no size is within "
                             f"--max-running-requests / --cuda-graph-max-bs ({limit})")
    if not 0 < args.mem_fraction_static <= 1:
        raise SystemExit(f"--mem-fraction-static must be in (0, 1], got {args.mem_fraction_static}")
    try:
        speculative_config(args)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def speculative_config(args: ServerArgs):
    """The engine's speculative-decoding settings (None: off); ValueError naming the flag otherwise."""
    from slime.backends.embedded_engine.speculative.decoder import resolve_config

    return resolve_config(args.speculative_algorithm, args.speculative_draft_model_path, args.speculative_num_steps,
                          args.speculative_num_draft_tokens, args.speculative_eagle_topk,
                          args.speculative_ngram_max_trie_depth, args.model_path, args.speculative_adaptive,
                          args.speculative_adaptive_config)
