"""Images through the agent adapters (a tiny Qwen2.5-VL behind the embedded engine): OpenAI ``image_url`` and
Anthropic ``image`` blocks, in user messages and in tool results (an environment answering with a picture),
reach the engine as images and the trajectory exactly: the sample holds the processor-expanded prompt,
the images' trainer inputs and the engine's log-probs of what it sampled."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import pytest
from PIL import Image, ImageDraw

from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter
from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.utils.multimodal import encode_image, load_image, process_images
from slime.utils.processing_utils import load_processor
from slime.utils.types import Sample

pytestmark = pytest.mark.timeout(300)
GREEDY = {"temperature": 0.0, "max_new_tokens": 5}


def _picture(size, boxes) -> Image.Image:
    image = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for k in range(boxes):
        draw.rectangle([3 + 12 * k, 4, 12 + 12 * k, 13], fill=(180, 30 * k, 40))
    return image


def _png_base64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def vlm_engine(tiny_vlm_dir):
    from slime.backends.embedded_engine.serving.launch import running_engine

    with running_engine(tiny_vlm_dir, extra_args=["--context-length", "512"]) as proc:
        yield proc


@pytest.fixture
def serve(tiny_vlm_dir, vlm_engine):
    from transformers import AutoTokenizer

    handles = []

    def start(cls):
        adapter = cls(tokenizer=AutoTokenizer.from_pretrained(tiny_vlm_dir), sglang_url=vlm_engine.url)
        handle = run_app_in_thread(adapter.app, host="127.0.0.1")
        handles.append(handle)
        return adapter, handle

    yield start
    for handle in handles:
        handle.stop()


def _engine_turn(engine, ids, images):
    out = httpx.post(f"{engine.url}/generate", timeout=60, json={
        "input_ids": ids, "image_data": [encode_image(i) for i in images], "return_logprob": True,
        "sampling_params": {**GREEDY, "skip_special_tokens": False, "no_stop_trim": True}}).json()
    return [t[1] for t in out["meta_info"]["output_token_logprobs"]], [t[0] for t in out["meta_info"]["output_token_logprobs"]]


def _check_last_turn(sample, tiny_vlm_dir, engine, messages, images):
    """The sample ends with the last turn exactly: its expanded prompt, then the engine's greedy reply."""
    processor = load_processor(tiny_vlm_dir)
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids, train_inputs = process_images(processor, text, images)
    output, log_probs = _engine_turn(engine, ids, images)
    assert sample.tokens == ids + output
    assert sample.rollout_log_probs[-len(output):] == pytest.approx(log_probs, abs=1e-5)
    assert sample.loss_mask[-len(output):] == [1] * len(output)
    assert sample.multimodal_train_inputs["image_grid_thw"].tolist() == train_inputs["image_grid_thw"].tolist()
    assert sample.multimodal_train_inputs["pixel_values"].equal(train_inputs["pixel_values"])
    assert len(sample.multimodal_inputs["images"]) == len(images)


def test_openai_image_in_the_question_and_in_a_tool_result(serve, tiny_vlm_dir, vlm_engine):
    adapter, handle = serve(OpenAIAdapter)
    adapter.open_session("vision-1", sampling_defaults=GREEDY)
    question, observation = _picture((56, 84), 2), _picture((84, 56), 3)
    url = "data:image/png;base64," + _png_base64(question)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "How many boxes?"}]}]
    headers = {"Authorization": "Bearer vision-1"}
    first = httpx.post(f"{handle.url}/v1/chat/completions", json={"model": "p", "messages": messages},
                       headers=headers, timeout=60)
    assert first.status_code == 200, first.text
    reply = first.json()["choices"][0]["message"]
    tool_image = "data:image/png;base64," + _png_base64(observation)
    messages += [{"role": "assistant", "content": reply["content"] or ""},
                 {"role": "tool", "tool_call_id": "call_0", "content": [
                     {"type": "text", "text": "zoomed:"}, {"type": "image_url", "image_url": {"url": tool_image}}]}]
    second = httpx.post(f"{handle.url}/v1/chat/completions", json={"model": "p", "messages": messages},
                        headers=headers, timeout=60)
    assert second.status_code == 200, second.text
    samples = asyncio.run(adapter.finish_session("vision-1", base_sample=Sample(index=3), reward=1.0))
    canonical = [{"role": "user", "content": [{"type": "image", "image": url}, {"type": "text", "text": "How many boxes?"}]},
                 {"role": "assistant", "content": reply["content"] or ""},
                 {"role": "tool", "content": [{"type": "text", "text": "zoomed:"}, {"type": "image", "image": tool_image}]}]
    _check_last_turn(samples[-1], tiny_vlm_dir, vlm_engine, canonical, [question, observation])


def test_anthropic_image_blocks(serve, tiny_vlm_dir, vlm_engine):
    adapter, handle = serve(AnthropicAdapter)
    adapter.open_session("vision-2", sampling_defaults=GREEDY)
    picture = _picture((56, 56), 1)
    data = _png_base64(picture)
    messages = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": "Count them."}]}]
    response = httpx.post(f"{handle.url}/v1/messages", json={"model": "p", "max_tokens": 5, "messages": messages},
                          headers={"x-api-key": "vision-2", "Authorization": "Bearer vision-2"}, timeout=60)
    assert response.status_code == 200, response.text
    [sample] = asyncio.run(adapter.finish_session("vision-2", base_sample=Sample(index=4), reward=1.0))
    canonical = [{"role": "user", "content": [{"type": "image", "image": f"data:image/png;base64,{data}"},
                                              {"type": "text", "text": "Count them."}]}]
    _check_last_turn(sample, tiny_vlm_dir, vlm_engine, canonical, [load_image(f"data:image/png;base64,{data}")])


def test_a_remote_image_is_refused_with_the_reason(serve):
    adapter, handle = serve(OpenAIAdapter)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    response = httpx.post(f"{handle.url}/v1/chat/completions", json={"model": "p", "messages": messages}, timeout=60)
    assert response.status_code == 400 and "remote image URLs are not fetched" in response.text
