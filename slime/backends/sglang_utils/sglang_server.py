"""One SGLang server process (``python -m sglang.launch_server ...``) from its launch plan.

Only node rank 0 of an engine serves HTTP; it is ready when ``/health_generate`` answers 200
(docs/SGLANG_PROTOCOL.md §4.1, §9). The process sees every GPU of its node (``--base-gpu-id`` picks its
own), and runs without ``PYTORCH_CUDA_ALLOC_CONF``: SGLang's memory saver does not support
expandable segments.
"""

from __future__ import annotations

import os
import time

from slime.backends.sglang_utils.launch_plan import EngineProcess
from slime.utils.process import ServerProcess


class SGLangServerProcess(ServerProcess):
    health_path = "/health_generate"

    def __init__(self, process: EngineProcess, env: dict | None = None):
        fields = process.server_args
        super().__init__(fields["host"], fields["port"], env)
        self.plan = process

    def command(self) -> list[str]:
        return list(self.plan.argv)

    def environment(self) -> dict:
        env = {k: v for k, v in os.environ.items()
               if k not in ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
        env.update(self.env or {})
        return env

    def wait_healthy(self, timeout: float = 1800.0) -> None:
        if self.plan.node_rank == 0:
            super().wait_healthy(timeout)
            return
        time.sleep(1.0)  # other node ranks serve no HTTP: alive is all that can be checked
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"SGLang node rank {self.plan.node_rank} exited at start; last log lines:\n"
                               f"{self.last_log_lines()}")
