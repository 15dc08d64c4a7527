"""slime.utils.http_utils: the rollout's async JSON client (aiohttp) against a real local server."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from slime.utils import http_utils
from slime.utils.http_utils import HTTPRequestError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def serve(handlers: dict):
    app = web.Application()
    for path, handler in handlers.items():
        app.router.add_route("*", path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def run(coro):
    async def wrapped():
        try:
            return await coro
        finally:
            await http_utils.close_client()
    return asyncio.run(wrapped())


def test_post_retries_server_errors_and_returns_the_json_answer(monkeypatch):
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    calls = []

    async def flaky(request):
        calls.append(await request.json())
        if len(calls) < 3:
            return web.Response(status=503, text="warming up")
        return web.json_response({"echo": calls[-1], "n": len(calls)})

    async def main():
        runner, url = await serve({"/generate": flaky})
        try:
            return await http_utils.post(url + "/generate", {"input_ids": [1, 2]}, max_retries=5)
        finally:
            await runner.cleanup()

    assert run(main()) == {"echo": {"input_ids": [1, 2]}, "n": 3}
    assert len(calls) == 3


def test_post_raises_a_client_error_at_once_with_the_servers_message(monkeypatch):
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    calls = []

    async def refuse(request):
        calls.append(1)
        return web.Response(status=400, text='{"error": "max_new_tokens must be >= 0"}')

    async def main():
        runner, url = await serve({"/generate": refuse})
        try:
            await http_utils.post(url + "/generate", {}, max_retries=5)
        finally:
            await runner.cleanup()

    with pytest.raises(HTTPRequestError, match="answered 400.*max_new_tokens must be >= 0") as info:
        run(main())
    assert info.value.status_code == 400 and len(calls) == 1


def test_post_to_nothing_fails_after_its_retries_naming_the_url(monkeypatch):
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    url = f"http://127.0.0.1:{free_port()}/generate"
    with pytest.raises(HTTPRequestError, match=f"POST {url} failed after 3 attempts; last error: .*Connect"):
        run(http_utils.post(url, {}, max_retries=3))


def test_get_parses_json_text_and_empty_bodies():
    async def info(request):
        return web.json_response({"version": request.query.get("v")})

    async def text(request):
        return web.Response(text="plain words")

    async def empty(request):
        return web.Response(status=200)

    async def main():
        runner, url = await serve({"/info": info, "/text": text, "/empty": empty})
        try:
            return (await http_utils.get(url + "/info", params={"v": "3"}), await http_utils.get(url + "/text"),
                    await http_utils.post(url + "/empty", None))
        finally:
            await runner.cleanup()

    assert run(main()) == ({"version": "3"}, "plain words", None)


def test_bodies_python_json_writes_and_orjson_refuses_still_parse_and_send():
    """orjson reads the answers; what only Python's json takes (NaN, Infinity) falls back to it, and a payload
    orjson cannot write (an integer beyond 64 bits) is sent by json, with its content type either way."""
    seen = []

    async def nan(request):
        return web.Response(text='{"logprob": NaN, "low": -Infinity}', content_type="application/json")

    async def echo(request):
        seen.append((request.content_type, await request.text()))
        return web.json_response({"ok": True})

    async def main():
        runner, url = await serve({"/nan": nan, "/echo": echo})
        try:
            return (await http_utils.post(url + "/nan", {"x": 1}), await http_utils.post(url + "/echo", {"big": 2**70}),
                    await http_utils.post(url + "/echo", {"ids": [1, 2]}))
        finally:
            await runner.cleanup()

    got, big, small = run(main())
    assert got["logprob"] != got["logprob"] and got["low"] == float("-inf")
    assert big == small == {"ok": True}
    assert seen == [("application/json", '{"big": 1180591620717411303424}'), ("application/json", '{"ids":[1,2]}')]


_real_sleep = asyncio.sleep


async def _no_sleep(seconds, *args, **kwargs):
    await _real_sleep(0)
