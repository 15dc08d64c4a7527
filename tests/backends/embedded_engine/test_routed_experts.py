"""``--enable-return-routed-experts``: the experts the engine reports for each position and MoE layer
are the ones transformers' own forward picks on the same tokens (DeepSeek-V3's and GLM-4.5's sigmoid,
group-limited routers, Qwen3-MoE's and the hybrid Qwen3.5-MoE's and Qwen3-Next's softmax top-k), over
prefill and decode positions, batched rows of different lengths, shared prefills, slot moves and
``routed_experts_start_len``, and at the image tokens of MoE vision-language models (Qwen3.5-MoE and
Qwen3-VL-MoE with their vision towers); the HTTP answer is SGLang's wire format, which the rollout's
decoder (``Sample``) reads back (``test_moe_models.py``, whose server runs with the flag)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engine_test_utils import load_hf
from slime.backends.embedded_engine.engine import Engine
from slime.backends.embedded_engine.io_struct import GenerateRequest, SamplingParams
from slime.backends.embedded_engine.model_runner import ModelRunner
from slime.utils.moe_routing import hf_routers, routed_layout

pytestmark = pytest.mark.timeout(300)


@torch.no_grad()
def hf_routed_experts(model, tokens: list[int], **images) -> np.ndarray:
    """Experts transformers' forward picks at every position of ``tokens`` but the last: ``[len − 1,
    layers, k]``, each position's k experts sorted (dense layers zero). ``images``: a vision-language
    model's ``pixel_values`` and ``image_grid_thw`` for the image tokens of ``tokens``."""
    layers, topk = routed_layout(model.config)
    out = np.zeros((len(tokens), layers, topk), dtype=np.int64)
    handles = []
    for layer, router in hf_routers(model):
        def keep(module, args, output, layer=layer):
            out[:, layer] = output[2].numpy()
        handles.append(router.register_forward_hook(keep))
    ids = torch.tensor([tokens])
    if images:
        images["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    try:
        model(ids, **images)
    finally:
        for handle in handles:
            handle.remove()
    return np.sort(out[:-1], axis=-1)


def run_engine(engine: Engine, requests: list[GenerateRequest]):
    done, left = threading.Event(), [len(requests)]

    def on_event(seq, finished):  # on the engine thread
        if finished:
            left[0] -= 1
            if not left[0]:
                done.set()

    seqs = engine.call(lambda: [engine.add_request(r, on_event) for r in requests]).result(30)
    assert done.wait(120)
    return seqs


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "qwen3_moe", "qwen3_5_moe", "qwen3_next"])
def test_engine_experts_equal_hf_routing(arch, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    hf = load_hf(model_dir)
    runner = ModelRunner(model_dir, num_slots=8, slot_capacity=64, routed_experts=True)
    engine = Engine(runner, chunked_prefill_size=16)  # the 19-token prompt prefills in two chunks
    engine.start()
    try:
        prompts = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 10], [11, 12], list(range(100, 119)), [42]]
        lengths = [12, 10, 3, 9, 6]  # different ends: finished rows leave, the last rows move into their slots
        requests = [GenerateRequest(rid=str(i), input_ids=p, params=SamplingParams(max_new_tokens=n, temperature=1.0,
                                                                                   ignore_eos=True, sampling_seed=i),
                                    return_routed_experts=True, routed_experts_start_len=3 if i == 3 else 0)
                    for i, (p, n) in enumerate(zip(prompts, lengths))]
        requests.append(GenerateRequest(rid="plain", input_ids=[7, 7, 7], params=SamplingParams(max_new_tokens=4)))
        seqs = run_engine(engine, requests)
    finally:
        engine.stop()
    assert engine.scheduler.stats.prefill_shared_rows >= 1  # prompts 0 and 1 shared one prefill
    assert seqs[-1].routed_experts is None  # a request that did not ask gets none
    dense = set(range(getattr(hf.config, "first_k_dense_replace", 0)))
    for seq, req in zip(seqs[:-1], requests):
        tokens = req.input_ids + seq.output_ids
        got = seq.routed_experts
        assert got.dtype == np.int32 and got.shape == (len(tokens) - 1 - req.routed_experts_start_len,
                                                       hf.config.num_hidden_layers, hf.config.num_experts_per_tok)
        want = hf_routed_experts(hf, tokens)[req.routed_experts_start_len:]
        np.testing.assert_array_equal(np.sort(got, axis=-1), want, err_msg=f"request {req.rid}")
        for layer in range(hf.config.num_hidden_layers):
            assert (got[:, layer] == 0).all() == (layer in dense)


def _picture(size, shapes: int):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for k in range(shapes):
        draw.ellipse([4 + 12 * k, 6, 14 + 12 * k, 16], fill=(200, 30 + 60 * k, 30))
    return image


#: MoE vision-language architecture -> the conftest fixture building its tiny checkpoint
MOE_VLM_FIXTURES = {"qwen3_5_moe": "tiny_qwen3_5_moe_vl_dir", "qwen3_vl_moe": "tiny_qwen3_vl_moe_dir"}


@pytest.mark.parametrize("arch", list(MOE_VLM_FIXTURES))
def test_engine_experts_at_image_tokens_equal_hf_routing(arch, request):
    """Prompts with images on a MoE vision-language model (the hybrid Qwen3.5-MoE; Qwen3-VL-MoE with its
    deepstack features): at the image tokens the engine reports the experts transformers' forward picks on
    the vision tower's embeddings there, at the text tokens those of the text — with 8-token prefill chunks
    cutting through the image runs (one request prefilling at a time, the others decoding beside it), one
    image, two and none. Routing the placeholders' own embeddings instead picks other experts there."""
    from transformers import AutoModelForImageTextToText

    from slime.backends.embedded_engine.vision import attach_images
    from slime.utils.multimodal import encode_image, process_images
    from slime.utils.processing_utils import load_processor

    model_dir = request.getfixturevalue(MOE_VLM_FIXTURES[arch])
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = load_processor(model_dir)
    image_token = hf.config.image_token_id
    one = [_picture((84, 56), 4)]  # the first two requests: two samples of one prompt
    pictures = [one, one, [_picture((56, 56), 1), _picture((112, 56), 3)], [], [_picture((56, 84), 2)]]
    image_data = [[encode_image(image) for image in images] or None for images in pictures]
    image_data[1] = image_data[0]  # the same list: processed once for both
    texts, requests = [], []
    for i, images in enumerate(pictures):
        parts = [{"type": "image"}] * len(images) + [{"type": "text", "text": f"how many dots {max(i, 1)}?"}]
        texts.append(processor.tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                                             add_generation_prompt=True))
        ids = processor.tokenizer.encode(texts[-1], add_special_tokens=False)
        requests.append(GenerateRequest(rid=str(i), input_ids=ids, image_data=image_data[i], return_routed_experts=True,
                                        params=SamplingParams(max_new_tokens=6 + i, temperature=1.0, ignore_eos=True,
                                                              sampling_seed=i)))
    runner = ModelRunner(model_dir, num_slots=8, slot_capacity=128, routed_experts=True)
    attach_images(runner, requests)
    engine = Engine(runner, chunked_prefill_size=8)
    engine.start()
    try:
        seqs = run_engine(engine, requests)
    finally:
        engine.stop()
    assert engine.scheduler.stats.joins_while_decoding >= 1
    layers, topk = routed_layout(hf.config)
    image_rows = placeholder_flips = 0
    for seq, req, text, images in zip(seqs, requests, texts, pictures):
        tokens = req.input_ids + seq.output_ids
        ids, inputs = process_images(processor, text, images)
        assert ids == req.input_ids  # the engine expanded each image's placeholder as the processor does
        got = seq.routed_experts
        assert got.dtype == np.int32 and got.shape == (len(tokens) - 1, layers, topk)
        # a sampled image placeholder would be an image slot to transformers' forward: compare up to it
        cut = len(ids) + (seq.output_ids.index(image_token) if image_token in seq.output_ids else len(seq.output_ids))
        kwargs = {k: inputs[k] for k in ("pixel_values", "image_grid_thw")} if images else {}
        want = hf_routed_experts(hf, tokens[:cut], **kwargs)
        np.testing.assert_array_equal(np.sort(got[:cut - 1], axis=-1), want, err_msg=f"request {req.rid}")
        at_images = np.asarray(ids) == image_token
        image_rows += int(at_images.sum())
        if images:
            placeholders = hf_routed_experts(hf, ids + [0])[at_images]
            placeholder_flips += int((placeholders != np.sort(got[:len(ids)][at_images], axis=-1)).any(-1).sum())
    assert image_rows == 6 + 6 + (4 + 8) + 6  # every image token was compared
    assert placeholder_flips > 0


def test_flag_needs_an_moe_model(tiny_model_dir):
    with pytest.raises(ValueError, match="--enable-return-routed-experts needs an MoE model"):
        ModelRunner(tiny_model_dir, num_slots=2, slot_capacity=32, routed_experts=True)


def test_a_server_without_the_flag_answers_without_the_field(tiny_glm4_moe_dir):
    """As SGLang without --enable-return-routed-experts (no capturer): the request is served and its
    meta_info has no routed_experts."""
    from slime.backends.embedded_engine.serving.async_engine import AsyncEngine

    engine = Engine(ModelRunner(tiny_glm4_moe_dir, num_slots=2, slot_capacity=32))
    engine.start()
    try:
        request = GenerateRequest(rid="r", input_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=3),
                                  return_routed_experts=True, return_logprob=True)
        seq, = run_engine(engine, [request])
        meta = AsyncEngine(engine).meta_info(seq, latency=0.1)
    finally:
        engine.stop()
    assert len(seq.output_ids) == 3 and len(meta["output_token_logprobs"]) == 3
    assert "routed_experts" not in meta


@pytest.mark.gpu
def test_cuda_graph_decode_records_the_experts(tiny_deepseek_v3_dir):
    """On CUDA the decode steps replay graphs captured with the recording in them (and run one step
    ahead): the experts still equal transformers' on every position."""
    hf = load_hf(tiny_deepseek_v3_dir)
    runner = ModelRunner(tiny_deepseek_v3_dir, device="cuda", dtype="float32", num_slots=4, slot_capacity=64,
                         routed_experts=True)
    assert runner.graphs.enabled
    engine = Engine(runner, chunked_prefill_size=64)
    engine.start()
    try:
        prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [42]]
        requests = [GenerateRequest(rid=str(i), input_ids=p, params=SamplingParams(max_new_tokens=20 - 4 * i, temperature=0,
                                                                                   ignore_eos=True),
                                    return_routed_experts=True) for i, p in enumerate(prompts)]
        seqs = run_engine(engine, requests)
    finally:
        engine.stop()
    assert runner.graphs.captures > 0  # the decode steps ran as graphs
    for seq, req in zip(seqs, requests):
        np.testing.assert_array_equal(np.sort(seq.routed_experts, axis=-1),
                                      hf_routed_experts(hf, req.input_ids + seq.output_ids))


def test_speculative_verify_steps_record_the_accepted_tokens_experts(tiny_deepseek_v3_dir, tmp_path):
    """NEXTN speculation (a "Markov" DeepSeek-V3 whose MTP layer drafts exactly, so most drafts are
    accepted): positions filled by verify forwards — accepted drafts, rejected ones overwritten later
    — report the experts of the tokens finally there."""
    from engine_test_utils import markov_checkpoint
    from slime.backends.embedded_engine.speculative.mtp import NextNDrafter
    from slime.backends.embedded_engine.speculative.decoder import SpeculativeConfig, SpeculativeDecoder

    model_dir = markov_checkpoint(tiny_deepseek_v3_dir, tmp_path / "markov", "exact", 0.03)
    hf = load_hf(model_dir)
    runner = ModelRunner(model_dir, num_slots=4, slot_capacity=64, routed_experts=True)
    engine = Engine(runner, speculative=SpeculativeDecoder(SpeculativeConfig("NEXTN", 4), NextNDrafter(runner, 64)), seed=1)
    engine.start()
    try:
        prompts = [[5, 6, 7, 8, 5, 6], [9, 10, 11]]
        requests = [GenerateRequest(rid=str(i), input_ids=p, params=SamplingParams(max_new_tokens=14, temperature=1.0,
                                                                                   ignore_eos=True),
                                    return_routed_experts=True) for i, p in enumerate(prompts)]
        seqs = run_engine(engine, requests)
    finally:
        engine.stop()
    stats = engine.scheduler.stats
    assert stats.spec_accepted_drafts > 0 and stats.spec_accepted_drafts < stats.spec_proposed_drafts, vars(stats)
    for seq, req in zip(seqs, requests):
        np.testing.assert_array_equal(np.sort(seq.routed_experts, axis=-1),
                                      hf_routed_experts(hf, req.input_ids + seq.output_ids))
