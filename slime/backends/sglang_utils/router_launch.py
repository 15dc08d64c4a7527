"""Routers for the engines of a launch plan: one smg router per model, or registration with an
existing router (``--sglang-router-ip/port``).

A regular model's router starts with ``--worker-urls``; a prefill/decode model's with
``--pd-disaggregation --prefill URL BOOTSTRAP_PORT ... --decode URL ...``. Registration with a
running router is ``POST /workers`` with ``{"url", "worker_type", ["bootstrap_port"]}``
(docs/SGLANG_PROTOCOL.md §11.3); a worker already registered is not an error.
"""

from __future__ import annotations

import logging

from slime.backends.sglang_utils.launch_plan import EnginePlan

logger = logging.getLogger(__name__)


def router_argv(args) -> tuple[str, list[str]]:
    """The routing policy (the router's own default unless --router-policy) and the other --router-* flags."""
    forwarded = dict(args.router_passthrough or {})
    policy = forwarded.pop("policy", "cache_aware")
    argv = []
    for name, value in forwarded.items():
        if value is True:
            argv.append(f"--{name}")
        elif isinstance(value, list) and value and all(isinstance(v, list) for v in value):  # append action
            for item in value:
                argv += [f"--{name}", *map(str, item)]
        elif isinstance(value, list):
            argv += [f"--{name}", *map(str, value)]
        else:
            argv += [f"--{name}", str(value)]
    return policy, argv


def pd_argv(engines: list[EnginePlan]) -> list[str]:
    """``--pd-disaggregation --prefill URL PORT ... --decode URL ...`` for one model's engines."""
    argv = ["--pd-disaggregation"]
    for engine in engines:
        if engine.worker_type == "prefill":
            argv += ["--prefill", engine.url, str(engine.bootstrap_port)]
        elif engine.worker_type == "decode":
            argv += ["--decode", engine.url]
    return argv


def launch_router(args, engines: list[EnginePlan], host: str = "127.0.0.1"):
    """Start an smg router in front of one model's engines; returns the running RouterProcess."""
    from slime.backends.router import RouterProcess

    policy, extra = router_argv(args)
    extra += ["--request-timeout-secs", str(args.sglang_router_request_timeout_secs)]
    if any(e.worker_type in ("prefill", "decode") for e in engines):
        router = RouterProcess(policy=policy, host=host, extra_args=extra + pd_argv(engines))
        router.start()
        router.wait_healthy(timeout=120)
        for engine in engines:
            router._wait_worker(engine.url, present=True, timeout=120)
    else:
        router = RouterProcess(policy=policy, worker_urls=[e.url for e in engines], host=host, extra_args=extra)
        router.start()
        router.wait_healthy(timeout=120)
    return router


def register_workers(router_url: str, registrations: list[dict], timeout: float = 60.0) -> None:
    """``POST /workers`` each body to a running router (an external one, or after a restart)."""
    import httpx

    for body in registrations:
        response = httpx.post(f"{router_url}/workers", json=body, timeout=timeout)
        if response.status_code >= 400 and "WORKER_ALREADY_EXISTS" not in response.text:
            raise RuntimeError(f"registering engine {body['url']} with the router at {router_url} failed: "
                               f"{response.status_code} {response.text[:300]}")
