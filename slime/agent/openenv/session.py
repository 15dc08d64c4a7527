"""One episode on an OpenEnv environment server, over its WebSocket or its HTTP MCP session.

The server is built with openenv-core's own server code (``openenv.core.env_server.create_fastapi_app``
around an ``MCPEnvironment``); this module is the client side the rollout uses. Two transports, the
same episode:

* ``ws`` (default): one WebSocket session per episode (openenv-core's ``GenericEnvClient`` on
  ``/ws``): ``reset`` with the row's task, then MCP actions as steps (``list_tools``,
  ``call_tool``). The server gives every WebSocket its own environment instance.
* ``http``: an MCP session over ``POST /mcp`` (``openenv/session/create``, ``tools/list``,
  ``tools/call`` with the ``session_id``, ``openenv/session/close``). HTTP has no ``reset`` on a
  session, so the task is started by calling the env's ``start_episode`` tool, if it has one.

Two tools are the harness's, never shown to the model: ``end_turn(response)`` (required) receives
the model's reply that had no tool call and answers ``{"done": bool, "reward": number | null,
"prompt": string | null}``; ``start_episode(**reset_kwargs)`` (HTTP only) may answer
``{"prompt": ...}``. On the WebSocket an observation's own ``done`` / ``reward`` (OpenEnv's step
result) take precedence over the tool's answer.

Opening waits out a server at its session limit (openenv-core answers ``CAPACITY_REACHED``) or one
that is (re)starting (connection refused) until ``reset_timeout`` seconds have passed. A server on
another machine is reached with a token: sent as ``Authorization: Bearer`` on the WebSocket
handshake and on every HTTP request (see :mod:`slime.agent.openenv.serve` for the server side).
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

END_TURN = "end_turn"
START_EPISODE = "start_episode"
HARNESS_TOOLS = frozenset({END_TURN, START_EPISODE})
TRANSPORTS = ("ws", "http")


class EnvFailure(RuntimeError):
    """The environment (not the model) broke the episode: unreachable, crashed, or answered nonsense."""


@dataclass
class EnvSettings:
    """Where and how to reach a row's environment server (``metadata["server"]`` of the row).

    url: the server's base URL (``http://host:port``).
    transport: ``ws`` (a WebSocket session per episode) or ``http`` (an MCP session over ``/mcp``).
    reset_timeout: seconds to keep retrying the episode's opening while the server is at its session
        limit or not accepting connections.
    message_timeout: seconds to wait for one answer of the server.
    token: bearer token for a remote server (read from the environment variable ``token_env`` names,
        so no secret sits in the data file).
    reset_kwargs: extra keyword arguments of ``reset`` (with ``task_id``, ``seed``, ``episode_id``).
    """

    url: str
    transport: str = "ws"
    reset_timeout: float = 60.0
    message_timeout: float = 60.0
    token: str | None = None
    reset_kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_metadata(cls, metadata: dict, defaults: dict | None = None) -> "EnvSettings":
        server = {**(defaults or {}), **(metadata.get("server") or {})}
        if not server.get("url"):
            raise ValueError("the row names no environment server: set metadata.server.url (or openenv_url in "
                             "--custom-config-path)")
        transport = server.get("transport", "ws")
        if transport not in TRANSPORTS:
            raise ValueError(f"metadata.server.transport must be one of {TRANSPORTS}, got {transport!r}")
        token = server.get("token")
        token_env = server.get("token_env")
        if token is None and token_env:
            token = os.environ.get(token_env)
            if not token:
                raise ValueError(f"metadata.server.token_env names {token_env!r}, which is not set")
        return cls(url=str(server["url"]).rstrip("/"), transport=transport,
                   reset_timeout=float(server.get("reset_timeout", 60.0)),
                   message_timeout=float(server.get("message_timeout", 60.0)), token=token,
                   reset_kwargs=dict(server.get("reset_kwargs") or {}))

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


@dataclass
class ToolAnswer:
    """What a tool call returned: the text for the model, whether it was an error, its structured
    content (a dict, when the tool returned one) and, on the WebSocket, the step's done / reward."""

    text: str
    is_error: bool = False
    structured: dict | None = None
    done: bool = False
    reward: float | None = None


def _result_answer(result) -> ToolAnswer:
    """A FastMCP ``CallToolResult`` as openenv-core serialises it (a dict) -> ToolAnswer."""
    if not isinstance(result, dict):
        return ToolAnswer(text="" if result is None else str(result))
    texts = [c.get("text", "") for c in result.get("content") or [] if isinstance(c, dict) and c.get("type") == "text"]
    structured = result.get("structured_content")
    if not isinstance(structured, dict):
        structured = None
    return ToolAnswer(text="\n".join(texts), is_error=bool(result.get("is_error")), structured=structured)


def _is_capacity(error: BaseException) -> bool:
    text = str(error)
    return "CAPACITY_REACHED" in text or "max_sessions" in text or "Server at capacity" in text


class EnvEpisode(abc.ABC):
    """Base of the two transports: ``open`` (with retries) -> ``list_tools`` / ``call_tool`` -> ``close``."""

    def __init__(self, settings: EnvSettings):
        self.settings = settings

    async def open(self, reset_kwargs: dict) -> str | None:
        """Start the episode; returns the env's opening prompt, if it gives one. Retries until
        ``reset_timeout`` while the server is full or not (yet) accepting connections."""
        deadline = time.monotonic() + self.settings.reset_timeout
        delay, attempts = 0.1, 0
        while True:
            attempts += 1
            try:
                return await self._open_once(reset_kwargs)
            except (OSError, ConnectionError, asyncio.TimeoutError, EnvFailure) as e:
                retryable = not isinstance(e, EnvFailure) or _is_capacity(e)
                await self._discard()
                if not retryable:
                    raise
                if time.monotonic() + delay > deadline:
                    raise EnvFailure(f"{self.settings.url}: no episode opened within reset_timeout="
                                     f"{self.settings.reset_timeout}s ({attempts} attempts; last: {e})") from e
                logger.debug("env %s not ready (%s); retrying in %.1fs", self.settings.url, e, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)

    @abc.abstractmethod
    async def _open_once(self, reset_kwargs: dict) -> str | None:
        """Implemented by each transport."""

    async def _discard(self) -> None:
        """Drop a half-open connection before retrying."""

    @abc.abstractmethod
    async def list_tools(self) -> list[dict]:
        """The env's tools as ``{"name", "description", "input_schema"}`` dicts."""

    @abc.abstractmethod
    async def call_tool(self, name: str, arguments: dict) -> ToolAnswer:
        """Implemented by each transport."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Implemented by each transport."""


class WebSocketEpisode(EnvEpisode):
    """An episode on ``/ws``, through openenv-core's ``GenericEnvClient``."""

    def __init__(self, settings: EnvSettings):
        super().__init__(settings)
        self.client = None

    def _new_client(self):
        from openenv.core.generic_client import GenericEnvClient
        from websockets.asyncio.client import connect as ws_connect
        from websockets.exceptions import InvalidStatus

        headers = self.settings.headers()

        class _Client(GenericEnvClient):
            async def connect(self):  # openenv-core's connect, plus the bearer token on the handshake
                if self._ws is None:
                    try:
                        self._ws = await ws_connect(self._ws_url, open_timeout=self._connect_timeout,
                                                    max_size=self._max_message_size, additional_headers=headers,
                                                    proxy=None)
                    except InvalidStatus as e:
                        status = e.response.status_code
                        if status in (401, 403):  # the token is wrong or missing: retrying will not help
                            raise EnvFailure(f"{self._ws_url} refused the session (HTTP {status}): missing or "
                                             f"wrong bearer token") from e
                        raise ConnectionError(f"could not connect to {self._ws_url}: {e}") from e
                    except Exception as e:
                        raise ConnectionError(f"could not connect to {self._ws_url}: {e}") from e
                return self

        return _Client(base_url=self.settings.url, message_timeout_s=self.settings.message_timeout)

    async def _open_once(self, reset_kwargs: dict) -> str | None:
        from websockets.exceptions import ConnectionClosed

        self.client = self._new_client()
        await self.client.connect()
        try:
            result = await self.client.reset(**reset_kwargs)
        except RuntimeError as e:  # openenv-core's client raises the server's error answers as RuntimeError
            raise EnvFailure(f"reset failed: {e}") from e
        except ConnectionClosed as e:
            raise ConnectionError(f"the server closed the session during reset: {e}") from e
        prompt = (result.observation or {}).get("prompt")
        return prompt if isinstance(prompt, str) else None

    async def _discard(self) -> None:
        await self.close()

    async def _step(self, action: dict):
        from websockets.exceptions import ConnectionClosed

        try:
            return await self.client.step(action)
        except RuntimeError as e:
            raise EnvFailure(f"step {action.get('type')} failed: {e}") from e
        except (ConnectionClosed, OSError, asyncio.TimeoutError) as e:
            raise EnvFailure(f"the env's session broke during {action.get('type')}: {type(e).__name__}: {e}") from e

    async def list_tools(self) -> list[dict]:
        result = await self._step({"type": "list_tools"})
        tools = (result.observation or {}).get("tools")
        if not isinstance(tools, list):
            raise EnvFailure(f"list_tools answered no tool list: {result.observation!r}"[:500])
        return tools

    async def call_tool(self, name: str, arguments: dict) -> ToolAnswer:
        result = await self._step({"type": "call_tool", "tool_name": name, "arguments": arguments})
        observation = result.observation or {}
        error = observation.get("error")
        if error:
            answer = ToolAnswer(text=str(error.get("message", error)) if isinstance(error, dict) else str(error),
                                is_error=True)
        else:
            answer = _result_answer(observation.get("result"))
        answer.done, answer.reward = bool(result.done), result.reward
        return answer

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None and client._ws is not None:
            # openenv-core's "close" message, then wait for the server to close the socket: the server
            # destroys the session and closes first (a client that closes first makes its close fail).
            try:
                await client._ws.send(json.dumps({"type": "close"}))
                await asyncio.wait_for(client._ws.wait_closed(), 5.0)
            except Exception as e:  # the episode is over either way
                logger.debug("closing the env session: %s", e)
            finally:
                await client._ws.close()
                client._ws = None


class HTTPEpisode(EnvEpisode):
    """An episode in an MCP session over ``POST /mcp``."""

    def __init__(self, settings: EnvSettings):
        super().__init__(settings)
        self.http = None
        self.session_id: str | None = None
        self._next_id = 0
        self._tools: list[dict] | None = None

    async def _rpc(self, method: str, params: dict) -> dict:
        import httpx

        if self.http is None:
            self.http = httpx.AsyncClient(headers=self.settings.headers(), timeout=self.settings.message_timeout,
                                          trust_env=False)
        self._next_id += 1
        try:
            response = await self.http.post(f"{self.settings.url}/mcp", json={
                "jsonrpc": "2.0", "method": method, "params": params, "id": self._next_id})
        except httpx.TransportError as e:
            raise ConnectionError(f"{self.settings.url}/mcp: {type(e).__name__}: {e}") from e
        if response.status_code >= 400:
            raise EnvFailure(f"{method}: HTTP {response.status_code}: {response.text[:300]}")  # 401: the token
        return response.json()

    async def _open_once(self, reset_kwargs: dict) -> str | None:
        answer = await self._rpc("openenv/session/create", {})
        if "error" in answer:
            raise EnvFailure(f"openenv/session/create: {answer['error']}")
        self.session_id = answer["result"]["session_id"]
        if any(t.get("name") == START_EPISODE for t in await self.list_tools()):
            started = await self._call(START_EPISODE, reset_kwargs)
            if started.is_error:
                raise EnvFailure(f"{START_EPISODE} failed: {started.text}")
            prompt = (started.structured or {}).get("prompt")
            return prompt if isinstance(prompt, str) else None
        return None

    async def _discard(self) -> None:
        await self.close()

    async def list_tools(self) -> list[dict]:
        if self._tools is None:
            answer = await self._rpc("tools/list", {"session_id": self.session_id})
            if "error" in answer or not isinstance(answer.get("result", {}).get("tools"), list):
                raise EnvFailure(f"tools/list: {answer.get('error', answer)}")
            self._tools = [{"name": t.get("name"), "description": t.get("description") or "",
                            "input_schema": t.get("input_schema") or t.get("inputSchema") or {}}
                           for t in answer["result"]["tools"]]
        return self._tools

    async def _call(self, name: str, arguments: dict) -> ToolAnswer:
        try:
            answer = await self._rpc("tools/call", {"session_id": self.session_id, "name": name,
                                                    "arguments": arguments})
        except ConnectionError as e:
            raise EnvFailure(f"the env's session broke during {name}: {e}") from e
        if "error" in answer:
            error = answer["error"]
            return ToolAnswer(text=str(error.get("message", error)) if isinstance(error, dict) else str(error),
                              is_error=True)
        return _result_answer(answer.get("result"))

    async def call_tool(self, name: str, arguments: dict) -> ToolAnswer:
        return await self._call(name, arguments)

    async def close(self) -> None:
        if self.http is None:
            return
        try:
            if self.session_id is not None:
                await self._rpc("openenv/session/close", {"session_id": self.session_id})
        except Exception as e:  # the episode is over either way
            logger.debug("closing the env's MCP session: %s", e)
        finally:
            self.session_id = None
            http, self.http = self.http, None
            await http.aclose()


def episode_for(settings: EnvSettings) -> EnvEpisode:
    return WebSocketEpisode(settings) if settings.transport == "ws" else HTTPEpisode(settings)


def turn_outcome(answer: ToolAnswer) -> tuple[bool, float | None, str | None]:
    """``end_turn``'s answer -> (done, reward, next prompt). The step's own done/reward win."""
    if answer.is_error:
        raise EnvFailure(f"{END_TURN} failed: {answer.text[:500]}")
    payload = answer.structured
    if payload is None and answer.text:
        try:
            payload = json.loads(answer.text)
        except json.JSONDecodeError:
            payload = None
    if not isinstance(payload, dict):
        payload = {}
    done = answer.done or bool(payload.get("done"))
    reward = answer.reward if answer.reward is not None else payload.get("reward")
    prompt = payload.get("prompt")
    if reward is not None and not isinstance(reward, (int, float)):
        raise EnvFailure(f"{END_TURN} answered a reward that is not a number: {reward!r}")
    return done, (float(reward) if reward is not None else None), (prompt if isinstance(prompt, str) else None)
