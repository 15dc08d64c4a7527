"""Profile the inference engines of a running rollout through their ``/start_profile`` / ``/stop_profile``.

    python tools/profile_rollout.py --router-url http://127.0.0.1:3000 --action start --num-steps 20 \\
        --output-dir /tmp/rollout_profile
    python tools/profile_rollout.py --router-url http://127.0.0.1:3000 --action stop   # without --num-steps

The engines are listed through the router (``GET /workers``, docs/SGLANG_PROTOCOL.md §11.3; the router
does not forward profiling calls) or given with ``--engine-urls``. Each engine writes its own
Chrome-trace files (``engine<i>-<profile_id>-TP-0[-STAGE].trace.json``) into ``--output-dir`` on its
own machine; open them in chrome://tracing or https://ui.perfetto.dev. SGLang engines and the
embedded engine answer the same request (``ProfileReq``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import httpx


def list_engine_urls(router_url: str, timeout: float = 10.0) -> list[str]:
    """Worker URLs registered with the router (current ``/workers`` API, else the legacy ``/list_workers``)."""
    router_url = router_url.rstrip("/")
    response = httpx.get(f"{router_url}/workers", timeout=timeout)
    if response.status_code == 404:
        response = httpx.get(f"{router_url}/list_workers", timeout=timeout)
        response.raise_for_status()
        return list(response.json().get("urls", []))
    response.raise_for_status()
    return [worker["url"] for worker in response.json().get("workers", [])]


def profile_request(args, engine_index: int, profile_id: str) -> dict:
    prefix = f"{args.profile_prefix}-engine{engine_index}" if args.profile_prefix else f"engine{engine_index}"
    body = {"output_dir": os.path.abspath(args.output_dir), "activities": args.activities,
            "profile_by_stage": args.profile_by_stage, "with_stack": args.with_stack,
            "record_shapes": args.record_shapes, "profile_id": profile_id, "profile_prefix": prefix}
    if args.num_steps is not None:
        body["num_steps"] = args.num_steps
    if args.start_step is not None:
        body["start_step"] = args.start_step
    if args.profile_stages:
        body["profile_stages"] = args.profile_stages
    return body


def drive(args) -> list[tuple[str, int, str]]:
    """Send the action to every engine; returns (url, status code, answer text) per engine."""
    urls = args.engine_urls or list_engine_urls(args.router_url)
    if not urls:
        raise SystemExit(f"no engines registered with the router at {args.router_url} (GET /workers is empty)")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    profile_id = args.profile_id or time.strftime("%Y%m%d-%H%M%S")
    results = []
    for index, url in enumerate(urls):
        url = url.rstrip("/")
        if args.action == "start":
            response = httpx.post(f"{url}/start_profile", json=profile_request(args, index, profile_id),
                                  headers=headers, timeout=args.timeout)
        else:
            response = httpx.post(f"{url}/stop_profile", json={}, headers=headers, timeout=args.timeout)
        results.append((url, response.status_code, response.text.strip()))
    return results


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--router-url", help="the router in front of the engines (http://host:port)")
    where.add_argument("--engine-urls", nargs="+", help="engine URLs, instead of asking a router")
    parser.add_argument("--action", choices=["start", "stop"], required=True)
    parser.add_argument("--num-steps", type=int, default=None,
                        help="stop by itself after this many engine forward steps (per stage with "
                             "--profile-by-stage); without it, profile until --action stop")
    parser.add_argument("--start-step", type=int, default=None, help="engine step at which recording begins")
    parser.add_argument("--output-dir", default="rollout_profile",
                        help="directory (on the engines' machines) the trace files go to")
    parser.add_argument("--activities", nargs="+", default=["CPU", "GPU"], choices=["CPU", "GPU", "MEM", "RPD"])
    parser.add_argument("--profile-by-stage", action="store_true",
                        help="profile prefill and decode separately, --num-steps forwards each")
    parser.add_argument("--profile-stages", nargs="+", choices=["prefill", "decode"], default=None)
    parser.add_argument("--with-stack", action="store_true", help="record Python stacks (larger files)")
    parser.add_argument("--record-shapes", action="store_true", help="record operator input shapes")
    parser.add_argument("--profile-id", default=None, help="name shared by this profile's files (default: time)")
    parser.add_argument("--profile-prefix", default=None, help="prefix of the file names")
    parser.add_argument("--api-key", default=os.environ.get("SLIME_ENGINE_API_KEY"),
                        help="engines' admin/api key (default: $SLIME_ENGINE_API_KEY)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each engine's answer")
    args = parser.parse_args(argv)
    if args.action == "stop" and (args.num_steps is not None or args.profile_by_stage):
        parser.error("--num-steps and --profile-by-stage belong to --action start")
    if args.profile_by_stage and args.num_steps is None:
        parser.error("--profile-by-stage needs --num-steps (forwards recorded per stage)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    failed = 0
    for url, status, text in drive(args):
        print(f"{url}: {status} {text}")
        failed += status != 200
    if args.action == "start" and not failed:
        where = os.path.abspath(args.output_dir)
        when = f"after {args.num_steps} steps" if args.num_steps else "at --action stop"
        print(f"profiling; trace files appear in {where} {when}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
