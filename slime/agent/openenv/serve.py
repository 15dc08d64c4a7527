"""Serving an OpenEnv environment app (openenv-core's FastAPI app) on loopback, or remotely with a token.

openenv-core's server has no authentication of its own. ``serve_env`` binds 127.0.0.1 by default;
any other address requires a token, checked on every HTTP request and WebSocket handshake
(``Authorization: Bearer <token>``, answered 401 / closed with 1008 otherwise). The rollout side
sends it from ``metadata.server.token_env`` (:class:`slime.agent.openenv.session.EnvSettings`).

    app = create_fastapi_app(MyEnv, CallToolAction, CallToolObservation, max_concurrent_envs=64)
    handle = serve_env(app)                        # loopback, free port: handle.url
    handle = serve_env(app, host="0.0.0.0", port=8000, token=os.environ["ENV_TOKEN"])   # remote
    ...
    handle.stop()
"""

from __future__ import annotations

import hmac
import threading
import time
from dataclasses import dataclass

from slime.agent.aiohttp_threaded import is_loopback


class BearerTokenMiddleware:
    """ASGI middleware: every HTTP request and WebSocket handshake must carry ``Bearer <token>``."""

    def __init__(self, app, token: str):
        if not token:
            raise ValueError("BearerTokenMiddleware needs a non-empty token")
        self.app = app
        self._expected = f"Bearer {token}".encode()

    def _authorized(self, scope) -> bool:
        for key, value in scope.get("headers") or ():
            if key.lower() == b"authorization":
                return hmac.compare_digest(value, self._expected)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await receive()  # the handshake (websocket.connect), then refuse it
            await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong bearer token"})
            return
        body = b'{"detail": "missing or wrong bearer token"}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


@dataclass
class EnvServerHandle:
    host: str
    port: int
    server: object
    thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def serve_env(app, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
              start_timeout: float = 30.0, log_level: str = "warning") -> EnvServerHandle:
    """Run an environment's ASGI app with uvicorn on a daemon thread; returns once it accepts connections.

    A non-loopback ``host`` without ``token`` is refused: an env server reachable from other machines
    must not be open to anyone. With a token, loopback servers check it too.
    """
    import uvicorn

    if not is_loopback(host) and not token:
        raise ValueError(f"serving an environment on {host} (not loopback) requires a token: anyone who reaches "
                         f"the port could otherwise drive its episodes")
    if token:
        app = BearerTokenMiddleware(app, token)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, ws="websockets-sansio", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="openenv-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the environment server did not start on {host}:{port} (see its log)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"the environment server did not start on {host}:{port} within {start_timeout}s")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return EnvServerHandle(host=host, port=bound, server=server, thread=thread)
