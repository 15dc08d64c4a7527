"""Launch plans: GPU ids, ports, ranks and nnodes of every SGLang process for typical layouts."""

from __future__ import annotations

import pytest

from slime.backends.sglang_utils.launch_plan import PortAllocator, plan_launch, uniform_device_map
from slime.backends.sglang_utils.sglang_config import ModelConfig, ServerGroup, models_from_args
from slime.arguments import parse_args

BASE = ["--rollout-batch-size", "4", "--num-rollout", "2", "--train-backend", "fsdp", "--rollout-backend", "embedded",
        "--hf-checkpoint", "/ckpt/qwen3-4b"]
NODES = ["10.0.0.1", "10.0.0.2"]


def args_of(*extra):
    return parse_args(BASE + [str(x) for x in extra])


def ports():
    return PortAllocator(lambda node, start, count: start, base_port=20000)  # every port free: deterministic


def plan(args, device_map=None, models=None):
    device_map = device_map or uniform_device_map(args.rollout_num_gpus, args.num_gpus_per_node, NODES)
    return plan_launch(args, models or models_from_args(args), device_map, ports())


def fields(engine, rank=0):
    return engine.processes[rank].server_args


def test_one_node_of_eight_gpus_two_per_engine():
    args = args_of("--rollout-num-gpus", 8, "--rollout-num-gpus-per-engine", 2, "--seed", 7)
    engines = plan(args).engines
    assert len(engines) == 4
    assert [fields(e)["base_gpu_id"] for e in engines] == [0, 2, 4, 6]
    assert [e.processes[0].gpu_ids for e in engines] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(fields(e)["tp_size"] == 2 and fields(e)["nnodes"] == 1 and fields(e)["node_rank"] == 0 for e in engines)
    assert {e.host for e in engines} == {"10.0.0.1"}
    # every port handed out once on the node: http, nccl and the distributed-init block never overlap
    used = []
    for e in engines:
        dist_port = int(fields(e)["dist_init_addr"].rsplit(":", 1)[1])
        used += [e.port, fields(e)["nccl_port"], *range(dist_port, dist_port + 31)]
    assert len(used) == len(set(used))
    assert [fields(e)["random_seed"] for e in engines] == [7, 15, 23, 31]  # seed + rank x GPUs per node
    argv = engines[1].processes[0].argv
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--model-path") + 1] == "/ckpt/qwen3-4b" and argv[argv.index("--base-gpu-id") + 1] == "2"
    assert "--skip-server-warmup" in argv and "--trust-remote-code" in argv and "--enable-memory-saver" not in argv
    assert engines[0].registration() == {"url": f"http://10.0.0.1:{engines[0].port}", "worker_type": "regular"}


def test_two_nodes_one_sixteen_gpu_engine():
    args = args_of("--rollout-num-gpus", 16, "--rollout-num-gpus-per-engine", 16)
    (engine,) = plan(args).engines
    assert engine.nnodes == 2 and engine.url.startswith("http://10.0.0.1:")
    node0, node1 = engine.processes
    assert (node0.node_ip, node1.node_ip) == ("10.0.0.1", "10.0.0.2")
    assert [p.server_args["node_rank"] for p in engine.processes] == [0, 1]
    assert all(p.server_args["nnodes"] == 2 and p.server_args["tp_size"] == 16 for p in engine.processes)
    assert all(p.server_args["base_gpu_id"] == 0 and p.gpu_ids == list(range(8)) for p in engine.processes)
    # both processes rendezvous at the first node's init address
    assert node0.server_args["dist_init_addr"] == node1.server_args["dist_init_addr"]
    assert node0.server_args["dist_init_addr"].startswith("10.0.0.1:")
    assert [p.rollout_gpu_index for p in engine.processes] == [0, 8]


def test_two_nodes_of_eight_gpu_engines_and_pipeline_parallel():
    args = args_of("--rollout-num-gpus", 16, "--rollout-num-gpus-per-engine", 8, "--sglang-pp-size", 2)
    engines = plan(args).engines
    assert [e.host for e in engines] == NODES
    assert all(fields(e)["tp_size"] == 4 and fields(e)["pp_size"] == 2 and e.nnodes == 1 for e in engines)


def test_colocated_engines_release_memory():
    args = args_of("--colocate", "--actor-num-gpus-per-node", 8, "--rollout-num-gpus-per-engine", 4,
                   "--sglang-mem-fraction-static", 0.6)
    engines = plan(args).engines
    assert len(engines) == 2  # --rollout-num-gpus defaults to the actor's 8 GPUs
    for e in engines:
        assert fields(e)["enable_memory_saver"] is True and fields(e)["cuda_graph_backend_prefill"] == "disabled"
        assert fields(e)["mem_fraction_static"] == 0.6
        assert "--enable-memory-saver" in e.processes[0].argv


def test_disaggregated_rollout_gpus_after_the_trainer_on_a_node():
    args = args_of("--actor-num-gpus-per-node", 4, "--rollout-num-gpus", 4, "--rollout-num-gpus-per-engine", 2)
    device_map = uniform_device_map(4, 8, NODES, first_gpu=4)  # GPUs 0-3 train, 4-7 generate
    engines = plan(args, device_map).engines
    assert [fields(e)["base_gpu_id"] for e in engines] == [4, 6]
    assert all("enable_memory_saver" not in fields(e) for e in engines)


def test_dp_attention_flags_and_port_block():
    args = args_of("--rollout-num-gpus", 8, "--rollout-num-gpus-per-engine", 8, "--sglang-dp-size", 4,
                   "--sglang-enable-dp-attention")
    (engine,) = plan(args).engines
    argv = engine.processes[0].argv
    assert argv[argv.index("--dp-size") + 1] == "4" and "--enable-dp-attention" in argv
    assert argv[argv.index("--tp-size") + 1] == "8"
    # the distributed-init port starts a block of 30 + dp_size ports nothing else gets
    dist_port = int(fields(engine)["dist_init_addr"].rsplit(":", 1)[1])
    assert dist_port == 20002
    next_engine_port = PortAllocator(lambda n, s, c: s, 20000)
    for count in (1, 1, 34):
        next_engine_port.take("10.0.0.1", count)
    assert next_engine_port.next_start["10.0.0.1"] == dist_port + 34


def test_prefill_decode_groups():
    args = args_of("--rollout-num-gpus", 8, "--rollout-num-gpus-per-engine", 2, "--prefill-num-servers", 1)
    engines = plan(args).engines
    assert [e.worker_type for e in engines] == ["prefill", "decode", "decode", "decode"]
    prefill = engines[0]
    assert fields(prefill)["disaggregation_mode"] == "prefill"
    assert fields(prefill)["disaggregation_bootstrap_port"] == prefill.bootstrap_port
    assert fields(prefill)["load_balance_method"] == "follow_bootstrap_room"
    assert prefill.registration() == {"url": prefill.url, "worker_type": "prefill", "bootstrap_port": prefill.bootstrap_port}
    assert all(fields(e)["disaggregation_mode"] == "decode" and e.bootstrap_port is None for e in engines[1:])
    assert engines[1].registration()["worker_type"] == "decode"


def test_placeholder_groups_reserve_gpus_and_overrides_win():
    args = args_of("--rollout-num-gpus", 8, "--sglang-mem-fraction-static", 0.7)
    models = [
        ModelConfig("actor", "/ckpt/actor", True, [ServerGroup("regular", 2, 2),
                                                     ServerGroup("placeholder", 2, 2),
                                                     ServerGroup("regular", 2, 1, {"mem_fraction_static": 0.5})]),
        ModelConfig("judge", "/ckpt/judge", False, [ServerGroup("regular", 2, 2)]),
    ]
    result = plan(args, models=models)
    assert result.reserved_gpus == 2
    assert [(e.model, fields(e)["base_gpu_id"], e.num_gpus) for e in result.engines] == [
        ("actor", 0, 2), ("actor", 4, 1), ("actor", 5, 1), ("judge", 6, 2)]
    assert [fields(e)["mem_fraction_static"] for e in result.engines] == [0.7, 0.5, 0.5, 0.7]
    assert fields(result.engines[3])["model_path"] == "/ckpt/judge" and not result.engines[3].update_weights


def test_layout_errors_name_the_engine():
    args = args_of("--rollout-num-gpus", 6, "--rollout-num-gpus-per-engine", 3)
    with pytest.raises(ValueError, match="straddle nodes"):
        plan(args, uniform_device_map(6, 4, NODES))
    args = args_of("--rollout-num-gpus", 12, "--rollout-num-gpus-per-engine", 12)
    with pytest.raises(ValueError, match="multiple of --num-gpus-per-node 8"):
        plan(args, uniform_device_map(12, 8, NODES))
    args = args_of("--rollout-num-gpus", 4)
    with pytest.raises(ValueError, match="needs 8 GPUs but only 4"):
        plan(args, models=[ModelConfig("m", "/m", True, [ServerGroup("regular", 8, 1)])])


def test_free_port_search_skips_ports_in_use():
    import socket

    from slime.ray.engine_actor import find_free_port

    with socket.socket() as busy:
        busy.bind(("", 0))
        taken = busy.getsockname()[1]
        busy.listen()
        port = find_free_port(taken, 2)
        assert port > taken  # a block of 2 free ports that does not start on the taken one
