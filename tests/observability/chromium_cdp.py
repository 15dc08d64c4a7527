"""A headless Chromium driven over the Chrome DevTools Protocol (websocket), for page tests.

    with HeadlessChromium(tmp_path) as browser:
        browser.navigate("file:///.../page.html")
        browser.evaluate("document.title")
        browser.click(x, y); browser.screenshot("shot.png")

Started with the flags the project's tests use (no sandbox, no GPU, no network side traffic, a
throw-away profile); the DevTools port is chosen by Chromium and read from its profile directory.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path

import aiohttp

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class HeadlessChromium:
    def __init__(self, workdir: Path, width: int = 1400, height: int = 900):
        self.binary = find_chromium()
        if self.binary is None:
            raise RuntimeError("Chromium is not installed (Debian: apt-get install -y chromium)")
        self.profile = Path(workdir) / "chromium-profile"
        self.width, self.height = width, height
        self.process: subprocess.Popen | None = None
        self._loop = asyncio.new_event_loop()
        self._session: aiohttp.ClientSession | None = None
        self._ws = None
        self._ids = itertools.count(1)
        self._events: list[dict] = []

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "HeadlessChromium":
        self.profile.mkdir(parents=True, exist_ok=True)
        self.log = open(self.profile.parent / "chromium.log", "wb")
        self.process = subprocess.Popen([self.binary, *FLAGS, f"--user-data-dir={self.profile}",
                                         "--remote-debugging-port=0", f"--window-size={self.width},{self.height}",
                                         "about:blank"], stdout=self.log, stderr=subprocess.STDOUT)
        port = self._wait_port(timeout=60)
        self._loop.run_until_complete(self._connect(port))
        self.send("Page.enable")
        self.send("Runtime.enable")
        self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height, deviceScaleFactor=1,
                  mobile=False)
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._ws is not None:
                self._loop.run_until_complete(self._ws.close())
            if self._session is not None:
                self._loop.run_until_complete(self._session.close())
        finally:
            self._loop.close()
            if self.process is not None:
                self.process.terminate()
                try:
                    self.process.wait(10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            self.log.close()

    def _wait_port(self, timeout: float) -> int:
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.process.returncode}; see {self.log.name}")
            if marker.is_file() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            time.sleep(0.1)
        raise TimeoutError(f"chromium did not open its DevTools port within {timeout}s")

    async def _connect(self, port: int) -> None:
        self._session = aiohttp.ClientSession()
        async with self._session.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        page = next(t for t in targets if t.get("type") == "page")
        self._ws = await self._session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)

    # ------------------------------------------------------------------ protocol
    async def _call(self, method: str, params: dict, timeout: float) -> dict:
        call_id = next(self._ids)
        await self._ws.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads((await self._ws.receive(timeout=timeout)).data)
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._events.append(message)

    def send(self, method: str, timeout: float = 30.0, **params) -> dict:
        return self._loop.run_until_complete(self._call(method, params, timeout))

    def wait_event(self, method: str, timeout: float = 30.0) -> dict:
        async def wait():
            deadline = time.monotonic() + timeout
            while True:
                for event in self._events:
                    if event.get("method") == method:
                        self._events.remove(event)
                        return event
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no {method} within {timeout}s")
                self._events.append(json.loads((await self._ws.receive(timeout=remaining)).data))

        return self._loop.run_until_complete(wait())

    # ------------------------------------------------------------------ helpers
    def navigate(self, url: str) -> None:
        self._events.clear()
        self.send("Page.navigate", url=url)
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page error evaluating {expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def click(self, x: float, y: float) -> None:
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def screenshot(self, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", format="png")["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path
