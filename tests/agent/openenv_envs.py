"""OpenEnv environments for the tests, built with openenv-core's own server code.

``CalculatorEnv`` is a multi-turn tool env with a verifier: the task ``add-A-B`` asks for A+B; the
model may call ``add(a, b)``; its reply without a tool call goes to ``end_turn``, which scores it
(1.0 for the right sum, then done) or, while turns remain, answers "not right, try again" as the next
prompt (done after ``tries`` wrong replies, reward 0). ``crash-*`` tasks fail mid-episode: their
``end_turn`` raises, as an env with a bug would. ``start_episode`` starts a task for the HTTP MCP
session, which has no ``reset``.
"""

from __future__ import annotations

from agent_script import ADD_SCHEMA
from fastmcp import FastMCP
from fastmcp.tools import Tool
from openenv.core.env_server import CallToolAction, CallToolObservation, MCPEnvironment, create_fastapi_app
from openenv.core.env_server.types import Observation, State


class TaskObservation(Observation):
    """The reset observation: the opening prompt of the task, if it has one."""

    prompt: str | None = None


class CalculatorEnv(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    tries = 2
    opened: list = []  # (task_id, seed) of every episode started, across instances (test introspection)
    closed: list = []

    def __init__(self):
        mcp = FastMCP("calculator")
        self.task_id, self.expected, self.wrong, self.calls = None, None, 0, 0

        def add(a: int, b: int) -> int:
            """Add two integers."""
            self.calls += 1
            return a + b

        # the schema the scripted model was taught with (FastMCP's own adds additionalProperties)
        mcp.add_tool(Tool.from_function(add).model_copy(update={"parameters": ADD_SCHEMA}))

        @mcp.tool()
        def end_turn(response: str) -> dict:
            """The harness's: the model's reply without a tool call."""
            return self.score(response)

        @mcp.tool()
        def start_episode(task_id: str, seed: int | None = None, episode_id: str | None = None) -> dict:
            """The harness's (HTTP sessions): start a task."""
            return {"prompt": self.start(task_id, seed)}

        super().__init__(mcp)
        self._state = State(episode_id=None, step_count=0)

    def start(self, task_id, seed=None) -> str | None:
        self.task_id, self.wrong, self.calls = task_id, 0, 0
        CalculatorEnv.opened.append((task_id, seed))
        if task_id and task_id.startswith("add-"):
            _, a, b = task_id.split("-")
            self.expected = str(int(a) + int(b))
        return None  # the question is in the row's messages

    def score(self, response: str) -> dict:
        if self.task_id and self.task_id.startswith("crash"):
            raise RuntimeError("the simulator crashed")
        if response.strip() == self.expected:
            return {"done": True, "reward": 1.0}
        self.wrong += 1
        if self.wrong >= self.tries:
            return {"done": True, "reward": 0.0}
        return {"done": False, "prompt": "That is not right. Try again."}

    def reset(self, seed=None, episode_id=None, task_id=None, **kwargs):
        self._state = State(episode_id=episode_id, step_count=0)
        return TaskObservation(prompt=self.start(task_id, seed))

    def _step_impl(self, action, timeout_s=None, **kwargs):
        return Observation(metadata={"error": f"unknown action {type(action).__name__}"})

    @property
    def state(self):
        return self._state

    def close(self):
        CalculatorEnv.closed.append(self.task_id)
        super().close()


def calculator_app(max_concurrent_envs: int = 8):
    return create_fastapi_app(CalculatorEnv, CallToolAction, CallToolObservation,
                              max_concurrent_envs=max_concurrent_envs)
