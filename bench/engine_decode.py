"""Decode throughput of the embedded engine over HTTP vs HF ``model.generate`` on the same prompts.

    python bench/engine_decode.py [--model tiny] [--device cpu] [--num-requests 64] [--out]       # CPU
    python bench/engine_decode.py --model qwen3-0.6b --num-requests 128 --prompt-len 256 \\
        --max-new-tokens 512 --out                                                               # H200
    python bench/engine_decode.py --model qwen3-4b --num-requests 128 --prompt-len 256 \\
        --max-new-tokens 512 --skip-hf --quantization fp8 --out                                  # FP8 rollout
    python bench/engine_decode.py --model qwen3-0.6b --num-requests 128 --prompt-len 256 \
        --max-new-tokens 512 --skip-hf --quantization fp8 --kv-cache-dtype fp8_e4m3 --out        # + FP8 KV cache
    python bench/engine_decode.py --model-path /tmp/q4 --num-requests 128 --prompt-len 16 \
        --max-new-tokens 256 --skip-hf --quantization w8a8_fp8 --out                             # per-channel FP8
    python bench/engine_decode.py --model qwen3-vl-2b --num-requests 64 --prompt-len 64 \
        --max-new-tokens 128 --images 1 --image-size 448 --skip-hf --out                         # with pictures

``--model`` builds a checkpoint in a temporary directory: ``tiny``/``small`` are
``slime.utils.tiny_model``; ``qwen3-0.6b``/``qwen3-1.7b`` have the public Qwen3 architecture
(``deepseek-v3-1b``: DeepSeek-V3's MLA + MoE at ~0.95B parameters, see ``ARCHITECTURES``)
(hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 3072, vocab 151936, tied
embeddings for 0.6B) with random bf16 weights and the tiny model's tokenizer (prompts are random
token ids below the tokenizer size, so the vocabulary mismatch does not matter). ``qwen3-vl-2b`` is
Qwen3-VL-2B-Instruct's architecture (``VISION_LANGUAGE``: ``qwen3-1.7b``'s language-model shape, a
24-block vision tower, Qwen3-VL's image processor settings) with random bf16 weights and
``slime.utils.tiny_vlm``'s tokenizer; ``tiny-vl`` is a tiny Qwen3-VL with ``tiny``'s language-model
shape. A vision-language checkpoint draws the same prompts as its text-only twin (no vision token ids).
``--model-path`` uses an existing HF directory instead.

Workload: N concurrent ``/generate`` requests sent at once, all with ``ignore_eos`` and temperature 1
so output lengths are exact. ``--prompt-len`` / ``--max-new-tokens`` fix every prompt / output
length; without them prompts are 8–64 tokens and outputs 16–128 (the CPU default).

Pictures (``--images N --image-size S``, a vision-language checkpoint, engine only): each request
carries N distinct PIL-drawn S x S pictures in front of its ``--prompt-len`` text tokens, sent as the
default rollout sends them (``input_ids`` with each picture's placeholder expanded by the checkpoint's
processor, ``image_data`` as PNG data URLs); the engine decodes and processes them when the request
arrives (in the burst's wall time) and runs the vision tower at the request's first prefill (in
``prefill_seconds``). Every answer's ``prompt_tokens`` must equal the request's ids (the engine's
expansion agrees with the processor's). The result adds ``config.images_per_request`` /
``image_size`` / ``image_tokens_per_image`` and ``image_tokens_per_request`` /
``prompt_tokens_per_request`` (text + image tokens + 2 markers per picture); the decode figures below
then decode after longer prompts than the text-only run at the same ``--prompt-len``.

Metrics:

* ``engine_output_tokens_per_s``: generated tokens / wall time of the whole burst (prefill included).
* ``hf_generate_output_tokens_per_s``: the same prompts through ``model.generate`` (same dtype,
  device and sampling: temperature 1, no top-k), left-padded, up to the longest requested output;
  only the tokens the requests asked for count (``hf_generate_padded_batch_tokens_per_s`` counts the
  whole padded batch). By default all prompts go in ONE batch; ``--hf-batch-size K`` (or a CUDA
  out-of-memory, which halves K and retries) runs ``ceil(N/K)`` batches back to back and the time is
  their sum — ``config.hf_batch_size`` records which.
* ``speedup_vs_hf`` = engine / HF output tokens/s.
* Where the burst's wall time goes (``burst_seconds``), from the server's step counters:
  ``engine_busy_fraction`` (time inside engine steps / wall time; the rest is the engine waiting for
  requests or the HTTP layer answering them), ``prefill_seconds`` / ``prefill_forwards`` /
  ``prefill_tokens``, ``joins_while_decoding`` (requests admitted after decoding began), and
  ``end_to_end_over_decode_rate`` (end-to-end output tokens/s over the decode-only rate below).
* The burst on one clock (``timeline/*_s``, seconds from its start, from the answers' SGLang timestamps
  ``request_received_ts`` / ``request_finished_ts`` / ``response_sent_to_client_ts`` and phase durations):
  last request received by the engine, first / last admission, first / last finish, last answer built,
  last answer read by the client. ``admission_seconds`` (until the last admission) and ``answer_seconds``
  (the engine's last finish to the client's last read) are the wall time around the engine's steps.
* Decode-only figures from the server's own counters (``/get_server_info`` → ``batch_stats``,
  differences over the measured burst): ``decode_seconds`` (wall time of decode forwards +
  sampling; sampling ends in a device→host copy, so on CUDA it includes the device work),
  ``decode_steps``, ``decode_kv_tokens`` (Σ over decode steps of the running rows' lengths).
* On CUDA, ``roofline_fraction``::

      bytes_per_step  = weight_bytes + kv_bytes_per_token × mean_batch × mean_length
      total_bytes     = decode_steps × weight_bytes + decode_kv_tokens × kv_bytes_per_token
                      (= Σ over steps of bytes_per_step: the batch's KV at its own lengths)
      roofline_fraction = total_bytes / decode_seconds / HBM peak     (the GPU's spec: H200 4.8e12, H100 3.35e12;
                                                                     bench.common.hbm_peak)

  ``weight_bytes`` is the server's parameter bytes (tied embedding counted once, read once by the
  LM head), ``kv_bytes_per_token`` one token's bytes in the server's cache, as its
  ``/get_server_info`` reports them (2·layers·kv_heads·head_dim·2 for bf16, ·1 with
  ``--kv-cache-dtype fp8_e4m3``: the fraction counts what an FP8 cache really reads). Activations and padding reads are not counted, so this is a lower bound on traffic.
  ``roofline_fraction_vs_measured_copy`` divides by the one-way device copy bandwidth measured in
  this run instead (``measured_copy_bytes_per_s``, read+write / 2), and
  ``roofline_fraction_over_burst_wall`` spreads the same traffic over the burst's whole wall time.

``--quantization fp8`` serves the model with block-wise FP8 linear layers (``--fp8-gemm-backend``
picks the GEMM; docs/embedded_engine.md) and adds the weight-update cost: ``weight_update_seconds``
(every tensor of the checkpoint, already on the device in bf16, through the engine's update path:
quantized into the FP8 blocks, or copied as-is without ``--quantization``), measured in this process
after the engine stopped, and ``disk_update_seconds`` (``/update_weights_from_disk`` of the same
checkpoint, file reading included). Compare a run with and without the flag at the same workload.
``engine_start_seconds`` (any run): from spawning the engine to its first healthy answer — imports,
loading, FP8 quantization and ``fp8.warm_up``'s GEMM compiles (cached by Triton on disk after the
first start on a machine), the cache allocation and the decode CUDA graphs captured at start
(``start_cuda_graph_captures`` of them in ``start_capture_seconds``: every batch bucket where attention is
the flash-decoding kernel, none where graphs are captured lazily).

``--out`` writes ``bench/results/engine_decode-<machine>-<model>[-<variant>].json`` (bench/common.py ``result_name``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import platform
import random
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import hbm_peak, hbm_peak_config, write_result  # noqa: E402
from slime.utils import http_utils  # noqa: E402


# Public Qwen3 architectures (shapes only; weights are random).
ARCHITECTURES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    # Qwen3.5-0.8B's language model (published config.json, text_config): gated-DeltaNet linear attention in
    # 3 of every 4 layers (a recurrent state per request), gated softmax attention with partial rotary in the 4th
    "qwen3.5-0.8b": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=256, vocab_size=248320, tie_word_embeddings=True,
                         linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                         linear_num_key_heads=16, linear_num_value_heads=16,
                         layer_types=["linear_attention"] * 3 + ["full_attention"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                          "partial_rotary_factor": 0.25}),
    # MoE with multi-latent attention at ~0.95B total parameters (DeepSeek-V3 architecture): 12 layers, the
    # first dense; 32 routed experts (top-4 of 2 groups out of 4) + 1 shared; q/kv LoRA 384/256; YaRN
    "deepseek-v3-1b": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                           num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64,
                           qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32, num_experts_per_tok=4,
                           moe_intermediate_size=512, n_shared_experts=1, n_group=4, topk_group=2,
                           first_k_dense_replace=1, routed_scaling_factor=2.5, vocab_size=151936,
                           tie_word_embeddings=False,
                           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
}

# Public vision-language architectures (shapes only; weights are random): the language model, the vision tower and
# the image processor's settings. Each one's text-only twin (the model a run with pictures is compared against) is
# the ARCHITECTURES entry of its language-model shape.
VISION_LANGUAGE = {
    # Qwen3-VL-2B-Instruct (published config.json and preprocessor_config.json): Qwen3-1.7B's language-model
    # shape with rope theta 5e6 and interleaved M-RoPE (24/20/20 of the 64 rotary frequencies on time, height,
    # width); a 24-block ViT of hidden 1024 on 16-pixel patches merged 2x2 (a 448x448 image: 196 tokens) whose
    # blocks 5, 11 and 17 also feed the first decoder layers (deepstack); images of 256x256 to 4096x4096 pixels
    "qwen3-vl-2b": dict(
        text=dict(ARCHITECTURES["qwen3-1.7b"], max_position_embeddings=262144,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                   "mrope_interleaved": True}),
        vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, in_channels=3, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048, num_position_embeddings=2304,
                    deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh"),
        processor=dict(patch_size=16, min_pixels=256 * 256, max_pixels=4096 * 4096, mean=(0.5,) * 3, std=(0.5,) * 3)),
}
#: the tiny models (``slime.utils.tiny_model`` / ``tiny_vlm``) by name; ``tiny-vl`` is a tiny Qwen3-VL whose
#: language model has ``tiny``'s shape
TINY_MODELS = ("tiny", "small", "tiny-vl")
MODELS = (*TINY_MODELS, *ARCHITECTURES, *VISION_LANGUAGE)


def build_vision_language(model: str, out_dir: str) -> str:
    """A VISION_LANGUAGE architecture with random bf16 weights, tiny_vlm's tokenizer (the tiny model's plus
    Qwen's vision tokens), chat template and an image processor of the published settings."""
    from transformers import AutoModelForImageTextToText, Qwen3VLConfig

    from slime.utils.tiny_vlm import image_processor_config, save_vlm, vlm_tokenizer

    shape = VISION_LANGUAGE[model]
    tokenizer, special, ids = vlm_tokenizer(seed=0)
    config = Qwen3VLConfig(text_config=dict(shape["text"], rms_norm_eps=1e-6, **special), vision_config=shape["vision"],
                           tie_word_embeddings=shape["text"]["tie_word_embeddings"], **ids)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # as build_checkpoint does
        vlm = AutoModelForImageTextToText.from_config(config).to(torch.bfloat16)
    return str(save_vlm(vlm, tokenizer, out_dir, image_processor_config("qwen3_vl", **shape["processor"])))


def build_checkpoint(model: str, out_dir: str) -> str:
    """An HF directory for ``model``: a tiny model, or a public architecture with random bf16 weights
    and the tiny model's tokenizer and generation config."""
    from slime.utils.tiny_model import build_tiny_model

    if model == "tiny-vl":
        from slime.utils.tiny_vlm import build_tiny_vlm

        return str(build_tiny_vlm(out_dir, "qwen3_vl", seed=0))
    if model in VISION_LANGUAGE:
        return build_vision_language(model, out_dir)
    path = build_tiny_model(out_dir, size=model if model in ("tiny", "small") else "tiny", seed=0)
    if model in ("tiny", "small"):
        return str(path)
    from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config, GenerationConfig, Qwen3Config

    tokenizer = AutoTokenizer.from_pretrained(path)
    generation_config = GenerationConfig.from_pretrained(path)
    tokens = dict(bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16", rms_norm_eps=1e-6)
    if model.startswith("deepseek"):
        config = DeepseekV3Config(**ARCHITECTURES[model], max_position_embeddings=16384, **tokens)
    elif model.startswith("qwen3.5"):
        from transformers import Qwen3_5TextConfig

        shape = dict(ARCHITECTURES[model])
        shape["layer_types"] = shape["layer_types"] * (shape["num_hidden_layers"] // len(shape["layer_types"]))
        config = Qwen3_5TextConfig(**shape, max_position_embeddings=32768, **tokens)
    else:
        config = Qwen3Config(**ARCHITECTURES[model], max_position_embeddings=40960, rope_theta=1000000.0, **tokens)
    torch.manual_seed(0)
    # initialized on the GPU where there is one (a 4B model's fp32 init takes minutes on a host's cores); the
    # weights then come from the GPU's generator (same distribution, other values)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        qwen = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    qwen.generation_config = generation_config
    for old in path.glob("*.safetensors"):
        old.unlink()
    qwen.save_pretrained(path, safe_serialization=True)  # config.json, generation_config.json, weights
    return str(path)


def make_workload(n: int, vocab: int, seed: int, prompt_len: int | None, max_new_tokens: int | None):
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len or rng.randint(8, 64))] for _ in range(n)]
    lengths = [max_new_tokens or rng.randint(16, 128) for _ in range(n)]
    return prompts, lengths


def text_vocab(model_path: str) -> int:
    """Prompt ids are drawn below this: the model's and the tokenizer's vocabulary, without a vision-language
    tokenizer's vision tokens (added last, so ``tiny-vl``/``qwen3-vl-2b`` draw the same prompts as ``tiny``/``qwen3-1.7b``)."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_path)
    vocab = min(config.get_text_config().vocab_size, len(AutoTokenizer.from_pretrained(model_path)))
    vision = [getattr(config, key, None) for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                     "vision_end_token_id")]
    return min([vocab] + [token for token in vision if token is not None])


def draw_picture(rng: random.Random, size: int):
    """A ``size`` x ``size`` RGB picture: 3-8 filled rectangles and ellipses in random colours on a random
    background (distinct pixels per request, so no two requests share their vision-tower work)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
    pen = ImageDraw.Draw(image)
    for _ in range(rng.randint(3, 8)):
        x0, y0 = rng.randrange(size), rng.randrange(size)
        box = [x0, y0, min(size - 1, x0 + rng.randint(4, size // 2)), min(size - 1, y0 + rng.randint(4, size // 2))]
        (pen.rectangle if rng.random() < 0.5 else pen.ellipse)(box, fill=tuple(rng.randrange(256) for _ in range(3)))
    return image


def image_workload(model_path: str, prompts: list[list[int]], images: int, size: int, seed: int):
    """Each prompt with ``images`` pictures of ``size`` x ``size`` pixels in front of its text, as the default
    rollout sends them: the prompt ids with every image's placeholder already expanded by the checkpoint's
    processor (``<|vision_start|>``, the image's tokens, ``<|vision_end|>``) and ``image_data``, the pictures as
    PNG data URLs. Returns (prompts, image_data per prompt, image tokens of each image)."""
    from transformers import AutoConfig, AutoTokenizer

    from slime.utils.multimodal import encode_image, fallback_processor, image_inputs, is_vision_language

    config = AutoConfig.from_pretrained(model_path)
    if not is_vision_language(config):
        raise SystemExit(f"--images {images}: {model_path} is not a vision-language checkpoint "
                         f"(model_type {config.model_type}); use e.g. --model {next(iter(VISION_LANGUAGE))} or tiny-vl")
    processor = fallback_processor(model_path, AutoTokenizer.from_pretrained(model_path))
    rng = random.Random(seed + 1)
    pictures = [[draw_picture(rng, size) for _ in range(images)] for _ in prompts]
    counts = image_inputs(processor, pictures[0][:1])[1] * images  # every picture has the same size
    image_block = []
    for count in counts:
        image_block += [config.vision_start_token_id] + [config.image_token_id] * count + [config.vision_end_token_id]
    return ([image_block + prompt for prompt in prompts], [[encode_image(p) for p in row] for row in pictures],
            counts)


def generate_body(prompt: list[int], max_new_tokens: int, image_data: list[str] | None = None) -> dict:
    """The /generate request of a workload's prompt: sampled at temperature 1, exactly this many tokens."""
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}}
    if image_data:
        body["image_data"] = image_data
    return body


def load_hf_model(model_path: str, dtype, device: str):
    """The checkpoint in transformers, evaluation mode on ``device``: its image-text class for a vision-language
    checkpoint (text-only inputs run it as its language model), else its causal-LM class."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from slime.utils.multimodal import is_vision_language

    auto = AutoModelForImageTextToText if is_vision_language(AutoConfig.from_pretrained(model_path)) else AutoModelForCausalLM
    return auto.from_pretrained(model_path, dtype=dtype).to(device).eval()


async def run_engine(url: str, prompts, lengths, image_data=None) -> tuple[float, dict]:
    """Every request at once through slime's own HTTP client (``slime.utils.http_utils``: one aiohttp
    session, what the rollout's requests go through, kept across the bursts of one event loop as the
    rollout keeps it across steps); output tokens per second of the whole burst, and where its wall time
    went (:func:`burst_timeline`). ``image_data``: each request's pictures (:func:`image_workload`); the
    engine's prompt length of each request must then be its ids' length (the expansion agrees)."""
    answers = []

    async def one(prompt, n, images):
        answer = await http_utils.post(url + "/generate", generate_body(prompt, n, images), max_retries=1)
        if answer["meta_info"]["prompt_tokens"] != len(prompt):
            raise RuntimeError(f"the engine expanded a prompt of {len(prompt)} ids (images included) into "
                               f"{answer['meta_info']['prompt_tokens']} tokens")
        answers.append((time.time(), answer["meta_info"]))
        return len(answer["output_ids"])

    start_wall, start = time.time(), time.perf_counter()
    counts = await asyncio.gather(*(one(p, n, images) for p, n, images
                                    in zip(prompts, lengths, image_data or [None] * len(prompts))))
    elapsed = time.perf_counter() - start
    assert counts == lengths, "engine returned fewer tokens than asked"
    return sum(counts) / elapsed, burst_timeline(start_wall, answers)


async def sample_outputs(url: str, prompts, lengths) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, output ids, the engine's log-probs of them) for each request, sampled at temperature 1."""

    async def one(prompt, n):
        answer = await http_utils.post(url + "/generate", generate_body(prompt, n), max_retries=1)
        return prompt, answer["output_ids"], [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]

    return list(await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths))))


@torch.inference_mode()
def logprob_gap(model_path: str, device: str, samples) -> dict:
    """The train/rollout mismatch of these samples as a trainer would see it before any update: each output
    token's log-prob under the checkpoint in HF (bf16 on CUDA, fp32 on the CPU; temperature 1) against the
    engine's — what ``train/train_rollout_logprob_abs_diff`` measures at a loop's first step, without
    the loop (TIS reweights the loss and leaves this gap as it is)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load_hf_model(model_path, dtype, device)
    diffs = []
    for prompt, output, engine_logprobs in samples:
        ids = torch.tensor([prompt + output], device=device)
        logits = model(ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(output)].float()
        ours = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(output, device=device)[:, None])[:, 0]
        diffs.append((ours.cpu() - torch.tensor(engine_logprobs)).abs())
    diff = torch.cat(diffs)
    del model
    return {"logprob_gap_mean_abs": float(diff.mean()), "logprob_gap_p99_abs": float(diff.quantile(0.99)),
            "logprob_gap_max_abs": float(diff.max()), "logprob_gap_tokens": diff.numel(),
            "logprob_gap_reference": f"HF {str(dtype).removeprefix('torch.')}"}


def burst_timeline(start: float, answers: list[tuple[float, dict]]) -> dict:
    """Seconds from the burst's start (client and server share the clock) until: the engine had received
    every request, admitted the first / the last one, finished the last one, the server had built the last
    answer, the client had read the last answer. ``answers`` holds (time read, meta_info) per request;
    admission and finish come from the server's SGLang timestamps and phase durations."""
    finished = [m["request_finished_ts"] for _, m in answers]
    admitted = [m["request_finished_ts"] - m["decode_duration"] - m["prefill_duration"] for _, m in answers]
    return {"last_request_received": max(m["request_received_ts"] for _, m in answers) - start,
            "first_admission": min(admitted) - start, "last_admission": max(admitted) - start,
            "first_finish": min(finished) - start, "last_finish": max(finished) - start,
            "last_answer_built": max(m["response_sent_to_client_ts"] for _, m in answers) - start,
            "last_answer_read": max(t for t, _ in answers) - start}


def server_info(url: str) -> dict:
    import httpx

    return httpx.get(url + "/get_server_info", timeout=60).json()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class HFBaseline:
    """``model.generate`` on the same prompts, one padded batch (or chunks of ``batch_size``)."""

    def __init__(self, model_path: str, device: str, batch_size: int | None):
        self.device = device
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.model = load_hf_model(model_path, dtype, device)
        self.batch_size = batch_size

    @torch.inference_mode()
    def _generate(self, prompts, max_new_tokens: int) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device),
                                  max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                  eos_token_id=None, pad_token_id=0)
        if out.shape[1] - width != max_new_tokens:  # a stop token ended every row: the timing would flatter HF
            raise RuntimeError(f"HF generate produced {out.shape[1] - width} tokens, expected {max_new_tokens}")

    def warmup(self, prompts) -> None:
        self._generate([p[:8] for p in prompts[:2]], 4)
        sync(self.device)

    def run(self, prompts, lengths) -> tuple[float, float]:
        """(requested output tokens / s, padded batch tokens / s); halves the batch on CUDA OOM."""
        n = len(prompts)
        while True:
            size = self.batch_size or n
            try:
                sync(self.device)
                start = time.perf_counter()
                for i in range(0, n, size):
                    self._generate(prompts[i:i + size], max(lengths[i:i + size]))
                sync(self.device)
                elapsed = time.perf_counter() - start
                break
            except torch.OutOfMemoryError:
                if size == 1:
                    raise
                self.batch_size = max(1, size // 2)
                print(f"HF generate: out of memory with batch {size}, retrying with {self.batch_size}", file=sys.stderr)
                torch.cuda.empty_cache()
        if self.device == "cuda":
            torch.cuda.empty_cache()  # give the engine process back what generate cached
        padded = sum(len(range(i, min(i + size, n))) * max(lengths[i:i + size]) for i in range(0, n, size))
        return sum(lengths) / elapsed, padded / elapsed


def disk_update_seconds(url: str, model_path: str) -> float:
    """Wall time of ``/update_weights_from_disk`` reloading ``model_path`` (file reading included)."""
    import httpx

    start = time.perf_counter()
    response = httpx.post(url + "/update_weights_from_disk", json={"model_path": model_path}, timeout=3600)
    elapsed = time.perf_counter() - start
    if not response.json().get("success"):
        raise RuntimeError(f"/update_weights_from_disk failed: {response.text}")
    return elapsed


def weight_update_seconds(model_path: str, device: str, quantization: str | None, repeats: int = 3) -> float:
    """Best time of loading every tensor of the checkpoint (bf16, already on ``device``) into a model
    through the engine's update path: quantized into FP8 blocks (``Fp8Weights.load``) or copied."""
    from slime.backends.embedded_engine.fp8 import install as fp8_install

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load_hf_model(model_path, dtype, device)
    source = [(name, tensor.detach().clone()) for name, tensor in model.state_dict().items()]
    weights = (fp8_install.quantize_model(model, "dequant", per_channel=quantization == "w8a8_fp8") if quantization
               else None)
    params = dict(model.named_parameters(remove_duplicate=False))
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            sync(device)
            start = time.perf_counter()
            for name, tensor in source:
                if weights is not None and weights.owns(name):
                    weights.load(name, tensor)
                elif name in params:
                    params[name].copy_(tensor)
            sync(device)
            best = min(best, time.perf_counter() - start)
    del model, source, weights, params
    if device == "cuda":
        torch.cuda.empty_cache()
    return best


def measured_copy_bytes_per_s() -> float:
    """One-way device copy bandwidth: 1 GiB device-to-device copies, (read + write) / 2 per second, best of 5."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = max(best, src.numel() / (time.perf_counter() - start))
    del src, dst
    torch.cuda.empty_cache()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", choices=MODELS,
                        help="checkpoint to build in a temporary directory (ignored with --model-path): tiny, small, "
                             "tiny-vl (slime.utils.tiny_model / tiny_vlm) or a public architecture with random weights")
    parser.add_argument("--model-path", default=None, help="an existing HF directory instead of --model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=None, help="every prompt this long (default: 8-64)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="every output this long (default: 16-128)")
    parser.add_argument("--hf-batch-size", type=int, default=None,
                        help="HF generate in chunks of this many prompts (default: all in one batch)")
    parser.add_argument("--engine-args", default="", help="extra engine flags, e.g. '--chunked-prefill-size 8192'")
    parser.add_argument("--quantization", default=None, choices=["fp8", "w8a8_fp8"],
                        help="serve with FP8 linear layers (the engine's --quantization): fp8 block-wise, w8a8_fp8 "
                             "per channel")
    parser.add_argument("--fp8-gemm-backend", default="auto",
                        choices=["auto", "weight_only", "triton", "cublas", "cutlass", "dequant"],
                        help="the engine's FP8 GEMM: with --quantization fp8 auto is fused triton up to 16 tokens, "
                             "two-kernel triton up to 256, cublas above; with w8a8_fp8 auto is cublas (cuBLASLt's "
                             "FP8 GEMM for q/k/v, o and down with their scales applied by the kernels that read "
                             "them, else where it runs triton), triton the per-channel Triton GEMM, cutlass "
                             "torch._scaled_mm row-wise")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="the engine's --kv-cache-dtype: auto (= its --dtype), bf16, fp8_e4m3, fp8_e5m2")
    parser.add_argument("--images", type=int, default=0, metavar="N",
                        help="N pictures of --image-size in front of each prompt's text (a vision-language model: "
                             "tiny-vl, qwen3-vl-2b or --model-path; engine only, with --skip-hf); --prompt-len stays the "
                             "text's length, so the run compares with the text-only model at the same prompts")
    parser.add_argument("--image-size", type=int, default=448, help="the pictures' width and height in pixels")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each after a first, unmeasured burst of the same workload; the best is reported")
    parser.add_argument("--skip-hf", action="store_true", help="engine only (no speedup_vs_hf)")
    parser.add_argument("--logprob-gap", type=int, default=0, metavar="N",
                        help="after the timed runs, sample the first N requests once more and report the mean / p99 / "
                             "max |log-prob| between the engine and HF on the checkpoint (logprob_gap_*: the "
                             "rollout/trainer mismatch of e.g. --quantization fp8 before any training)")
    parser.add_argument("--out", nargs="?", const=str(ROOT / "bench" / "results"), default=None,
                        help="write engine_decode-<machine>-<date>.json into this folder (default bench/results) "
                             "or to this .json path")
    args = parser.parse_args()
    if args.images and not args.skip_hf:
        parser.error(f"--images {args.images}: the HF baseline is text-only; add --skip-hf")
    if args.images and args.logprob_gap:
        parser.error(f"--images {args.images}: --logprob-gap's HF reference is text-only; run it without --images")

    from slime.backends.embedded_engine.serving.launch import EmbeddedEngineProcess

    tmp = None
    model_path = args.model_path
    if model_path is None:
        tmp = tempfile.mkdtemp(prefix=f"bench-{args.model}-")
        started = time.perf_counter()
        model_path = build_checkpoint(args.model, tmp)
        print(f"built {args.model} in {time.perf_counter() - started:.0f}s at {model_path}", file=sys.stderr)
    try:
        prompts, lengths = make_workload(args.num_requests, text_vocab(model_path), args.seed, args.prompt_len,
                                         args.max_new_tokens)
        image_data, image_tokens = None, []
        if args.images:
            prompts, image_data, image_tokens = image_workload(model_path, prompts, args.images, args.image_size,
                                                               args.seed)
        context = max(512, max(len(p) + n for p, n in zip(prompts, lengths)))
        quantization = ["--quantization", args.quantization, "--fp8-gemm-backend", args.fp8_gemm_backend] \
            if args.quantization else []
        engine = EmbeddedEngineProcess(model_path, extra_args=[
            "--device", args.device, "--max-running-requests", str(args.num_requests),
            "--context-length", str(context), "--kv-cache-dtype", args.kv_cache_dtype, *quantization,
            *shlex.split(args.engine_args)])
        hf = None if args.skip_hf else HFBaseline(model_path, args.device, args.hf_batch_size)
        started = time.perf_counter()
        engine.start()
        try:
            engine.wait_healthy(timeout=600)
            start_seconds = time.perf_counter() - started  # spawn, load, quantize (+ FP8 warm-up), cache, health
            # The first burst of the workload is its warm-up: it compiles what the start did not (and, where the
            # engine captures graphs lazily, captures those of the buckets the burst visits), which the measured
            # runs then reuse (what a training run's first rollout pays once).
            first = server_info(engine.url)["internal_states"][0]
            first_started = time.perf_counter()
            loop = asyncio.new_event_loop()  # one client session for every burst
            loop.run_until_complete(run_engine(engine.url, prompts, lengths, image_data))
            first_burst_seconds = time.perf_counter() - first_started
            first_captures = server_info(engine.url)["internal_states"][0]["cuda_graph_captures"] - first["cuda_graph_captures"]
            if hf is not None:
                hf.warmup(prompts)
            # Alternate the two and keep each one's best run (the CPU machine is shared and noisy).
            engine_runs, hf_runs = [], []
            for _ in range(args.repeats):
                before_info = server_info(engine.url)
                before = before_info["batch_stats"]
                tps, timeline = loop.run_until_complete(run_engine(engine.url, prompts, lengths, image_data))
                info = server_info(engine.url)
                delta = {k: info["batch_stats"][k] - before[k]
                         for k in ("decode_seconds", "decode_steps", "decode_rows", "decode_kv_tokens", "prefill_seconds",
                                   "prefill_forwards", "prefill_tokens", "busy_seconds", "joins_while_decoding")}
                # graphs captured inside this run (requests joining at other moments than in the first burst reach
                # other batch buckets): their count and wall time, which the decode time includes
                for key in ("cuda_graph_captures", "cuda_graph_capture_seconds"):
                    delta[key] = (info["internal_states"][0].get(key, 0) or 0) - (before_info["internal_states"][0].get(key, 0) or 0)
                engine_runs.append((tps, delta, info, timeline))
                if hf is not None:
                    hf_runs.append(hf.run(prompts, lengths))
            disk_update = disk_update_seconds(engine.url, model_path)
            samples = (loop.run_until_complete(sample_outputs(engine.url, prompts[: args.logprob_gap],
                                                              lengths[: args.logprob_gap])) if args.logprob_gap else [])
            loop.run_until_complete(http_utils.close_client())
            loop.close()
        finally:
            engine.stop()
        hf_batch_size = None if hf is None else (hf.batch_size or args.num_requests)
        hf = None  # free its device memory before the in-process weight-update timing
        update = weight_update_seconds(model_path, args.device, args.quantization)
        gap = logprob_gap(model_path, args.device, samples) if samples else {}
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    engine_tps, decode, info, timeline = max(engine_runs, key=lambda r: r[0])
    memory = info["internal_states"][0]["memory_usage"]
    weight_bytes = memory["weight"] * 2**30
    kv_bytes_per_token = memory["kv_bytes_per_token"]
    burst_seconds = sum(lengths) / engine_tps
    metrics = {"engine_output_tokens_per_s": engine_tps, "burst_seconds": burst_seconds,
               "engine_busy_fraction": decode["busy_seconds"] / burst_seconds,
               "prefill_seconds": decode["prefill_seconds"], "prefill_forwards": decode["prefill_forwards"],
               "prefill_tokens": decode["prefill_tokens"], "joins_while_decoding": decode["joins_while_decoding"],
               # from spawning the engine to healthy: imports, load, FP8 quantization and GEMM warm-up, cache
               "engine_start_seconds": start_seconds,
               "start_cuda_graph_captures": first["cuda_graph_captures"],
               "start_capture_seconds": first.get("cuda_graph_capture_seconds", 0.0),
               "first_burst_seconds": first_burst_seconds, "first_burst_cuda_graph_captures": first_captures,
               "measured_cuda_graph_captures": engine_runs[-1][2]["internal_states"][0]["cuda_graph_captures"]
               - first["cuda_graph_captures"] - first_captures,  # over all measured runs
               # the reported (best) run's own captures, and its decode rate with their time taken out
               "best_run_cuda_graph_captures": decode["cuda_graph_captures"],
               "best_run_capture_seconds": decode["cuda_graph_capture_seconds"],
               **{f"timeline/{key}_s": value for key, value in timeline.items()},
               # the burst's wall time outside its engine steps: before the last admission (requests arriving,
               # parsed, gathered) and after the engine's last step (answers built, sent and read)
               "admission_seconds": timeline["last_admission"],
               "answer_seconds": timeline["last_answer_read"] - timeline["last_finish"]}
    if hf_runs:
        hf_tps, hf_padded_tps = max(hf_runs)
        metrics.update({"hf_generate_output_tokens_per_s": hf_tps,
                        "hf_generate_padded_batch_tokens_per_s": hf_padded_tps, "speedup_vs_hf": engine_tps / hf_tps})
    metrics.update({"weight_update_seconds": update, "disk_update_seconds": disk_update, **gap})
    steps = decode["decode_steps"]
    metrics.update({"decode_seconds": decode["decode_seconds"], "decode_steps": steps,
                    "decode_steps_per_s": steps / decode["decode_seconds"],
                    # the same without the graph captures inside the run (0 on the CPU: no graphs)
                    "decode_steps_per_s_without_captures":
                        steps / max(decode["decode_seconds"] - decode["cuda_graph_capture_seconds"], 1e-9),
                    "decode_mean_batch": decode["decode_rows"] / steps,
                    "decode_mean_length": decode["decode_kv_tokens"] / decode["decode_rows"],
                    "decode_output_tokens_per_s": decode["decode_rows"] / decode["decode_seconds"],
                    "end_to_end_over_decode_rate": engine_tps / (decode["decode_rows"] / decode["decode_seconds"])})
    if args.device == "cuda":
        peak = hbm_peak()[0]
        traffic = (steps * weight_bytes + decode["decode_kv_tokens"] * kv_bytes_per_token) / decode["decode_seconds"]
        copy_bw = measured_copy_bytes_per_s()
        metrics.update({"decode_hbm_bytes_per_s": traffic, "roofline_fraction": traffic / peak,
                        "roofline_fraction_over_burst_wall": traffic * decode["decode_seconds"] / burst_seconds / peak,
                        "measured_copy_bytes_per_s": copy_bw, "roofline_fraction_vs_measured_copy": traffic / copy_bw})
    if args.images:  # the engine's prompt lengths matched these ids in every answer (run_engine)
        metrics.update({"image_tokens_per_request": sum(image_tokens),
                        "prompt_tokens_per_request": sum(map(len, prompts)) / len(prompts)})
    built = {"tiny": " (slime.utils.tiny_model, seed 0)", "small": " (slime.utils.tiny_model, seed 0)",
             "tiny-vl": " (slime.utils.tiny_vlm qwen3_vl, seed 0)"}
    config = {"model": args.model_path or (args.model + built.get(args.model, " architecture, random bf16 weights, "
                                                                                "tiny tokenizer")),
              "device": args.device, "dtype": "bfloat16" if args.device == "cuda" else "float32",
              "num_requests": args.num_requests, "logprob_gap_requests": args.logprob_gap,
              "prompt_len": args.prompt_len or "8-64", "output_len": args.max_new_tokens or "16-128",
              # pictures in front of each prompt's text (prompt_len counts the text only) and their tokens each
              **({"images_per_request": args.images, "image_size": args.image_size,
                  "image_tokens_per_image": image_tokens[0]} if args.images else {}),
              "total_output_tokens": sum(lengths), "temperature": 1.0, "ignore_eos": True, "repeats": args.repeats,
              "context_length": context, "engine_args": args.engine_args,
              "quantization": args.quantization, "kv_cache_dtype": memory["kv_cache_dtype"],
              "fp8_gemm_backend": args.fp8_gemm_backend if args.quantization else None,
              "hf_batch_size": hf_batch_size,
              "hf_batches": None if hf_batch_size is None else math.ceil(args.num_requests / hf_batch_size),
              "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_token,
              "python": platform.python_version(), "torch": torch.__version__}
    if args.device == "cuda":
        config["gpu"] = torch.cuda.get_device_name(0)
        config.update(hbm_peak_config())
    write_result("engine_decode", config, metrics, args.out)


if __name__ == "__main__":
    main()
