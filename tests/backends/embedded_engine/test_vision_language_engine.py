"""The embedded engine serves vision-language models (tiny random fp32 Qwen2.5-VL, Qwen3-VL and Qwen3.5, the
latter two dense and MoE; Qwen3.5's hybrid language model keeps a gated-DeltaNet state per slot): images by
``/generate`` ``image_data`` and by chat ``image_url`` parts, the vision tower at prefill, M-RoPE
positions through prefill and decode, against transformers' own model; bad images answer 400;
a weight update reaches the vision tower."""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch
from PIL import Image, ImageDraw

from slime.backends.embedded_engine.serving.launch import running_engine
from slime.utils.multimodal import encode_image

pytestmark = pytest.mark.timeout(300)


def _picture(size, color, shapes):
    image = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for k in range(shapes):
        draw.ellipse([4 + 12 * k, 6, 14 + 12 * k, 16], fill=color)
    return image


IMAGES = [_picture((56, 84), (200, 30, 30), 2), _picture((112, 56), (30, 30, 200), 3)]


#: architecture -> the conftest fixture building its tiny checkpoint
VLM_FIXTURES = {"qwen2_5_vl": "tiny_vlm_dir", "qwen3_vl": "tiny_qwen3_vl_dir", "qwen3_vl_moe": "tiny_qwen3_vl_moe_dir",
                "qwen3_5": "tiny_qwen3_5_vl_dir", "qwen3_5_moe": "tiny_qwen3_5_moe_vl_dir"}


@pytest.fixture(scope="module", params=list(VLM_FIXTURES))
def model_dir(request):
    return request.getfixturevalue(VLM_FIXTURES[request.param])


@pytest.fixture(scope="module")
def http(model_dir):
    # 8-token prefill chunks: image runs straddle chunks
    with running_engine(model_dir, extra_args=["--context-length", "512", "--chunked-prefill-size", "8"]) as proc:
        with httpx.Client(base_url=proc.url, timeout=120) as client:
            yield client


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _prompt_ids(model_dir, n_images: int, text: str) -> list[int]:
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    tokenizer = _tokenizer(model_dir)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


@torch.no_grad()
def hf_logprobs(hf, model_dir, prompt: list[int], output: list[int], images: list, temperature: float) -> list[float]:
    """Reference: the HF model's full forward over the processor-expanded prompt and the output. A sampled
    image placeholder token would count as an image slot in HF's forward: the reference stops at the
    first one (its own log-prob included), so the comparison covers the output up to it."""
    from slime.utils.multimodal import process_images
    from slime.utils.processing_utils import load_processor

    processor = load_processor(model_dir)
    text = _tokenizer(model_dir).decode(prompt)
    ids, inputs = process_images(processor, text, images)
    if hf.config.image_token_id in output:
        output = output[:output.index(hf.config.image_token_id) + 1]
    full = torch.tensor([ids + output[:-1]])
    kwargs = {}
    if images:
        kwargs = dict(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                      mm_token_type_ids=(full == hf.config.image_token_id).int())
    logits = hf(input_ids=full, **kwargs).logits[0].double()  # the last output token is only a target
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return [float(logprobs[len(ids) - 1 + i, t]) for i, t in enumerate(output)]


def generate(http, **body):
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_image_requests_equal_hf(http, hf, model_dir):
    one, two, text_only = (_prompt_ids(model_dir, 1, "how many dots?"), _prompt_ids(model_dir, 2, "which has more?"),
                           _prompt_ids(model_dir, 0, "no picture here"))
    cases = [(one, IMAGES[:1]), (two, IMAGES), (text_only, [])]
    outs = generate(http, input_ids=[c[0] for c in cases], return_logprob=True,
                    image_data=[[encode_image(i) for i in c[1]] or None for c in cases],
                    sampling_params={"max_new_tokens": 10, "temperature": 0.8, "ignore_eos": True})
    for (prompt, images), out in zip(cases, outs):
        got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        ref = hf_logprobs(hf, model_dir, prompt, out["output_ids"], images, 0.8)
        assert got[:len(ref)] == pytest.approx(ref, abs=1e-4)
        image_tokens = 4 * 6 // 4 if len(images) == 1 else (4 * 6 + 8 * 4) // 4 if images else 0
        assert out["meta_info"]["prompt_tokens"] == len(prompt) - len(images) + image_tokens


def test_samples_of_one_image_prompt_share_its_prefill_and_differ_by_image(http, hf, model_dir):
    prompt = _prompt_ids(model_dir, 1, "count")
    outs = generate(http, input_ids=prompt, image_data=encode_image(IMAGES[0]), return_logprob=True,
                    sampling_params={"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "n": 2})
    for out in outs:
        got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        ref = hf_logprobs(hf, model_dir, prompt, out["output_ids"], IMAGES[:1], 1.0)
        assert got[:len(ref)] == pytest.approx(ref, abs=1e-4)
    # the same ids with another image of the same size: another prefill, other log-probs
    other = _picture((56, 84), (30, 200, 30), 4)
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    a, b = generate(http, input_ids=[prompt, prompt], image_data=[encode_image(IMAGES[0]), encode_image(other)],
                    return_logprob=True, sampling_params=greedy)
    assert a["meta_info"]["output_token_logprobs"][0][0] != b["meta_info"]["output_token_logprobs"][0][0]
    ref = hf_logprobs(hf, model_dir, prompt, b["output_ids"], [other], 1.0)
    assert [x[0] for x in b["meta_info"]["output_token_logprobs"]][:len(ref)] == pytest.approx(ref, abs=1e-4)


def test_chat_image_url_parts(http, hf, model_dir):
    url = encode_image(IMAGES[1])
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "how many dots?"}]}]
    response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0.7,
                                                        "return_meta_info": True})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    output = [x[1] for x in choice["meta_info"]["output_token_logprobs"]]
    ref = hf_logprobs(hf, model_dir, _prompt_ids(model_dir, 1, "how many dots?"), output, IMAGES[1:], 0.7)
    assert [x[0] for x in choice["meta_info"]["output_token_logprobs"]][:len(ref)] == pytest.approx(ref, abs=1e-4)


def test_bad_images_answer_400(http, model_dir, tmp_path):
    prompt = _prompt_ids(model_dir, 1, "count")
    cases = {str(tmp_path / "missing.png"): "image file not found",
             "https://example.com/a.png": "remote image URLs are not fetched"}
    for item, reason in cases.items():
        response = http.post("/generate", json={"input_ids": prompt, "image_data": item})
        assert response.status_code == 400 and reason in response.text, response.text
    response = http.post("/generate", json={"input_ids": prompt, "image_data": [encode_image(IMAGES[0])] * 2})
    assert response.status_code == 400 and "2 images for 1 image placeholders" in response.text


def test_weight_update_reaches_the_vision_tower(http, model_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".visual." in f".{name}":
                param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    updated = tmp_path / "updated"
    shutil.copytree(model_dir, updated)
    model.save_pretrained(updated, safe_serialization=True)
    prompt = _prompt_ids(model_dir, 1, "count")
    body = dict(input_ids=prompt, image_data=encode_image(IMAGES[0]), return_logprob=True,
                sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    before = generate(http, **body)
    try:
        assert http.post("/update_weights_from_disk", json={"model_path": str(updated)}).status_code == 200
        after = generate(http, **body)
        ref = hf_logprobs(model.eval(), model_dir, prompt, after["output_ids"], IMAGES[:1], 1.0)
        assert [x[0] for x in after["meta_info"]["output_token_logprobs"]][:len(ref)] == pytest.approx(ref, abs=1e-4)
        assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
    finally:
        http.post("/update_weights_from_disk", json={"model_path": model_dir})


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_5"])  # Qwen3.5: linear-attention states move with the slots too
def test_decode_graphs_read_each_slots_rotary_offset(arch, request, monkeypatch):
    """Decode steps through the graph path (replays of the recorded forward on the CPU) give the outputs of eager
    decoding for a batch mixing image requests (each its own rotary offset) and a text request, while rows
    finish at different steps and the batch compacts (the offsets move with the slots)."""
    from engine_test_utils import replay_graph_forwards

    from slime.backends.embedded_engine.cuda_graphs import _buckets
    from slime.backends.embedded_engine.engine import Engine
    from slime.backends.embedded_engine.io_struct import GenerateRequest, SamplingParams
    from slime.backends.embedded_engine.model_runner import ModelRunner

    tiny_vlm_dir = request.getfixturevalue(VLM_FIXTURES[arch])
    replays = replay_graph_forwards(monkeypatch)
    prompts = [_prompt_ids(tiny_vlm_dir, 1, "count"), _prompt_ids(tiny_vlm_dir, 2, "compare"),
               _prompt_ids(tiny_vlm_dir, 0, "just text")]
    images = [IMAGES[:1], IMAGES, []]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 20, 6)]

    def run(runner, only=None):
        requests = []
        for i, (prompt, pictures) in enumerate(zip(prompts, images)):
            if only is not None and i != only:
                continue
            request = GenerateRequest(rid=f"r{i}", input_ids=list(prompt), params=params[i])
            if pictures:
                request.input_ids, request.vision = runner.vision.prepare(prompt, [encode_image(p) for p in pictures])
            requests.append(request)
        engine = Engine(runner, seed=1)
        engine.start()
        try:
            return [(s.output_ids, s.output_logprobs) for s in _submit(engine, requests)]
        finally:
            engine.stop()

    eager = ModelRunner(tiny_vlm_dir, num_slots=4, cuda_graph=False)
    want = run(eager)
    for i, (ids, logprobs) in enumerate(want):  # batched and compacted = each request alone
        alone_ids, alone_logprobs = run(eager, only=i)[0]
        assert ids == alone_ids and logprobs == pytest.approx(alone_logprobs, abs=1e-5)
    runner = ModelRunner(tiny_vlm_dir, num_slots=4)
    runner.graphs.enabled, runner.graphs.batch_buckets = True, _buckets(4)
    for (ids, logprobs), (want_ids, want_logprobs) in zip(run(runner), want):
        assert ids == want_ids and logprobs == pytest.approx(want_logprobs, abs=1e-5)
    assert len(replays) >= 19 - 1  # the 20-token request's decode steps replayed graphs
    assert sorted(set(runner.vision.rope_deltas.tolist())) != [0]  # image requests had their offsets


def _submit(engine, requests):
    import threading

    seqs, events = [], []
    for request in requests:
        done = threading.Event()
        seqs.append(engine.call(lambda r=request, d=done: engine.add_request(r, lambda s, f, d=d: f and d.set()))
                    .result(10))
        events.append(done)
    for done in events:
        assert done.wait(120)
    return seqs


def test_text_prompt_with_images_is_expanded_like_the_processor(http, hf, model_dir):
    """SGLang's multimodal form (what the default generator sends): ``text`` with one placeholder per image."""
    prompt = _prompt_ids(model_dir, 2, "which has more?")
    text = _tokenizer(model_dir).decode(prompt)
    out = generate(http, text=text, image_data=[encode_image(i) for i in IMAGES], return_logprob=True,
                   sampling_params={"max_new_tokens": 6, "temperature": 0.9, "ignore_eos": True})
    assert out["meta_info"]["prompt_tokens"] == len(prompt) - 2 + 6 + 8
    ref = hf_logprobs(hf, model_dir, prompt, out["output_ids"], IMAGES, 0.9)
    assert [x[0] for x in out["meta_info"]["output_token_logprobs"]][:len(ref)] == pytest.approx(ref, abs=1e-4)
