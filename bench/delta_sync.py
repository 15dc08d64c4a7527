"""Delta weight sync on a real RL update: how many bf16 elements change, how many bytes go on the
wire, and how fast one CPU core encodes and applies the delta.

Prints JSON (and writes bench/results/delta_sync-<machine>-<model>.json with --out bench/results).

    python bench/delta_sync.py --models tiny qwen3-0.5b --out bench/results

For each model: the weights are held in fp32 (as a trainer's master weights) starting from the bf16
checkpoint, and trained by ``--steps`` GRPO steps: sample a group of responses per random prompt
from the model itself, reward 1 when the first response token is even, group-normalised advantages,
loss ``-mean(A * log pi(response))``, one AdamW step per rollout. After every step the bf16 export is
diffed against the previous one (one sync per step, as in the loop). Per encoding (xor, overwrite):

* ``changed_fraction``: bf16 elements whose bytes changed / all elements;
* ``wire_fraction``: compressed delta bytes / bf16 checkpoint bytes;
* ``encode_gbytes_per_s``: checkpoint bytes / (encode + xxh3-128 checksum time), one thread;
* ``apply_gbytes_per_s``: checkpoint bytes / (decompress + apply + checksum verify time), one thread;
* ``*_fraction_of_memcpy``: those rates over one thread's memcpy bandwidth measured in the same run.

Metrics are flat: ``<model>/<encoding>/<metric>``.

With ``--files DIR`` the last sync also goes through the real files: the trainer-side writer publishes
it under DIR (safetensors payloads + index) and ``pull_weights`` applies it to a host checkpoint
seeded from the previous export (``publish_seconds``, ``pull_seconds``: whole calls, default thread
pools, including reading and writing every local shard).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import write_result  # noqa: E402
from slime.backends.update_weight import delta  # noqa: E402
from slime.backends.update_weight.weight_files import tensor_bytes  # noqa: E402

# ~0.5B parameters: the Qwen3-0.6B shape with 24 layers (random weights, real vocabulary size)
QWEN3_05B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)


def memcpy_gbytes_per_s(nbytes: int = 1 << 28) -> float:
    """One thread copying a buffer much larger than the caches (bytes copied per second)."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def build_model(name: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if name == "tiny":
        import tempfile

        from slime.utils.tiny_model import build_tiny_model
        from transformers import AutoModelForCausalLM

        with tempfile.TemporaryDirectory() as root:
            model = AutoModelForCausalLM.from_pretrained(build_tiny_model(root, size="tiny", seed=0))
        return model.to(torch.bfloat16).float()
    if name != "qwen3-0.5b":
        raise ValueError(f"unknown model {name!r}; choose tiny or qwen3-0.5b")
    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_05B, max_position_embeddings=4096, rms_norm_eps=1e-6)
    return Qwen3ForCausalLM(config).to(torch.bfloat16).float()  # bf16 checkpoint, fp32 master weights


def bf16_export(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(torch.bfloat16).contiguous() for name, p in model.state_dict().items()
            if name != "lm_head.weight" or not model.config.tie_word_embeddings}


def grpo_step(model, optimizer, generator, num_prompts: int, group: int, prompt_len: int, response_len: int) -> float:
    vocab = model.config.vocab_size
    prompts = torch.randint(10, vocab, (num_prompts, prompt_len), generator=generator).repeat_interleave(group, 0)
    model.eval()
    with torch.no_grad():
        sequences = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=response_len,
                                   min_new_tokens=response_len, do_sample=True, temperature=1.0, top_k=0,
                                   pad_token_id=0, eos_token_id=None)
    responses = sequences[:, prompt_len:]
    rewards = (responses[:, 0] % 2 == 0).float().view(num_prompts, group)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
    model.train()
    logits = model(sequences).logits[:, prompt_len - 1:-1].float()
    log_probs = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    loss = -(advantages.unsqueeze(1) * log_probs).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return rewards.mean().item()


def measure(before: dict, after: dict, encoding: str, checksum: str = "xxh3-128") -> dict:
    warm = torch.arange(4096, dtype=torch.int16).view(torch.uint8).numpy()  # imports, zstd contexts: not timed
    delta.apply(encoding, warm.copy(), delta.encode(encoding, warm, warm, 2), 2)
    delta.checksum(warm, checksum)
    total_bytes = changed = elements = wire = 0
    encode_s = apply_s = 0.0
    for name, new_tensor in after.items():
        old, new = tensor_bytes(before[name]).copy(), tensor_bytes(new_tensor)
        itemsize = new_tensor.element_size()
        changed += int((before[name].view(torch.int16) != new_tensor.view(torch.int16)).sum())
        elements += new_tensor.numel()
        total_bytes += new.nbytes
        start = time.perf_counter()
        payload = delta.encode(encoding, new, old, itemsize)
        digest = delta.checksum(new, checksum)
        encode_s += time.perf_counter() - start
        wire += len(payload)
        start = time.perf_counter()
        delta.apply(encoding, old, payload, itemsize)
        ok = delta.checksum(old, checksum) == digest
        apply_s += time.perf_counter() - start
        if not ok:
            raise AssertionError(f"{encoding}: {name} did not round-trip")
    return {"changed_fraction": changed / elements, "wire_fraction": wire / total_bytes,
            "encode_gbytes_per_s": total_bytes / encode_s / 1e9, "apply_gbytes_per_s": total_bytes / apply_s / 1e9,
            "checkpoint_bytes": total_bytes, "wire_bytes": wire}


def measure_files(before: dict, after: dict, encoding: str, root: str) -> dict:
    """Publish ``after`` as a delta on ``before`` and pull it into a host checkpoint, on real files."""
    import shutil

    from safetensors.torch import save_file

    from slime.backends.update_weight.disk import DiskWeightUpdater
    from slime.backends.update_weight.pull import pull_weights
    from slime.utils.arguments_groups import flag_defaults

    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(os.path.join(root, "hf"))
    save_file(before, os.path.join(root, "hf", "model.safetensors"), metadata={"format": "pt"})
    args = flag_defaults(update_weight_mode="delta", update_weight_disk_dir=os.path.join(root, "published"),
                         hf_checkpoint=os.path.join(root, "hf"), update_weight_delta_encoding=encoding,
                         update_weight_delta_checksum="xxh3-128", update_weight_disk_keep_files=True,
                         update_weight_local_checkpoint_dir=None, custom_update_weight_post_write_path=None)
    updater = DiskWeightUpdater(args, [])  # no engines: publish only
    local = os.path.join(root, "host")
    try:
        updater.update([list(before.items())], "0")  # an empty delta; the host seeds from its HF copy
        pull_weights(local, args.update_weight_disk_dir, 0, base_checkpoint=args.hf_checkpoint)
        start = time.perf_counter()
        wire = updater.update([list(after.items())], "1")
        publish_s = time.perf_counter() - start
        start = time.perf_counter()
        pull_weights(local, args.update_weight_disk_dir, 1)
        pull_s = time.perf_counter() - start
    finally:
        updater.close()
        shutil.rmtree(root, ignore_errors=True)
    return {"publish_seconds": publish_s, "pull_seconds": pull_s, "published_bytes": wire}


def run_model(name: str, args) -> dict:
    torch.manual_seed(args.seed)
    model = build_model(name)
    lr = args.tiny_lr if name == "tiny" else args.lr
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    results = {"parameters": sum(p.numel() for p in model.parameters()), "lr": lr, "syncs": []}
    previous = bf16_export(model)
    for step in range(args.steps):
        start = time.perf_counter()
        reward = grpo_step(model, optimizer, generator, args.prompts, args.group, args.prompt_len, args.response_len)
        current = bf16_export(model)
        sync = {"step": step, "reward_mean": reward, "train_seconds": time.perf_counter() - start}
        for encoding in delta.ENCODINGS:
            sync[encoding] = measure(previous, current, encoding)
        if args.files and step == args.steps - 1:
            for encoding in delta.ENCODINGS:
                sync[encoding]["files"] = measure_files(previous, current, encoding, os.path.join(args.files, name))
        results["syncs"].append(sync)
        print(f"{name} step {step}: {sync}", file=sys.stderr, flush=True)
        previous = current
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "qwen3-0.5b"])
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps (one sync measured after each)")
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW lr for the 0.5B model")
    parser.add_argument("--tiny-lr", type=float, default=1e-6, help="AdamW lr for the tiny model")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--response-len", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads for training (default: torch's)")
    parser.add_argument("--files", default=None, help="also publish and pull the last sync through files here")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    per_model = {name: run_model(name, args) for name in args.models}
    memcpy = memcpy_gbytes_per_s()
    metrics = {"memcpy_gbytes_per_s": memcpy}
    for name, result in per_model.items():
        for encoding in delta.ENCODINGS:
            syncs = [s[encoding] for s in result["syncs"]]
            nbytes = sum(s["checkpoint_bytes"] for s in syncs)
            prefix = f"{name}/{encoding}/"
            metrics[prefix + "changed_fraction"] = sum(s["changed_fraction"] for s in syncs) / len(syncs)
            metrics[prefix + "wire_fraction"] = sum(s["wire_bytes"] for s in syncs) / nbytes
            for kind in ("encode", "apply"):
                rate = nbytes / sum(s["checkpoint_bytes"] / s[f"{kind}_gbytes_per_s"] for s in syncs)
                metrics[prefix + f"{kind}_gbytes_per_s"] = rate
                metrics[prefix + f"{kind}_fraction_of_memcpy"] = rate / memcpy
            if "files" in syncs[-1]:
                files = syncs[-1]["files"]
                metrics[prefix + "publish_gbytes_per_s"] = syncs[-1]["checkpoint_bytes"] / files["publish_seconds"] / 1e9
                metrics[prefix + "pull_gbytes_per_s"] = syncs[-1]["checkpoint_bytes"] / files["pull_seconds"] / 1e9
    config = {
        "procedure": "bf16 checkpoint -> fp32 master weights; per step: sample a group of responses per random prompt "
                     "from the model (temperature 1), reward = first response token even, group-normalised advantages, "
                     "loss -mean(A * log pi), one AdamW step (betas 0.9/0.98, no weight decay); the bf16 export after "
                     "each step is diffed against the previous export (one sync per step)",
        "models": {name: {"parameters": r["parameters"], "lr": r["lr"]} for name, r in per_model.items()},
        "steps": args.steps, "prompts": args.prompts, "group": args.group, "prompt_len": args.prompt_len,
        "response_len": args.response_len, "checksum": "xxh3-128", "zstd_level": delta.ZSTD_LEVEL,
        "threads_for_codec": 1, "per_sync": {name: r["syncs"] for name, r in per_model.items()},
    }
    write_result("delta_sync", config, metrics, args.out)


if __name__ == "__main__":
    main()
