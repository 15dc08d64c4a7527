"""The FSDP trainer on a vision-language model (tiny random fp32 Qwen2.5-VL, Qwen3-VL and Qwen3.5, the latter two
dense and MoE; CPU, gloo): log-probs of micro-batches carrying pixel values and image grids equal transformers'
model and the engine's (Qwen3.5: its linear-attention layers restart at every sample of a packed row);
--freeze-vision-tower keeps the vision tower fixed while the language model trains."""

import pytest
import torch
from PIL import Image, ImageDraw

from slime.backends.training.backend import ModelOutput
from slime.backends.training.worker import TrainWorker
from slime.utils.multimodal import process_images
from slime.utils.processing_utils import load_processor
from slime.utils.types import Sample
from tests.backends.fsdp_utils.fsdp_test_utils import make_args, rank_data, regrouped

pytestmark = pytest.mark.usefixtures("single_rank")


#: architecture -> the conftest fixture building its tiny checkpoint
VLM_FIXTURES = {"qwen2_5_vl": "tiny_vlm_dir", "qwen3_vl": "tiny_qwen3_vl_dir", "qwen3_vl_moe": "tiny_qwen3_vl_moe_dir",
                "qwen3_5": "tiny_qwen3_5_vl_dir", "qwen3_5_moe": "tiny_qwen3_5_moe_vl_dir"}


@pytest.fixture(scope="module", params=list(VLM_FIXTURES))
def model_dir(request):
    return request.getfixturevalue(VLM_FIXTURES[request.param])


def _picture(size, shapes):
    image = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for k in range(shapes):
        draw.rectangle([3 + 11 * k, 5, 11 + 11 * k, 13], fill=(40 * k, 90, 200))
    return image


def vlm_samples(model_dir, seed=0) -> tuple[list[Sample], list[list]]:
    """Four samples: one image, two images, no image, one image with a response that samples the placeholder."""
    processor = load_processor(model_dir)
    tokenizer = processor.tokenizer
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    g = torch.Generator().manual_seed(seed)
    specs = [[_picture((56, 84), 2)], [_picture((56, 56), 1), _picture((112, 56), 3)], [], [_picture((84, 56), 4)]]
    samples = []
    for i, images in enumerate(specs):
        parts = [{"type": "image"}] * len(images) + [{"type": "text", "text": f"how many boxes {i}?"}]
        text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                             add_generation_prompt=True)
        ids, train_inputs = process_images(processor, text, images)
        response = torch.randint(10, 500, (5,), generator=g).tolist()
        if i == 3:
            response[2] = pad  # sampled as text by the engine: it stays text in training
        samples.append(Sample(index=i, group_index=i // 2, tokens=ids + response, response_length=5, reward=float(i % 2),
                              status=Sample.Status.COMPLETED, rollout_log_probs=[-1.0] * 5,
                              multimodal_train_inputs=train_inputs if images else None))
    return samples, specs


@torch.no_grad()
def hf_log_probs(hf, sample: Sample, images: list, temperature: float) -> torch.Tensor:
    tokens = torch.tensor([sample.tokens])
    kwargs = {}
    if images:
        inputs = sample.multimodal_train_inputs
        kwargs = dict(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                      mm_token_type_ids=(tokens == hf.config.image_token_id).int())
    logits = hf(input_ids=tokens, **kwargs).logits[0].float() / temperature
    r = sample.response_length
    return torch.log_softmax(logits, -1)[torch.arange(len(sample.tokens) - r - 1, len(sample.tokens) - 1),
                                         tokens[0, -r:]]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])  # padded rows / one packed row with a block mask
def test_log_probs_equal_hf(model_dir, attention):
    from transformers import AutoModelForImageTextToText

    args = make_args(model_dir, "--num-steps-per-rollout", "1", "--rollout-temperature", "0.7",
                     "--fsdp-attn-implementation", attention, rbs=2)
    worker = TrainWorker(args)
    worker.init()
    samples, images = vlm_samples(model_dir)
    data = rank_data(args, samples)
    order = [data.sample_indices.index(i) for i in range(4)]
    together, _ = worker.backend.forward_only("model", regrouped(data, [list(range(4))]), ModelOutput("log_probs"))
    alone, _ = worker.backend.forward_only("model", regrouped(data, [[i] for i in range(4)]), ModelOutput("log_probs"))
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i in range(3):  # HF's own forward would take the response's sampled placeholder for an image slot
        torch.testing.assert_close(together[order[i]], hf_log_probs(hf, samples[i], images[i], 0.7), atol=1e-5, rtol=0)
    for i in range(4):
        torch.testing.assert_close(together[order[i]], alone[order[i]], atol=1e-5, rtol=0)


def test_log_probs_equal_the_engines(model_dir):
    """The engine's prefill + decode of the same tokens and images, against the trainer's packed forward."""
    from slime.backends.embedded_engine.model_runner import ForwardRow, ModelRunner
    from slime.utils.multimodal import encode_image

    args = make_args(model_dir, "--num-steps-per-rollout", "1", rbs=2)
    worker = TrainWorker(args)
    worker.init()
    samples, images = vlm_samples(model_dir, seed=1)
    data = rank_data(args, samples)
    trainer, _ = worker.backend.forward_only("model", data, ModelOutput("log_probs"))
    runner = ModelRunner(model_dir, num_slots=2, slot_capacity=128)
    for i, sample in enumerate(samples):
        prompt = sample.tokens[:-sample.response_length]
        vision = None
        if images[i]:
            prompt, vision = runner.vision.prepare(prompt, [encode_image(image) for image in images[i]])
        assert prompt == sample.tokens[:-sample.response_length]
        last, _ = runner.forward([0], [ForwardRow(prompt, 0, vision=vision)])
        engine = []
        for k, token in enumerate(sample.tokens[-sample.response_length:]):
            engine.append(float(torch.log_softmax(last[0], -1)[token]))
            last = runner.decode([token], [len(prompt) + k])
        torch.testing.assert_close(trainer[data.sample_indices.index(i)], torch.tensor(engine), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_5"])
def test_freeze_vision_tower_and_hf_export(arch, request, tmp_path):
    tiny_vlm_dir = request.getfixturevalue(VLM_FIXTURES[arch])
    for flag, vision_moves in ((("--freeze-vision-tower",), False), ((), True)):
        args = make_args(tiny_vlm_dir, "--num-steps-per-rollout", "1", "--lr", "1e-2", *flag, rbs=2)
        worker = TrainWorker(args)
        worker.init()
        model = worker.backend.model
        before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        worker.train(0, rank_data(args, vlm_samples(tiny_vlm_dir)[0]))
        moved = {k for k, v in model.state_dict().items() if not torch.equal(v.full_tensor(), before[k])}
        assert any(k.startswith("model.language_model.") for k in moved)
        assert any(k.startswith("model.visual.") for k in moved) == vision_moves, flag
        if arch == "qwen3_5":  # the gated-DeltaNet layers train too
            assert any(".linear_attn." in k for k in moved)
    # the exported checkpoint serves again: trained vision tower, image processor and chat template included
    from transformers import AutoModelForImageTextToText

    worker.save_hf(str(tmp_path / "hf"))
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    trained = {k: v.full_tensor() for k, v in model.state_dict().items()}
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    assert load_processor(str(tmp_path / "hf")) is not None
