"""``--kv-cache-dtype``: an FP8 KV cache (1 byte a value, saturated writes, reads times the layer's scale).

The accuracy bound of the decode test: e4m3 keeps 3 mantissa bits, so a stored value is off by at most
2^-4 of itself (half an ulp; the checkpoint scales below are powers of two, which add no rounding).
Keys and values then carry a relative error of up to 6%, which the scores and the attention outputs
inherit (softmax weights change by up to ~6% of |score|); through the tiny model's four layers the
log-probs of 24 teacher-forced decode steps moved by at most 0.033 nats (measured: the largest change of
any vocabulary entry at any step; 0.032 with scale 1.0, 0.070 for e5m2's 2 mantissa bits). We allow
0.1 nats (3x the e4m3 measurement). A read that forgets the scale (keys and values 16x too large) moves
them by 1.78 nats, one that reads the stored bytes as integers by 1.39:
:func:`test_broken_reads_leave_the_bound` checks the bound catches both.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from slime.backends.embedded_engine import kv_cache as kv
from slime.backends.embedded_engine.kernels.attention import decode_attention, slot_attention_forward
from slime.backends.embedded_engine.kv_cache import CacheShape, DecodeCacheView, SlotCacheView, SlotKVCache
from slime.backends.embedded_engine.model_runner import ForwardRow, ModelRunner, kv_tokens_for_memory

pytestmark = pytest.mark.timeout(120)

needs_interpreter = pytest.mark.skipif(  # scripts/test.sh runs these again with TRITON_INTERPRET=1
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="runs the Triton kernels on the CPU: needs TRITON_INTERPRET=1 and an importable triton")

E4M3 = torch.float8_e4m3fn
LOGPROB_BOUND = 0.1  # nats, see the module docstring
SCALE = 2.0 ** -4  # the checkpoint's k_scale / v_scale in the scaled tests: stored values are 16x the real ones


# ------------------------------------------------------------------ flag, storage, sizing
def test_flag_names_and_refusals(tiny_model_dir):
    from slime.backends.embedded_engine.config import parse_args

    assert parse_args(["--model-path", tiny_model_dir, "--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"
    for name in ("fp4_e2m1", "mxfp8", "nvfp4", "int8"):
        with pytest.raises(SystemExit, match=f"--kv-cache-dtype '{name}' is not supported"):
            parse_args(["--model-path", tiny_model_dir, "--kv-cache-dtype", name])
    assert kv.resolve_kv_cache_dtype("auto", torch.float32) is torch.float32
    assert kv.resolve_kv_cache_dtype("bfloat16", torch.float32) is torch.bfloat16
    assert kv.resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16) is torch.float8_e5m2


def test_fp8_cache_is_one_byte_a_value_and_doubles_the_token_budget(tiny_model_dir, monkeypatch):
    runners = {name: ModelRunner(tiny_model_dir, device="cpu", dtype="bfloat16", num_slots=4, kv_cache_dtype=name)
               for name in ("auto", "fp8_e4m3")}
    bf16, fp8 = runners["auto"], runners["fp8_e4m3"]
    assert bf16.kv_cache.keys[0].dtype == torch.bfloat16 and fp8.kv_cache.keys[0].dtype == E4M3
    assert fp8.kv_cache.keys[0].element_size() == 1 and fp8.kv_cache.values[0].element_size() == 1
    assert fp8.kv_cache.shape == bf16.kv_cache.shape and 2 * fp8.kv_cache.nbytes() == bf16.kv_cache.nbytes()
    assert 2 * fp8._bytes_per_token() == bf16._bytes_per_token()
    # --mem-fraction-static on a (pretend) 1 GiB device with 200 MiB in use: the same bytes, twice the tokens
    free, total = 824 << 20, 1 << 30
    assert kv_tokens_for_memory(free, total, 0.5, fp8._bytes_per_token()) == \
        2 * kv_tokens_for_memory(free, total, 0.5, bf16._bytes_per_token())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    budgets = {}
    for name, runner in runners.items():
        runner.device = torch.device("cuda")  # the CUDA sizing branch of _plan_cache, run on the host
        runner.context_length = 512
        runner._plan_cache(None, 0.5, None)
        budgets[name] = runner.kv_token_budget
    assert budgets["fp8_e4m3"] == 2 * budgets["auto"] > 0


def test_server_reports_the_cache_dtype_and_its_token_bytes(tiny_model_dir):
    from slime.backends.embedded_engine.serving.server import _memory_usage

    runner = ModelRunner(tiny_model_dir, device="cpu", num_slots=2, max_total_tokens=1024, kv_cache_dtype="fp8_e5m2")
    usage = _memory_usage(runner)
    assert usage["kv_cache_dtype"] == "float8_e5m2" and usage["kv_token_budget"] == 1024
    assert usage["kv_bytes_per_token"] == runner._bytes_per_token() == runner.kv_cache.shape.bytes_per_token(torch.uint8)


def test_mla_models_refuse_an_fp8_cache(tiny_deepseek_v3_dir):
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e4m3: an FP8 cache of multi-latent attention"):
        ModelRunner(tiny_deepseek_v3_dir, device="cpu", num_slots=2, kv_cache_dtype="fp8_e4m3")


# ------------------------------------------------------------------ writes saturate, reads scale
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_write_path_saturates(dtype):
    """An outlier is stored as the format's largest finite value (torch's own cast gives inf for e5m2),
    through the prefill view and the decode view alike."""
    limit = torch.finfo(dtype).max
    shape = CacheShape(1, 2, 8, num_slots=3, slot_capacity=6)
    new = torch.full((1, 2, 1, 8), 1e6)
    new[..., 1] = -1e6
    new[..., 2] = 0.5
    for write in ("prefill", "decode"):
        cache = SlotKVCache(shape, dtype, torch.device("cpu"), compute_dtype=torch.float32)
        if write == "prefill":
            view = SlotCacheView(cache, [1], torch.tensor([0]), torch.tensor([1]), torch.tensor([4]), kv_length=5)
        else:
            view = DecodeCacheView(cache, torch.tensor([1]), torch.tensor([4]), kv_length=5)
        view.update(new, new, layer_idx=0)
        stored = cache.keys[0][1, :, 4].float()
        assert torch.isfinite(stored).all(), write
        assert (stored[:, 0] == limit).all() and (stored[:, 1] == -limit).all() and (stored[:, 2] == 0.5).all()


def test_reads_dequantize_with_the_layer_scale():
    """Both views hand the attention ``stored x scale`` in the compute dtype; ``raw`` hands the bytes."""
    shape = CacheShape(2, 1, 4, num_slots=2, slot_capacity=3)
    cache = SlotKVCache(shape, E4M3, torch.device("cpu"), compute_dtype=torch.float32, k_scales=[1.0, SCALE],
                        v_scales=[1.0, 2 * SCALE])
    x = torch.tensor([0.25, -0.5, 0.125, 0.75]).view(1, 1, 1, 4)  # exact in e4m3 at either scale
    keys, values = DecodeCacheView(cache, torch.tensor([0]), torch.tensor([0]), kv_length=1).update(x, x, 1)
    assert keys.dtype == torch.float32 and torch.equal(keys[0, 0, 0], x.flatten())
    assert torch.equal(values[0, 0, 0], x.flatten())
    assert torch.equal(cache.keys[1][0, 0, 0].float(), x.flatten() / SCALE)  # stored 16x
    raw_keys, _ = DecodeCacheView(cache, torch.tensor([0]), torch.tensor([1]), kv_length=2, raw=True).update(x, x, 1)
    assert raw_keys.dtype == E4M3
    view = SlotCacheView(cache, [0], torch.tensor([0]), torch.tensor([0]), torch.tensor([2]), kv_length=3)
    keys, values = view.update(x, x, 1)
    assert torch.equal(keys[0, 0, :3], x.flatten().expand(3, 4)) and torch.equal(values[0, 0, 2], x.flatten())


def test_slot_copies_moves_and_gathers_keep_the_fp8_bytes():
    """Shared prompts (copy_slots), compaction and retraction (move_slot) and a prefill over scattered slots
    (a gathered read) move the stored bytes as they are (indexed through uint8 views)."""
    shape = CacheShape(1, 2, 4, num_slots=4, slot_capacity=5)
    cache = SlotKVCache(shape, E4M3, torch.device("cpu"), compute_dtype=torch.float32, k_scales=[SCALE])
    stored = kv.quantize(torch.randn(4, 2, 5, 4, generator=torch.Generator().manual_seed(0)), E4M3)
    cache.keys[0].copy_(stored)
    cache.copy_slots([0], [2], length=3)
    cache.move_slot(1, 3, length=5)
    assert torch.equal(cache.keys[0][2, :, :3].view(torch.uint8), stored[0, :, :3].view(torch.uint8))
    assert torch.equal(cache.keys[0][2, :, 3:].view(torch.uint8), stored[2, :, 3:].view(torch.uint8))
    assert torch.equal(cache.keys[0][3].view(torch.uint8), stored[1].view(torch.uint8))
    view = SlotCacheView(cache, [3, 0], torch.tensor([0]), torch.tensor([0]), torch.tensor([4]), kv_length=4)
    keys, _ = view.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)
    assert torch.equal(keys, torch.stack([stored[1, :, :4], stored[0, :, :4]]).float() * SCALE)


def test_reference_attention_over_fp8_equals_attention_over_the_dequantized_cache():
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim, length = 3, 4, 2, 16, 9
    shape = CacheShape(1, kv_heads, dim, num_slots=batch, slot_capacity=length)
    cache = SlotKVCache(shape, E4M3, torch.device("cpu"), compute_dtype=torch.float32, k_scales=[SCALE],
                        v_scales=[3 * SCALE])
    cache.keys[0].copy_(kv.quantize(torch.randn(shape.num_slots, kv_heads, length, dim, generator=gen), E4M3, SCALE))
    cache.values[0].copy_(kv.quantize(torch.randn(shape.num_slots, kv_heads, length, dim, generator=gen), E4M3,
                                      3 * SCALE))
    query = torch.randn(batch, heads, 1, dim, generator=gen)
    mask = torch.zeros(batch, 1, 1, length)
    mask[0, ..., 4:] = float("-inf")
    keys, values = DecodeCacheView(cache, torch.arange(batch), torch.zeros(batch, dtype=torch.long), length).update(
        torch.zeros(batch, kv_heads, 1, dim), torch.zeros(batch, kv_heads, 1, dim), 0)
    out = decode_attention(query, keys, values, mask, 0.25)
    dequantized_k = cache.keys[0].float() * SCALE
    dequantized_v = cache.values[0].float() * (3 * SCALE)
    assert torch.equal(out, decode_attention(query, dequantized_k, dequantized_v, mask, 0.25))
    # the attention function given the raw FP8 rows and the scales (no Triton here) computes the same
    module = torch.nn.Module()
    module.layer_idx = 0
    raw, _ = slot_attention_forward(module, query, cache.keys[0], cache.values[0], mask, scaling=0.25,
                                    slot_kv_scales=(cache.k_scales, cache.v_scales))
    assert torch.equal(raw, out)
    # and the SDPA branch (here: no mask) dequantizes the raw rows before SDPA, which would refuse FP8
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module.is_causal, module.num_key_value_groups = False, heads // kv_heads
    sdpa, _ = slot_attention_forward(module, query, cache.keys[0], cache.values[0], None, scaling=0.25,
                                     slot_kv_scales=(cache.k_scales, cache.v_scales))
    expected, _ = sdpa_attention_forward(module, query, dequantized_k, dequantized_v, None, scaling=0.25)
    assert torch.equal(sdpa, expected)


# ------------------------------------------------------------------ the engine: decode close to the full-precision cache
def _scaled_checkpoint(src: str, dst) -> str:
    """The tiny model with SGLang's per-layer ``self_attn.k_scale`` / ``v_scale`` tensors in its safetensors."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (weights,) = Path(dst).glob("*.safetensors")
    tensors = load_file(str(weights))
    layers = {int(name.split(".")[2]) for name in tensors if name.startswith("model.layers.")}
    for layer in layers:
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(SCALE)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(SCALE)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def scaled_model_dir(tiny_model_dir, tmp_path_factory):
    return _scaled_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("kv_scales") / "model")


PROMPT = [5, 17, 99, 3, 42, 7, 8, 100]
STEPS = 24


def _decode(runner: ModelRunner, forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """Prefill, then STEPS decode steps (greedy, or feeding ``forced``): tokens and per-step log-probs."""
    logits, _ = runner.forward([0], [ForwardRow(PROMPT, 0)])
    tokens, logprobs = [], []
    for step in range(STEPS):
        logprob = torch.log_softmax(logits[0].double(), dim=-1)
        token = int(logprob.argmax()) if forced is None else forced[step]
        tokens.append(token)
        logprobs.append(logprob)
        logits = runner.decode([token], [len(PROMPT) + step])
    return tokens, torch.stack(logprobs)


@pytest.fixture(scope="module")
def full_precision(scaled_model_dir):
    runner = ModelRunner(scaled_model_dir, device="cpu", num_slots=2)  # fp32 cache, the scales unused
    greedy, _ = _decode(runner)
    forced = torch.randint(0, runner.vocab_size, (STEPS,), generator=torch.Generator().manual_seed(1)).tolist()
    _, logprobs = _decode(runner, forced)
    return greedy, forced, logprobs


def _fp8_gap(model_dir, full_precision) -> tuple[bool, float]:
    greedy, forced, reference = full_precision
    runner = ModelRunner(model_dir, device="cpu", num_slots=2, kv_cache_dtype="fp8_e4m3")
    assert runner.kv_cache.k_scales == [SCALE] * len(runner.kv_cache.keys)  # read from the checkpoint
    tokens, _ = _decode(runner)
    _, logprobs = _decode(runner, forced)
    return tokens == greedy, float((logprobs - reference).abs().max())


def test_fp8_decode_stays_close_to_the_full_precision_cache(scaled_model_dir, full_precision):
    same_greedy, gap = _fp8_gap(scaled_model_dir, full_precision)
    assert same_greedy
    assert 0 < gap < LOGPROB_BOUND  # > 0: the cache really holds FP8


@pytest.mark.parametrize("broken", ["forgets_the_scale", "reads_raw_bytes"])
def test_broken_reads_leave_the_bound(scaled_model_dir, full_precision, monkeypatch, broken):
    """The decode test's bound is tight enough to catch a read path that drops the scale or
    reinterprets the stored bytes as integers."""
    def no_scale(stored, dtype, scale=1.0):
        return stored.to(dtype) if stored.dtype in kv.FP8_DTYPES else stored

    def raw_bytes(stored, dtype, scale=1.0):
        return stored.view(torch.uint8).to(dtype) * scale if stored.dtype in kv.FP8_DTYPES else stored

    monkeypatch.setattr(kv, "dequantize", {"forgets_the_scale": no_scale, "reads_raw_bytes": raw_bytes}[broken])
    _, gap = _fp8_gap(scaled_model_dir, full_precision)
    assert gap > LOGPROB_BOUND


def test_speculative_verify_and_retraction_over_an_fp8_cache_keep_greedy_outputs(scaled_model_dir, tmp_path):
    """STANDALONE speculation (a perturbed draft; both caches FP8, as SGLang gives the draft the target's
    cache dtype): the verify forward writes the drafts into the FP8 cache, rejected ones are retracted,
    and the greedy outputs equal plain FP8 decoding's."""
    from engine_test_utils import copy_with_weights, generate_in_engine, load_hf

    from slime.backends.embedded_engine.engine import Engine
    from slime.backends.embedded_engine.io_struct import SamplingParams
    from slime.backends.embedded_engine.speculative.decoder import DraftModel, SpeculativeConfig, SpeculativeDecoder

    gen = torch.Generator().manual_seed(3)
    draft_dir = copy_with_weights(scaled_model_dir, tmp_path / "draft", {
        k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in load_hf(scaled_model_dir).state_dict().items()})
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7][: 3 + i] * 2 for i in range(4)]
    params = [SamplingParams(max_new_tokens=12 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(4)]
    outputs, stats = [], None
    for speculative in (False, True):
        runner = ModelRunner(scaled_model_dir, device="cpu", num_slots=8, kv_cache_dtype="fp8_e4m3")
        decoder = None
        if speculative:
            draft = DraftModel(ModelRunner(str(draft_dir), device="cpu", num_slots=8, kv_cache_dtype="fp8_e4m3"),
                               runner, 256)
            assert draft.runner.kv_cache.dtype == E4M3
            decoder = SpeculativeDecoder(SpeculativeConfig("STANDALONE", 4, str(draft_dir)), draft)
        engine = Engine(runner, speculative=decoder, seed=1)
        engine.start()
        try:
            outputs.append([seq.output_ids for seq in generate_in_engine(engine, prompts, params)])
            stats = vars(engine.scheduler.stats)
        finally:
            engine.stop()
    assert outputs[0] == outputs[1]
    assert 0 < stats["spec_accepted_drafts"] < stats["spec_proposed_drafts"]  # accepted and rejected both seen


def test_checkpoint_scales_must_be_positive(tiny_model_dir, tmp_path):
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    model_dir = _scaled_checkpoint(tiny_model_dir, tmp_path / "model")
    (weights,) = Path(model_dir).glob("*.safetensors")
    tensors = load_file(str(weights))
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.0)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.0.self_attn.v_scale = 0.0; it must be a positive number"):
        kv.read_kv_scales(model_dir, 2)


# ------------------------------------------------------------------ the Triton kernels (interpreter / GPU)
@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_triton_decode_kv_write_interpreted_saturates_and_scales(dtype):
    """The write kernel divides by the layer's scale, saturates outliers and stores at (slot, position).
    Inputs are FP8 values times the scale, so the cast itself is exact: the interpreter's fp32 -> fp8 cast
    does not round like the GPU's (it loses a carry into the exponent: -31.98 -> -16), which the ``gpu``
    test below checks against torch's cast instead."""
    from slime.backends.embedded_engine.kv_cache import write_decode_kv

    gen = torch.Generator().manual_seed(0)
    batch, heads, dim = 3, 2, 16
    key = kv.quantize(torch.randn(batch, heads, dim, generator=gen) * 64, dtype).float() * SCALE
    key[0, 0, :2] = torch.tensor([1e6, -1e6])
    value = kv.quantize(torch.randn(batch, heads, dim, generator=gen) * 8, dtype).float() * (2 * SCALE)
    rows, positions = torch.tensor([2, 0, 1]), torch.tensor([5, 0, 3])
    shape = CacheShape(1, heads, dim, num_slots=batch, slot_capacity=8)
    fused = SlotKVCache(shape, dtype, torch.device("cpu"))
    write_decode_kv(fused.keys[0], fused.values[0], key, value, rows, positions, SCALE, 2 * SCALE)
    limit = torch.finfo(dtype).max
    stored_k = fused.keys[0][rows, :, positions].float()
    assert torch.isfinite(stored_k).all() and stored_k[0, 0, 0] == limit and stored_k[0, 0, 1] == -limit
    assert torch.equal(stored_k, kv.quantize(key, dtype, SCALE).float())
    assert torch.equal(fused.values[0][rows, :, positions].float(), kv.quantize(value, dtype, 2 * SCALE).float())
    assert fused.keys[0].float().abs().sum() == stored_k.abs().sum()  # nothing written elsewhere


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_triton_decode_kv_write_on_cuda_equals_quantize(dtype, source):
    """The compiled write kernel stores exactly :func:`kv_cache.quantize` (divide, saturate, round to nearest)."""
    from slime.backends.embedded_engine.kernels import triton_attention
    from slime.backends.embedded_engine.kv_cache import write_decode_kv

    if not (torch.cuda.is_available() and triton_attention.available(torch.device("cuda"))):
        pytest.skip("needs CUDA and triton")
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch, heads, dim = 9, 8, 128
    key = (torch.randn(batch, heads, dim, generator=gen, device="cuda") * 8).to(source)
    key[0, 0, :2] = torch.tensor([1e6, -1e6])
    value = torch.randn(batch, heads, dim, generator=gen, device="cuda").to(source)
    rows, positions = torch.randperm(batch, device="cuda"), torch.arange(batch, device="cuda") * 3
    cache = SlotKVCache(CacheShape(1, heads, dim, num_slots=batch, slot_capacity=40), dtype, torch.device("cuda"))
    write_decode_kv(cache.keys[0], cache.values[0], key, value, rows, positions, SCALE, 2 * SCALE)
    assert torch.equal(cache.keys[0][rows, :, positions].float(), kv.quantize(key, dtype, SCALE).float())
    assert torch.equal(cache.values[0][rows, :, positions].float(), kv.quantize(value, dtype, 2 * SCALE).float())


def _fp8_kernel_case(device, batch=3, heads=4, kv_heads=2, dim=32, capacity=400, gen_seed=0):
    gen = torch.Generator(device=device).manual_seed(gen_seed)
    shape = CacheShape(1, kv_heads, dim, num_slots=batch + 1, slot_capacity=capacity)
    cache = SlotKVCache(shape, E4M3, torch.device(device), k_scales=[SCALE], v_scales=[2 * SCALE])
    cache.keys[0].copy_(kv.quantize(torch.randn(shape.num_slots, kv_heads, capacity, dim, generator=gen, device=device),
                                    E4M3, SCALE))
    cache.values[0].copy_(kv.quantize(torch.randn(shape.num_slots, kv_heads, capacity, dim, generator=gen,
                                                  device=device), E4M3, 2 * SCALE))
    return cache, gen


@needs_interpreter
def test_triton_decode_attention_interpreted_over_fp8_equals_the_dequantized_reference():
    """The flash-decoding kernel reading the FP8 bytes and scales = the dense reference over stored x scale."""
    from slime.backends.embedded_engine.kernels import triton_attention
    from test_attention import reference

    cache, gen = _fp8_kernel_case("cpu")
    positions = torch.tensor([0, 128, 300])
    length = int(positions.max()) + 1
    query = torch.randn(3, 4, 1, 32, generator=gen)
    keys, values = cache.keys[0][:3, :, :length], cache.values[0][:3, :, :length]
    out = triton_attention.decode_attention(query.reshape(3, 4, 32), keys, values, positions + 1, length, 0.17,
                                            SCALE, 2 * SCALE)
    expected = reference(query, keys.float() * SCALE, values.float() * (2 * SCALE), positions.tolist(), 0.17)[:, 0]
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    wrong = triton_attention.decode_attention(query.reshape(3, 4, 32), keys, values, positions + 1, length, 0.17)
    assert (wrong - expected).abs().max() > 1e-2  # the scales matter: without them the result differs
    # a verify step's 3 tokens a row over the same FP8 rows (lengths >= 3: the rows hold their tokens)
    from test_attention import reference_tokens

    lengths = positions.clamp_min(2) + 1
    tokens = torch.randn(3, 4, 3, 32, generator=gen)
    out = triton_attention.decode_attention(tokens, keys, values, lengths, length, 0.17, SCALE, 2 * SCALE)
    expected = reference_tokens(tokens, keys.float() * SCALE, values.float() * (2 * SCALE), lengths, 0.17)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_triton_decode_attention_interpreted_over_fp8_with_a_bf16_query_dots_in_fp16(dtype):
    """A bf16 query over an FP8 cache: the kernel's dots run in fp16 (``FP8_DOTS_IN_FP16``; the query is scaled
    by the softmax scale before it is rounded to fp16). Every output within ~one bf16 rounding of the fp32
    reference over the dequantized cache (outputs ~0.6), and a query past fp16's range (2e5, a bf16 value)
    still gives finite, correct outputs. (The bf16-dot path is checked on the GPU only: the interpreter's
    e4m3 -> bf16 conversion is wrong.)"""
    from slime.backends.embedded_engine.kernels import triton_attention
    from test_attention import reference

    gen = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, dim, length = 3, 8, 2, 64, 200
    keys = kv.quantize(torch.randn(batch, kv_heads, length, dim, generator=gen), dtype, SCALE)
    values = kv.quantize(torch.randn(batch, kv_heads, length, dim, generator=gen), dtype, 2 * SCALE)
    positions = torch.tensor([0, 64, length - 1])
    query = (torch.randn(batch, heads, dim, generator=gen) * 4).to(torch.bfloat16)

    def attend(q, scale):
        return triton_attention.decode_attention(q, keys, values, positions + 1, length, scale, SCALE, 2 * SCALE)

    def expected(q, scale):
        return reference(q.float()[:, :, None], keys.float() * SCALE, values.float() * (2 * SCALE),
                         positions.tolist(), scale)[:, 0]

    out, want = attend(query, 0.125), expected(query, 0.125)
    assert out.dtype == torch.bfloat16
    err = (out.float() - want).abs()  # the output's bf16 rounding (2^-9 relative) + the fp16 dots' (<= 4.8e-3 seen)
    assert (err <= want.abs() * 2 ** -8 + 6e-3).all() and err.mean() < 1.5e-3

    huge = query.clone()
    huge[:, :, :4] = 2e5  # x 0.01 = 2e3 in fp16; unscaled it would overflow to inf and the softmax to NaN
    out = attend(huge, 0.01)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), expected(huge, 0.01), atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,kv_heads", [(1, 16, 8), (128, 16, 8), (33, 4, 4)])
def test_triton_decode_attention_over_fp8_matches_reference_on_cuda(batch, heads, kv_heads, monkeypatch):
    """Compiled, a bf16 query over an FP8 cache, with the dots in fp16 (the default) and in bf16: both match the
    fp32 reference, and the fp16 dots are no less accurate on average."""
    from slime.backends.embedded_engine.kernels import triton_attention
    from test_attention import reference

    if not (torch.cuda.is_available() and triton_attention.available(torch.device("cuda"))):
        pytest.skip("needs CUDA and triton")
    cache, gen = _fp8_kernel_case("cuda", batch=batch, heads=heads, kv_heads=kv_heads, dim=128, capacity=1100,
                                  gen_seed=batch)
    positions = torch.randint(0, 1000, (batch,), generator=gen, device="cuda")
    positions[0] = 0
    length = int(positions.max()) + 1
    keys, values = cache.keys[0][:batch, :, :length], cache.values[0][:batch, :, :length]
    query = torch.randn(batch, heads, 1, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    expected = reference(query.float(), keys.float() * SCALE, values.float() * (2 * SCALE), positions.tolist(),
                         0.088)[:, 0]
    errors = {}
    for fp16_dots in (True, False):
        monkeypatch.setattr(triton_attention, "FP8_DOTS_IN_FP16", fp16_dots)
        out = triton_attention.decode_attention(query.reshape(batch, heads, 128), keys, values, positions + 1,
                                                length, 0.088, SCALE, 2 * SCALE)
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
        errors[fp16_dots] = float((out.float() - expected).abs().mean())
    assert errors[True] <= errors[False] * 1.05


@pytest.mark.gpu
def test_engine_fp8_kv_under_cuda_graphs_decodes_close_to_bf16_kv(scaled_model_dir):
    """On CUDA (Triton attention, decode CUDA graphs): greedy tokens equal and log-probs within the bound
    of the bf16 cache's, the FP8 cache 1 byte a value."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    results = {}
    for name in ("auto", "fp8_e4m3"):
        runner = ModelRunner(scaled_model_dir, device="cuda", num_slots=4, kv_cache_dtype=name)
        assert runner.graphs.enabled and runner.attention_backend == "triton"
        greedy, _ = _decode(runner)
        forced = torch.randint(0, runner.vocab_size, (STEPS,), generator=torch.Generator().manual_seed(1)).tolist()
        _, logprobs = _decode(runner, forced)
        assert runner.graphs.captures > 0
        results[name] = (greedy, logprobs.cpu(), runner.kv_cache.keys[0].element_size())
    assert results["fp8_e4m3"][2] == 1 and results["auto"][2] == 2
    assert results["fp8_e4m3"][0] == results["auto"][0]
    assert float((results["fp8_e4m3"][1] - results["auto"][1]).abs().max()) < LOGPROB_BOUND


@pytest.fixture
def faithful_interpreter(monkeypatch):
    """Triton's interpreter with two of its defects worked around, so that a whole decode step of the
    CUDA path can run on the CPU: its fp32/bf16 -> fp8 conversion misrounds near powers of two (-31.98
    -> -16) — replaced by torch's cast, which the GPU's ``cvt.rn.satfinite`` matches (the GPU tests) —
    and its ``tl.dot`` multiplies the raw bits of bf16 operands — widened to fp32 first (bf16 products
    are exact in fp32)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as itp

    convert = itp._convert_float
    fp8 = {"fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}
    sources = {"fp32": (torch.float32, np.int32), "bf16": (torch.bfloat16, np.int16), "fp16": (torch.float16, np.int16)}

    def to_fp8(data, src, dst, rounding):
        if dst.name in fp8 and src.name in sources:
            dtype, bits = sources[src.name]
            values = torch.from_numpy(np.frombuffer(data.tobytes(), dtype=bits).copy()).view(dtype)
            return values.to(fp8[dst.name]).view(torch.uint8).numpy().reshape(data.shape)
        return convert(data, src, dst, rounding)

    dot = itp.InterpreterBuilder.create_dot

    def widened_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(h):
            if h.dtype != tl.bfloat16:
                return h
            data = convert(h.data, tl.bfloat16, tl.float32, None).view(np.float32).reshape(h.data.shape)
            return itp.TensorHandle(data, tl.float32)
        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(itp, "_convert_float", to_fp8)
    monkeypatch.setattr(itp.InterpreterBuilder, "create_dot", widened_dot)


@needs_interpreter
def test_cuda_decode_path_interpreted_with_fp8_kv_stays_close(scaled_model_dir, faithful_interpreter, monkeypatch):
    """The decode path the engine takes on CUDA — the fused q/k-norm-rope kernel writing the step's keys
    and values into the FP8 cache, the flash-decoding kernel reading the raw FP8 rows with the
    checkpoint's scales — run on the CPU in bf16 (kernels interpreted): greedy tokens equal to the plain
    CPU path's with a bf16 cache, and log-probs within the CPU path's own bound (the compiled path on
    the H200: ``test_engine_fp8_kv_under_cuda_graphs_decodes_close_to_bf16_kv``)."""
    import types

    from slime.backends.embedded_engine.kernels import fused_ops

    def runner(kv_dtype: str, cuda_path: bool) -> ModelRunner:
        r = ModelRunner(scaled_model_dir, device="cpu", dtype="bfloat16", num_slots=4, kv_cache_dtype=kv_dtype)
        if cuda_path:
            r.attention_backend = "triton"  # decode: raw rows + the flash-decoding kernel (interpreted)
            for module in r.model.modules():
                if hasattr(module, "qkv_proj"):
                    module.fused_norm_rope = types.MethodType(fused_ops._attention_norm_rope, module)
        return r

    writes = []

    def target(view, layer_idx):  # what DecodeCacheView offers on CUDA
        writes.append(layer_idx)
        cache = view.cache
        return (cache.keys[layer_idx], cache.values[layer_idx], view.rows, view.positions, cache.k_scales[layer_idx],
                cache.v_scales[layer_idx])

    plain = runner("auto", False)
    forced = torch.randint(0, plain.vocab_size, (STEPS,), generator=torch.Generator().manual_seed(1)).tolist()
    want_greedy, _ = _decode(plain)
    _, want = _decode(plain, forced)
    monkeypatch.setattr(DecodeCacheView, "fused_write_target", target, raising=False)
    cuda = runner("fp8_e4m3", True)
    got_greedy, _ = _decode(cuda)
    _, got = _decode(cuda, forced)
    layers = cuda.model.config.num_hidden_layers
    assert writes == list(range(layers)) * (2 * STEPS)  # every decode step's every layer wrote in the fused kernel
    assert got_greedy == want_greedy
    assert float((got - want).abs().max()) < LOGPROB_BOUND
