"""Run slime's parser (and SGLang's own) with the real SGLang argument code, in a subprocess.

scripts/setup-env.sh installs SGLang's package (pinned, without its kernels) into
``.venv/sglang-args``, off the default import path: on this CPU machine the rest of slime must not
see SGLang. A subprocess puts it on PYTHONPATH, runs the requests and sends back plain results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SGLANG_ARGS_DIR = REPO / ".venv" / "sglang-args"
SGLANG_VERSION = "0.5.23"


def _plain(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)


def run(parse: list[list[str]] = (), server_argv: list[list[str]] = ()) -> dict:
    """``parse``: argv lists for ``slime.arguments.parse_args``; ``server_argv``: SGLang command
    lines (``python -m sglang.launch_server ...``) to parse with SGLang's own ``ServerArgs`` parser."""
    if not (SGLANG_ARGS_DIR / f".installed-{SGLANG_VERSION}").exists():
        raise RuntimeError(f"SGLang {SGLANG_VERSION}'s argument code is not installed in {SGLANG_ARGS_DIR}; "
                           f"run `bash scripts/setup-env.sh`")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SGLANG_ARGS_DIR), str(REPO)]))
    request = json.dumps({"parse": list(parse), "server_argv": list(server_argv)})
    done = subprocess.run([sys.executable, "-m", "tests.backends.sglang_utils.real_sglang"], input=request,
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the SGLang probe failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _main() -> None:
    import argparse
    import contextlib
    import io

    from tests.backends.sglang_utils.sglang_env import prepare_imports

    prepare_imports()
    import sglang
    from sglang.srt.server_args import ServerArgs

    from slime.arguments import parse_args

    request = json.loads(sys.stdin.read())
    out = {"sglang_version": sglang.__version__, "parse": [], "server_argv": []}
    for argv in request["parse"]:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = parse_args(argv)
            out["parse"].append({"ok": True, "args": {k: _plain(v) for k, v in vars(args).items()}})
        except (SystemExit, Exception) as e:
            out["parse"].append({"ok": False, "error": f"{type(e).__name__}: {e}\n{err.getvalue()}"})
    for argv in request["server_argv"]:
        parser = argparse.ArgumentParser(allow_abbrev=False)
        ServerArgs.add_cli_args(parser)
        err = io.StringIO()
        assert argv[1:3] == ["-m", "sglang.launch_server"], argv[:3]
        try:
            with contextlib.redirect_stderr(err):
                parsed = parser.parse_args(argv[3:])
            out["server_argv"].append({"ok": True, "fields": {k: _plain(v) for k, v in vars(parsed).items()}})
        except SystemExit:
            out["server_argv"].append({"ok": False, "error": err.getvalue()})
    print(json.dumps(out))


if __name__ == "__main__":
    _main()
