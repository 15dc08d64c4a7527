"""--sglang-* pass-through against the real ServerArgs of SGLang 0.5.23, --router-* against the real smg.

SGLang's argument code runs in a subprocess (tests/backends/sglang_utils/real_sglang.py) so this
CPU test process keeps seeing no SGLang, as the rest of slime must.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from slime.backends.sglang_utils.launch_plan import PortAllocator, plan_launch, uniform_device_map
from slime.backends.sglang_utils.sglang_config import models_from_args
from slime.arguments import parse_args

from real_sglang import REPO, SGLANG_VERSION, run

pytestmark = pytest.mark.timeout(600)

BASE = ["--rollout-batch-size", "4", "--num-rollout", "2", "--train-backend", "fsdp", "--rollout-backend", "embedded",
        "--hf-checkpoint", "/ckpt/qwen3-4b"]
CASES = {
    "typed": BASE + ["--sglang-mem-fraction-static", "0.7", "--sglang-cuda-graph-bs-decode", "1", "2", "4",
                     "--sglang-context-length", "8192", "--sglang-tool-call-parser", "qwen25",
                     "--sglang-no-dllm-fdfo", "--sglang-data-parallel-size", "2", "--sglang-enable-dp-attention",
                     "--rollout-num-gpus", "16", "--rollout-num-gpus-per-engine", "8"],
    "tp_size": BASE + ["--sglang-tp-size", "2"],
    "model_path": BASE + ["--sglang-model-path", "/x"],
    "typo": BASE + ["--sglang-mem-fraction-statc", "0.7"],
    "bad_float": BASE + ["--sglang-mem-fraction-static", "high"],
    "bad_choice": BASE + ["--sglang-dtype", "float64"],
    "old_list_flag": BASE + ["--sglang-cuda-graph-bs", "1", "2", "4", "8", "--sglang-cuda-graph-max-bs=8"],
    "removed_flag": BASE + ["--sglang-stream-output"],
    "colocated": BASE + ["--colocate", "--actor-num-gpus-per-node", "8", "--rollout-num-gpus-per-engine", "4"],
}


@pytest.fixture(scope="module")
def real():
    result = run(parse=list(CASES.values()))
    return result, dict(zip(CASES, result["parse"]))


def test_pinned_sglang_version(real):
    assert real[0]["sglang_version"] == SGLANG_VERSION


def test_types_defaults_and_list_values_come_from_serverargs(real):
    case = real[1]["typed"]
    assert case["ok"], case.get("error")
    args = case["args"]
    assert args["sglang_mem_fraction_static"] == 0.7 and args["sglang_context_length"] == 8192
    assert args["sglang_cuda_graph_bs_decode"] == [1, 2, 4]
    assert args["sglang_tool_call_parser"] == "qwen25"
    assert args["sglang_dllm_fdfo"] is False  # a --no-<flag> (BooleanOptionalAction) of SGLang
    # defaults are SGLang's own, and only what the user changed is forwarded
    assert args["sglang_dtype"] == "auto" and args["sglang_schedule_policy"] == "fcfs" and args["sglang_log_level"] == "info"
    assert args["sglang_passthrough"] == {"mem-fraction-static": 0.7, "cuda-graph-bs-decode": [1, 2, 4],
                                          "context-length": 8192, "tool-call-parser": "qwen25", "no-dllm-fdfo": True,
                                          "dp-size": 2, "enable-dp-attention": True}
    assert args["sglang_dp_size"] == args["sglang_data_parallel_size"] == 2  # alias kept in sync
    assert args["sglang_tp_size"] == 8  # = --rollout-num-gpus-per-engine / pp size (docs/INTERFACES.md §4.2)
    # slime-owned fields are not pass-through flags
    assert not any(k in args for k in ("sglang_port", "sglang_model_path", "sglang_base_gpu_id",
                                       "sglang_nnodes", "sglang_enable_memory_saver"))
    assert "mem_fraction_static" in args["sglang_server_fields"] and len(args["sglang_server_fields"]) > 400


@pytest.mark.parametrize("case,message", [
    ("tp_size", "--sglang-tp-size is set by slime for every engine, from --rollout-num-gpus-per-engine"),
    ("model_path", "--sglang-model-path is set by slime for every engine, from --hf-checkpoint"),
    ("typo", "unknown flag --sglang-mem-fraction-statc; did you mean --sglang-mem-fraction-static?"),
    ("bad_float", "argument --sglang-mem-fraction-static: invalid float value: 'high'"),
    ("bad_choice", "argument --sglang-dtype: invalid choice: 'float64'"),
    ("removed_flag", "--sglang-stream-output: SGLang removed --stream-output"),
])
def test_bad_flags_fail_with_a_clear_message(real, case, message):
    result = real[1][case]
    assert not result["ok"] and message in result["error"], result


def test_renamed_sglang_flags_map_to_the_new_names(real):
    case = real[1]["old_list_flag"]  # the docs' spelling of SGLang <= 0.5.15
    assert case["ok"], case.get("error")
    assert case["args"]["sglang_passthrough"] == {"cuda-graph-bs-decode": [1, 2, 4, 8], "cuda-graph-max-bs-decode": 8}


def _script_sglang_args(script: Path) -> list[str]:
    """The SGLANG_ARGS array of a shell script, as bash expands it."""
    body = subprocess.run(["sed", "-n", "/^SGLANG_ARGS=(/,/^)/p", str(script)], capture_output=True, text=True).stdout
    done = subprocess.run(["bash", "-c", body + '\nprintf "%s\\n" "${SGLANG_ARGS[@]}"'], capture_output=True, text=True)
    return [line for line in done.stdout.splitlines() if line]


SCRIPTS = sorted(p for p in (REPO / "scripts").glob("run-*.sh") if "SGLANG_ARGS=(" in p.read_text())


def test_example_scripts_sglang_args_parse_with_sglangs_own_parser():
    cases = {script.name: _script_sglang_args(script) for script in SCRIPTS}
    assert cases and all(cases.values()), cases
    base = ["--rollout-batch-size", "4", "--num-rollout", "2", "--train-backend", "fsdp", "--hf-checkpoint",
            "/ckpt/qwen3-4b", "--rollout-num-gpus", "8"]
    # parsed here (no CUDA) as --rollout-backend embedded, the last word; planned as the script's sglang
    parsed = run(parse=[base + tokens + ["--rollout-backend", "embedded"] for tokens in cases.values()])["parse"]
    plans = []
    for name, result in zip(cases, parsed):
        assert result["ok"], (name, result.get("error"))
        args = argparse.Namespace(**result["args"])
        args.rollout_backend = "sglang"
        device_map = uniform_device_map(args.rollout_num_gpus, args.num_gpus_per_node, ["10.0.0.1"])
        plans.append(plan_launch(args, models_from_args(args), device_map, PortAllocator(lambda n, s, c: s)))
    argvs = [p.argv for plan in plans for e in plan.engines for p in e.processes]
    checked = run(server_argv=argvs)["server_argv"]
    assert checked and all(c["ok"] for c in checked), [c.get("error") for c in checked]


def test_launch_plan_command_lines_parse_with_sglangs_own_parser(real):
    plans = []
    for name in ("typed", "colocated"):
        args = argparse.Namespace(**real[1][name]["args"])
        device_map = uniform_device_map(args.rollout_num_gpus, args.num_gpus_per_node, ["10.0.0.1", "10.0.0.2"])
        plans.append(plan_launch(args, models_from_args(args), device_map, PortAllocator(lambda n, s, c: s)))
    processes = [p for plan in plans for e in plan.engines for p in e.processes]
    checked = run(server_argv=[p.argv for p in processes])["server_argv"]
    assert all(c["ok"] for c in checked), [c.get("error") for c in checked]
    typed = checked[0]["fields"]
    assert (typed["tp_size"], typed["dp_size"], typed["nnodes"], typed["base_gpu_id"]) == (8, 2, 1, 0)
    assert typed["cuda_graph_bs_decode"] == [1, 2, 4] and typed["mem_fraction_static"] == 0.7
    assert typed["dllm_fdfo"] is False and typed["skip_server_warmup"] and typed["enable_metrics"]
    assert typed["model_path"] == "/ckpt/qwen3-4b" and typed["port"] == processes[0].server_args["port"]
    second = checked[1]["fields"]
    assert second["host"] == "10.0.0.2" and second["base_gpu_id"] == 0
    colocated = [c["fields"] for c in checked[2:]]
    assert [c["base_gpu_id"] for c in colocated] == [0, 4]
    assert all(c["enable_memory_saver"] and c["tp_size"] == 4 for c in colocated)


# ---------------------------------------------------------------- router flags, against the installed smg

def test_router_flags_from_the_real_smg():
    args = parse_args(BASE + ["--router-policy", "consistent_hashing", "--router-cache-threshold", "0.5",
                              "--router-disable-retries"])
    assert args.router_policy == "consistent_hashing" and args.router_cache_threshold == 0.5
    assert args.router_passthrough == {"policy": "consistent_hashing", "cache-threshold": 0.5, "disable-retries": True,
                                       "balance-abs-threshold": 10, "balance-rel-threshold": 1.2, "log-level": "warn"}
    assert parse_args(BASE).router_policy == "cache_aware"  # the router's own default policy is kept


@pytest.mark.parametrize("extra,message", [
    (["--router-policy", "fastest"], "argument --router-policy: invalid choice: 'fastest'"),
    (["--router-cache-treshold", "0.5"], "did you mean --router-cache-threshold"),
    (["--router-prefill", "http://h:1"], "unknown flag --router-prefill"),  # slime wires prefill/decode itself
])
def test_bad_router_flags(capsys, extra, message):
    with pytest.raises(SystemExit):
        parse_args(BASE + extra)
    assert message in capsys.readouterr().err
