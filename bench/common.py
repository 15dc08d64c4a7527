"""Shared by the benchmarks: the results file (docs/performance.md: one file per benchmark, machine, model and
variant, named by :func:`result_name`; a newer run of the same thing replaces the older file)."""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import sys
import time

from slime.utils.run_info import git_commit, machine_name  # noqa: F401  (the benches import both from here)


# The vendors' HBM bandwidth by GPU name, the roofline's denominator (the first entry whose key the name
# contains): the H200's HBM3e 4.8 TB/s; the H100 SXM's HBM3 3.35 TB/s (H100 NVL 3.9, PCIe 2.0). A GH200 comes in
# two memories its name does not tell apart: assumed, like any GPU not listed.
HBM_BYTES_PER_S = (("GH200", None), ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12))
ASSUMED_HBM_BYTES_PER_S = 4.8e12  # elsewhere (the CPU, an unknown GPU): the H200's, named as assumed


def hbm_peak(device_name: str | None = None) -> tuple[float, str]:
    """``(bytes per second, what that is the spec of)`` for this process's GPU 0 (or ``device_name``): the
    roofline every benchmark's ``*hbm_fraction`` / ``roofline_fraction`` divides by, recorded in its config."""
    import torch

    if device_name is None and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(0)
    peak = next((peak for key, peak in HBM_BYTES_PER_S if device_name and key in device_name), None)
    if peak is None:
        return ASSUMED_HBM_BYTES_PER_S, f"H200 (assumed; this is {device_name or 'no GPU'})"
    return peak, device_name


def hbm_peak_config() -> dict:
    """The config fields that say which roofline a result divides by (:func:`hbm_peak`)."""
    peak, of = hbm_peak()
    return {"hbm_peak_bytes_per_s": peak, "hbm_peak_of": of}


def _model_name(model) -> str:
    """``qwen3-4b`` from ``qwen3-4b``, ``/ckpt/Qwen3-4B`` or ``"qwen3-4b architecture, random bf16 weights"``; a list
    of Qwen3 sizes becomes ``qwen3`` (the benchmark covers the family's shapes)."""
    if isinstance(model, dict):
        model = sorted(model)
    if isinstance(model, str):
        model = model.split(" architecture")[0].split(" (")[0]
    if isinstance(model, str) and "," in model:
        model = model.split(",")
    if isinstance(model, (list, tuple)):
        names = sorted({_model_name(m) for m in model})
        if len(names) > 1 and all(name.startswith("qwen3-") for name in names):
            return "qwen3"
        return "-".join(names)
    if not model:
        return "model"
    return os.path.basename(model.rstrip("/")).lower()


def _weights(config: dict) -> list[str]:
    quantization, backend = config.get("quantization"), config.get("fp8_gemm_backend")
    return [quantization or "bf16"] + ([backend] if quantization and backend and backend != "auto" else [])


def _fp8_kv(config: dict) -> list[str]:
    kv = str(config.get("kv_cache_dtype") or "")
    return ["fp8kv"] if "float8" in kv or kv.startswith("fp8") else []


def result_name(benchmark: str, machine: str, config: dict) -> str:
    """``<bench>-<machine>-<model>[-<variant>]``: the variant names every flag that sets this run apart from the
    benchmark's default (weight format, FP8 KV cache, shape, fusions turned off, ...); dates and commits stay
    inside the file, so a newer run of the same variant replaces the older file."""
    c = config
    model = c.get("model", c.get("models"))
    if model is None and c.get("runs"):  # weight_sync: "qwen3-0.6b/tensor", ...
        model = [run.split("/")[0] for run in c["runs"]]
    if model is None and c.get("hidden") and c.get("vocab"):  # logprob_head: the head's shape
        model = f"head{c['hidden']}x{c['vocab']}"
    model = _model_name(model)
    tokens: list[str] = []
    if benchmark == "decode_step":
        tokens += _weights(c) + _fp8_kv(c) + [f"b{c.get('batch')}-p{c.get('position')}"]
        tokens += [f"sample-{c['sample']}"] if c.get("sample") not in (None, "none") else []
        tokens += [f"without-{name}" for name in c.get("without") or []] + [f"with-{name}" for name in c.get("with") or []]
        tokens += [f"block{c['attention_block_n']}"] if c.get("attention_block_n") else []
        tokens += [f"verify{c['verify_tokens']}"] if (c.get("verify_tokens") or 1) > 1 else []
        tokens += ["eager"] if c.get("verify_eager") else []
    elif benchmark == "engine_decode":
        tokens += _weights(c) + _fp8_kv(c)
        tokens += [f"b{c['num_requests']}"] if c.get("num_requests", 128) != 128 else []
        shape = (c.get("prompt_len", 16), c.get("output_len", 256))
        tokens += [f"{shape[0]}in-{shape[1]}out"] if shape != (16, 256) else []
        tokens += ["logprob-gap"] if c.get("logprob_gap_requests") else []
        tokens += [f"img{c['images_per_request']}x{c['image_size']}"] if c.get("images_per_request") else []
    elif benchmark == "e2e_grpo":
        tokens.append(f"{c['prompts'] * c['n_samples_per_prompt']}x{c['max_new_tokens']}")
        tokens += [f"{c['side']}-only"] if c.get("side", "both") != "both" else []
        if c.get("task") == "vlm-shapes":  # the pictures' side where the model sees them, "text" where it does not
            tokens.append("shapes-" + (f"img{c['image_size']}" if c.get("images_per_prompt") else "text"))
        extra = "-".join(flag.lstrip("-") for flag in c.get("slime_extra") or [])
        for long, short in (("sglang-", ""), ("quantization-", ""), ("fp8-gemm-backend-", ""), ("use-tis", "tis"),
                            ("mem-fraction-static", "memfrac")):
            extra = extra.replace(long, short)
        tokens += [extra] if extra else []
    elif benchmark == "spec_decode":
        tokens.append(f"b{c.get('num_requests')}")
        tokens += [engine for engine in c.get("engines", []) if engine not in ("off", "ngram")]
    elif benchmark == "decode_attention":
        tokens.append("b" + str(c.get("batch")).replace(",", "-"))
        tokens += ["sweep"] if c.get("sweep") else []
        tokens.append("kv-" + str(c.get("kv_dtypes")).replace(",", "-").replace("fp8_e4m3", "fp8"))
        tokens += [f"dots-{c['fp8_dots']}"] if c.get("fp8_dots") else []
        tokens += ["p" + str(c["positions"]).replace(",", "-")] if c.get("positions", "143,511,2047") != "143,511,2047" else []
    elif benchmark == "fp8_gemm":
        tokens += [f"{c['sweep']}-sweep"] if c.get("sweep") else []
        tokens += ["rowwise"] if c.get("rowwise") else []
    elif benchmark == "train_step":
        tokens.append({"slime_varlen": "varlen"}.get(c.get("attn_implementation"), c.get("attn_implementation")))
        tokens += ["compile"] if c.get("fsdp_compile") else []
        tokens += ["profiled"] if c.get("profile") else []
    elif benchmark == "megatron_train_step":
        tokens.append("long" if (c.get("sample_len") or [0])[0] > 10000 else "packed")
        flags = c.get("megatron_flags", "")
        tokens += ["cp" + flags.split()[-1]] if "--context-parallel-size" in flags else []
    elif benchmark == "delta_sync" and isinstance(c.get("models"), dict):
        rates = sorted({entry.get("lr") for entry in c["models"].values() if entry.get("lr") not in (None, 1e-6)})
        tokens += [f"lr{rate:g}" for rate in rates]
    elif benchmark == "true_on_policy_cost":
        tokens += [{"bfloat16": "bf16", "float32": "fp32"}.get(c.get("dtype"), c.get("dtype")),
                   f"{c.get('requests')}x{c.get('new_tokens')}"]
    elif benchmark == "weight_sync":
        tokens += ["pipelined"] if isinstance(c.get("bucket_mb"), list) else []
    name = "-".join([benchmark, machine, model] + [token for token in tokens if token])
    return re.sub(r"[^A-Za-z0-9._+-]", "_", name)


def write_result(benchmark: str, config: dict, metrics: dict, out: str | None, echo: bool = True,
                 extra: dict | None = None) -> dict:
    """The results file (``echo``: printed too; a long bench writes its partial results quietly as it goes).
    ``out`` is a ``.json`` path or a folder, where the file is named by :func:`result_name`; ``extra``: more
    top-level fields beside ``metrics`` (e.g. per-step curves, which are not flat numbers)."""
    today = datetime.date.today()
    argv = list(sys.argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if argv and os.path.isabs(argv[0]) and argv[0].startswith(root + os.sep):  # `python -m bench.x`: the module
        module = os.path.relpath(argv[0], root)
        argv[0] = "-m " + module[:-3].replace(os.sep, ".") if module.endswith(".py") else module
    result = {"benchmark": benchmark, "date": today.isoformat(), "machine": machine_name(),
              "command": "python " + " ".join(argv), "git_commit": git_commit(), "config": config, "metrics": metrics,
              **(extra or {})}
    if echo:
        print(json.dumps(result, indent=2))
    if out:
        path = out if out.endswith(".json") else os.path.join(out, result_name(benchmark, result["machine"], config) + ".json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return result


def time_us(calls, device, repeats: int) -> float:
    """Median microseconds of one of ``calls`` (a list of closures, each on its own copy of the data it
    reads, so that together they come from HBM and not from L2): on CUDA one graph of all of them replayed
    between events, elsewhere their wall time. The first round is a warm-up (compiles, allocations)."""
    import torch

    for call in calls:
        call()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for call in calls:
                call()
            times.append((time.perf_counter() - start) / len(calls) * 1e6)
        return statistics.median(times)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(times)
