"""One inference engine as a Ray actor: it holds the engine's devices and owns its server process.

The server is the embedded engine (``--rollout-backend embedded``) or SGLang (``sglang``, one actor
per node of an engine, running the command line of its launch plan); either way the rest of slime
talks to it over HTTP. The actor survives its server: ``alive()`` reports a
dead process and ``restart()`` brings up a fresh one on the same devices and port.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import ray

from slime.utils.passthrough import EMBEDDED_FLAG_FOR, EMBEDDED_SGLANG_FLAGS

logger = logging.getLogger(__name__)


def memory_saver_installed() -> bool:
    """torch-memory-saver importable here (the engine process runs in this actor's environment)."""
    return importlib.util.find_spec("torch_memory_saver") is not None


def embedded_engine_argv(args, gpu: bool) -> list[str]:
    argv = ["--device", "cuda" if gpu else "cpu"]
    if args.true_on_policy or args.deterministic_mode:
        # batch-invariant ops (slime/backends/batch_invariant.py): a sample's tokens and log-probs do not depend
        # on the batch it decoded in (and are the trainer's with --true-on-policy)
        argv.append("--enable-deterministic-inference")
    if args.use_rollout_routing_replay:  # R3: the engine returns its routed experts (SGLang's flag)
        argv.append("--enable-return-routed-experts")
    if gpu and args.colocate and args.offload_rollout and memory_saver_installed():
        # released and resumed in place (the CUDA graphs survive a training step), as slime asks SGLang for it
        argv.append("--enable-memory-saver")
    forwarded = dict(args.sglang_passthrough or {})
    if args.embedded_engine_max_total_tokens is not None:
        forwarded["max-total-tokens"] = args.embedded_engine_max_total_tokens
    if args.embedded_engine_max_running_requests is not None:
        forwarded["max-running-requests"] = args.embedded_engine_max_running_requests
    if args.embedded_engine_dtype is not None:
        forwarded["dtype"] = args.embedded_engine_dtype
    if args.rollout_max_context_len is not None and "context-length" not in forwarded:
        forwarded["context-length"] = args.rollout_max_context_len
    if "max-running-requests" not in forwarded:
        forwarded["max-running-requests"] = rollout_concurrency_per_engine(args)
    for name, value in forwarded.items():
        name = EMBEDDED_FLAG_FOR.get(name, name)
        if name not in EMBEDDED_SGLANG_FLAGS:
            logger.warning("--sglang-%s is an SGLang option the embedded engine does not have; ignored", name)
            continue
        if value is True:
            argv.append(f"--{name}")
        elif isinstance(value, (list, tuple)):  # nargs="+" (--cuda-graph-bs 1 2 4 8)
            argv += [f"--{name}", *map(str, value)]
        elif value is not False and value is not None:  # not `in (False, None)`: 0 == False, and 0 is a value
            argv += [f"--{name}", str(value)]
    return argv


def rollout_concurrency_per_engine(args, cap: int = 1024) -> int:
    """Requests one engine should decode together when no --sglang-max-running-requests is given: a
    rollout step's samples (over-sampling batch × samples per prompt) spread over the engines, so a
    step is one wave of decoding instead of several (the engine's own default is 64)."""
    engines = max(1, int(args.rollout_num_gpus or 1) // max(1, int(args.rollout_num_gpus_per_engine or 1)))
    batch = int(args.over_sampling_batch_size or args.rollout_batch_size or 1)
    samples = batch * int(args.n_samples_per_prompt or 1)
    return max(64, min(cap, -(-samples // engines)))


def node_ip() -> str:
    return ray.util.get_node_ip_address()


def find_free_port(start: int, count: int = 1, host: str = "") -> int:
    """The first port >= ``start`` that begins ``count`` consecutive ports free on this node."""
    import socket

    port = start
    while port + count < 65536:
        for offset in range(count):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port + offset))
                except OSError:
                    break
        else:
            return port
        port += offset + 1
    raise RuntimeError(f"no {count} consecutive free ports from {start} on {node_ip()}")


@ray.remote(num_cpus=0)
def probe_bundle() -> tuple[str, list[int]]:
    """(node IP, GPU ids Ray gave this bundle) — where a rollout GPU is."""
    return node_ip(), [int(g) for g in ray.get_gpu_ids()]


@ray.remote(num_cpus=0)
def probe_free_port(start: int, count: int) -> int:
    return find_free_port(start, count)


def cpu_engine_threads(args, cpu_count: int | None = None) -> int:
    """CPU threads of one embedded engine on a CPU machine: the cores shared by the engines, and also
    by the training ranks when generation overlaps training (``train_async.py``); in the synchronous
    loop the trainer is idle while the engines generate, so they take every core.
    ``SLIME_ENGINE_THREADS`` overrides it."""
    cores = cpu_count or os.cpu_count() or 1
    engines = max(1, int(args.rollout_num_gpus or 1) // max(1, int(args.rollout_num_gpus_per_engine or 1)))
    sharers = engines
    if args.rollout_overlaps_training:
        sharers += max(1, int(args.actor_num_nodes or 1) * int(args.actor_num_gpus_per_node or 1))
    return max(1, cores // sharers)


def engine_host() -> str:
    """Where an embedded engine listens: loopback on a one-node cluster; this node's IP when the Ray
    cluster has several nodes, so that trainers and the rollout manager on other nodes reach it."""
    from slime.backends.embedded_engine.config import is_loopback

    alive = [node for node in ray.nodes() if node.get("Alive")]
    if len(alive) <= 1:
        return "127.0.0.1"
    host = ray.util.get_node_ip_address()
    if not is_loopback(host):
        # the rollout path (router, weight sync) sends no credentials, and an engine without them must
        # not listen beyond this machine
        raise RuntimeError(f"embedded engines listen on loopback addresses only, and this Ray node's address is "
                           f"{host}: across machines use --rollout-backend sglang; one machine with several Ray "
                           "nodes on loopback IPs works (scripts/run-multinode-cpu.sh)")
    return host


@ray.remote
class EngineActor:
    """One engine (embedded), or one node's process of an SGLang engine (``process_plan``)."""

    def __init__(self, args, engine_index: int, num_gpus: int, process_plan=None):
        self.args, self.engine_index, self.num_gpus = args, engine_index, num_gpus
        self.process_plan = process_plan  # launch_plan.EngineProcess for --rollout-backend sglang
        self.process = None
        self.port = None

    def start(self, timeout: float | None = None) -> str:
        # the engine's bundle has a GPU exactly where the driver's use_gpu(args) placed one; asking torch
        # instead would import it here (2-3 s of a CPU start) before the engine process is even launched
        gpu = bool(ray.get_gpu_ids())
        # a GPU engine loads, quantizes, compiles its Triton kernels (the first time on a machine) and captures a
        # CUDA graph per decode batch size before it answers /health: as long as SGLang is given; a CPU engine
        # starts in seconds, and a hung start should fail a test run well before its own timeout
        timeout = timeout if timeout is not None else (1800.0 if gpu else 300.0)
        if self.args.rollout_backend == "embedded":
            from slime.backends.embedded_engine.serving.launch import EmbeddedEngineProcess

            env = dict(os.environ)
            if not gpu:
                env["OMP_NUM_THREADS"] = env.get("SLIME_ENGINE_THREADS") or str(cpu_engine_threads(self.args))
            self.process = EmbeddedEngineProcess(self.args.hf_checkpoint, port=self.port, host=engine_host(),
                                                 extra_args=embedded_engine_argv(self.args, gpu), env=env)
        else:
            from slime.backends.sglang_utils.sglang_server import SGLangServerProcess

            if self.process_plan is None:
                raise ValueError(f"engine {self.engine_index}: an SGLang engine process needs its launch plan")
            self.process = SGLangServerProcess(self.process_plan)
            logger.info("engine %d node rank %d: %s", self.engine_index, self.process_plan.node_rank,
                        " ".join(self.process_plan.argv))
        self.process.start()
        self.process.wait_healthy(timeout)
        self.port = self.process.port
        return self.process.url

    def url(self) -> str | None:
        return self.process.url if self.process is not None else None

    def alive(self) -> bool:
        return self.process is not None and self.process.process is not None and self.process.process.poll() is None

    def restart(self, timeout: float = 300.0) -> str:
        self.stop()
        return self.start(timeout)

    def kill(self) -> None:
        """SIGKILL the server and its children (a hung engine ignores SIGTERM); ``start`` brings it
        back on the same port."""
        if self.process is not None:
            self.process.kill()
            self.process = None

    def kill_for_test(self) -> None:
        """Kill the server process hard (fault-injection tests)."""
        self.process.process.kill()
        self.process.process.wait(10)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
