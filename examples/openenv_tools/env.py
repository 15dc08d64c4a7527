"""The thermometer environment: an OpenEnv server built with openenv-core's own server code.

Each task (``train-17``, ``eval-3``, ...) has its own outdoor temperature, 0 to 9, drawn from the task
id, so only the env knows it: the rows carry the question and the task id, nothing else. The agent's
one tool is ``get_temperature()``; its reply without a tool call goes to ``end_turn``, the verifier:
1.0 when the reply is the reading, else 0.0, and the episode is done either way. A correct episode is
therefore two model turns, a ``get_temperature`` call then the reading; a guess is right one time in
ten.

    python -m examples.openenv_tools.env --port-file /tmp/env.port            # 127.0.0.1, a free port
    ENV_TOKEN=... python -m examples.openenv_tools.env --host 0.0.0.0 --port 8000 --token-env ENV_TOKEN
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import threading

from fastmcp import FastMCP
from openenv.core.env_server import CallToolAction, CallToolObservation, MCPEnvironment, create_fastapi_app
from openenv.core.env_server.types import Observation, State


def reading(task_id: str) -> str:
    """The task's temperature: fixed by its id, unknown to the rows and to the model."""
    return str(random.Random(f"thermometer/{task_id}").randrange(10))


class ThermometerEnv(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("thermometer")
        self.temperature = None

        @mcp.tool()
        def get_temperature() -> str:
            """Reads the outdoor thermometer"""
            return self.temperature

        @mcp.tool()
        def end_turn(response: str) -> dict:
            """The harness's: the agent's final reply. Scored, and the episode ends."""
            return {"done": True, "reward": 1.0 if response.strip() == self.temperature else 0.0}

        super().__init__(mcp)
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed=None, episode_id=None, task_id=None, **kwargs):
        if not task_id:
            raise ValueError("the thermometer env needs a task_id")
        self.temperature = reading(task_id)
        self._state = State(episode_id=episode_id, step_count=0)
        return Observation()

    def _step_impl(self, action, timeout_s=None, **kwargs):
        return Observation(metadata={"error": f"unknown action {type(action).__name__}"})

    @property
    def state(self):
        return self._state


def app(max_concurrent_envs: int = 256):
    return create_fastapi_app(ThermometerEnv, CallToolAction, CallToolObservation,
                              max_concurrent_envs=max_concurrent_envs)


def main(argv: list[str] | None = None) -> None:
    from slime.agent.openenv import serve_env

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--port-file", default=None, help="write the bound port here once serving")
    parser.add_argument("--token-env", default=None, help="environment variable holding the bearer token")
    parser.add_argument("--max-concurrent-envs", type=int, default=256)
    args = parser.parse_args(argv)
    token = os.environ[args.token_env] if args.token_env else None
    handle = serve_env(app(args.max_concurrent_envs), host=args.host, port=args.port, token=token)
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as f:
            f.write(str(handle.port))
        os.replace(args.port_file + ".tmp", args.port_file)
    print(f"thermometer env serving on {handle.url}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    handle.stop()


if __name__ == "__main__":
    main()
