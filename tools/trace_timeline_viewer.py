"""Timeline of a rollout debug dump: one row per sample, a bar per span, a marker per event.

    python tools/trace_timeline_viewer.py runs/dump/3.pt              # writes the page, serves it
    python tools/trace_timeline_viewer.py runs/dump/3.pt --no-serve   # only writes the files

Writes ``3.trace_timeline_cache.json`` (the timeline data) and ``3.trace_timeline_viewer.html`` (a
self-contained page: no CDN, works offline) next to the dump, then serves the page on 127.0.0.1
(``--port``, default a free port; ``--host`` to change the address) until Ctrl-C. Click a bar for the
span's attributes; engine requests show their queue/prefill/decode phases in lanes of their own when
the engine reports them. Dumps come from ``--save-debug-rollout-data`` (docs/INTERFACES.md §7.5).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from slime.observability.trace_timeline import write_viewer  # noqa: E402


def serve(page: Path, host: str, port: int) -> None:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(page.parent))
    with http.server.ThreadingHTTPServer((host, port), handler) as server:
        print(f"serving http://{host}:{server.server_address[1]}/{page.name}  (Ctrl-C to stop)", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump", help="a rollout debug dump (.pt) written by --save-debug-rollout-data")
    parser.add_argument("--no-serve", action="store_true", help="write the files and exit")
    parser.add_argument("--port", type=int, default=0, help="port to serve on (default: a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    parser.add_argument("--out-dir", default=None, help="where to write the files (default: next to the dump)")
    args = parser.parse_args(argv)
    try:
        cache, page, timeline = write_viewer(args.dump, args.out_dir)
    except (FileNotFoundError, ValueError) as exc:
        parser.exit(2, f"error: {exc}\n")
    spans = sum(len(row["spans"]) for row in timeline["rows"])
    print(f"{len(timeline['rows'])} traced samples ({timeline['untraced_samples']} without trace), {spans} spans")
    print(f"wrote {cache}\nwrote {page}", flush=True)
    if not args.no_serve:
        serve(page, args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
