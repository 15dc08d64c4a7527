"""Engines launched by someone else (``--rollout-external-engine-addrs host:port ...``).

slime reads each server's ``/server_info`` (falling back to ``/get_server_info``; SGLANG_PROTOCOL
§4.3) for its parallel layout, so weight updates can address every GPU rank, and checks that the
servers agree with each other.
"""

from __future__ import annotations

import httpx


def engine_url(addr: str) -> str:
    return addr.rstrip("/") if addr.startswith(("http://", "https://")) else f"http://{addr.rstrip('/')}"


def server_info(url: str, timeout: float = 30.0) -> dict:
    last = None
    for path in ("/server_info", "/get_server_info"):
        try:
            response = httpx.get(url + path, timeout=timeout)
        except httpx.HTTPError as e:
            raise RuntimeError(f"external engine {url} is not reachable ({e}); is it running?") from None
        if response.status_code == 200:
            return response.json()
        last = response
    raise RuntimeError(f"external engine {url} answered {last.status_code} to /server_info and /get_server_info")


def _field(info: dict, *names: str, default=1):
    for name in names:
        if info.get(name) is not None:
            return info[name]
    return default


def describe_external_engines(addrs: list[str]) -> tuple[list[str], list[int], dict]:
    """(engine URLs, GPUs per engine = tp x pp, the layout they share) of running SGLang servers."""
    urls, gpu_counts, layouts = [], [], []
    for addr in addrs:
        url = engine_url(addr)
        info = server_info(url)
        tp = int(_field(info, "tp_size", "tensor_parallel_size"))
        pp = int(_field(info, "pp_size", "pipeline_parallel_size"))
        layout = {"tp_size": tp, "pp_size": pp, "dp_size": int(_field(info, "dp_size", "data_parallel_size")),
                  "ep_size": int(_field(info, "ep_size", "expert_parallel_size")),
                  "disaggregation_mode": info.get("disaggregation_mode", "null")}
        urls.append(url)
        gpu_counts.append(tp * pp)
        layouts.append((url, layout))
    first_url, first = layouts[0]
    for url, layout in layouts[1:]:
        if layout != first:
            raise ValueError(f"external engines disagree on their layout: {first_url} has {first}, {url} has {layout}")
    if first["disaggregation_mode"] not in (None, "null"):
        raise ValueError(f"external engine {first_url} runs --disaggregation-mode {first['disaggregation_mode']}; "
                         f"prefill/decode servers need a router launched for them (use --sglang-config)")
    return urls, gpu_counts, first
