"""Run dashboard without wandb: ``metrics.jsonl`` of a run directory -> PNG plots + one HTML page.

    python -m slime.observability.dashboard RUN_DIR [--out-dir DIR]
    python tools/run_dashboard.py RUN_DIR

Reads the records :class:`slime.utils.tracking.Tracker` writes (``{"kind", "step", "time", key:
value...}``) and draws, when the run logged them: reward, response length, KL, entropy, losses, the
step-time breakdown (``perf/*_time``, stacked per step, with the whole step's time as a line) and
throughput. Files go to ``RUN_DIR/dashboard/`` (``<panel>.png`` and ``index.html``, which embeds
the images so it can be mailed or opened anywhere). Rendering uses matplotlib's Agg backend: no
display needed.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Panel:
    name: str  # file name (without .png)
    title: str
    patterns: tuple[str, ...]  # regexes over metric keys, matched in full
    ylabel: str = ""
    stacked: bool = False  # step-time breakdown: stacked bars + total line


PANELS = (
    Panel("reward", "Reward", (r"rollout/raw_reward/mean", r"rollout/rewards/mean", r"eval/(?!.*truncated_ratio)[^/]+",
                               r"train/reward.*"), "reward"),
    Panel("response_length", "Response length", (r"rollout/response_len/(mean|max|median)",
                                                 r"eval/[^/]+/response_len/mean"), "tokens"),
    Panel("kl", "KL", (r"train/ppo_kl", r"train/kl_loss", r"rollout/kl", r"train/kl.*"), "KL"),
    Panel("entropy", "Entropy", (r"train/entropy.*", r"rollout/entropy.*"), "nats / token"),
    Panel("loss", "Losses and gradient norm", (r"train/loss", r"train/pg_loss", r"train/critic-value_loss",
                                                r"train/grad_norm", r"train/pg_clipfrac"), ""),
    # the loop's phases only (they add up to the step); sub-phases such as perf/actor_train_time (or the offload
    # phases inside perf/update_weights_time) would count twice. Colocated offloading's release of the engines and
    # onload of the trainer run between rollout and train, outside both
    Panel("step_time", "Step time breakdown",
          (r"perf/(rollout|offload_rollout|onload_train|train|update_weights|save|eval)_time",),
          "seconds", stacked=True),
    Panel("throughput", "Throughput", (r"perf/.*tokens_per_gpu_per_sec", r"perf/.*tok_per_s",
                                       r"perf/update_weights_gbytes_per_s"), "per second"),
)
TOTAL_TIME_KEY = "perf/step_time"


def read_metrics(path: Path) -> dict[str, dict[int, float]]:
    """{metric key: {step: value}}; a key logged under several kinds keeps the ``perf`` one, else the
    first; a step logged twice (a resumed run) keeps its last value."""
    series: dict[str, dict[int, float]] = {}
    owner: dict[str, str] = {}
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not a JSON line ({exc.msg})") from None
            kind, step = record.get("kind"), record.get("step")
            if not isinstance(step, int):
                raise ValueError(f"{path}:{line_no}: record without an integer 'step': {line[:120]!r}")
            for key, value in record.items():
                if key in ("kind", "step", "time") or not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                if key not in owner or (kind == "perf" and owner[key] != "perf"):
                    owner[key] = kind
                    series[key] = {}
                if owner[key] == kind:
                    series[key][step] = float(value)
    return series


def panel_keys(panel: Panel, keys) -> list[str]:
    matched = [k for k in sorted(keys) if any(re.fullmatch(p, k) for p in panel.patterns)]
    if panel.stacked:
        matched = [k for k in matched if k != TOTAL_TIME_KEY]
    return matched


def _plot(panel: Panel, series: dict, keys: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=110)
    if panel.stacked:
        steps = sorted({s for k in keys for s in series[k]} | set(series.get(TOTAL_TIME_KEY, {})))
        bottom = [0.0] * len(steps)
        for key in keys:
            heights = [series[key].get(s, 0.0) for s in steps]
            ax.bar(steps, heights, bottom=bottom, label=key.removeprefix("perf/"), width=0.8)
            bottom = [b + h for b, h in zip(bottom, heights)]
        if TOTAL_TIME_KEY in series:
            total = series[TOTAL_TIME_KEY]
            ax.plot(sorted(total), [total[s] for s in sorted(total)], "k.-", label="step_time (whole step)")
    else:
        for key in keys:
            points = sorted(series[key].items())
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o" if len(points) < 30 else None,
                    markersize=3, label=key)
    ax.set_title(panel.title)
    ax.set_xlabel("rollout step")
    if panel.ylabel:
        ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _last_values_table(series: dict) -> str:
    rows = []
    for key in sorted(series):
        points = series[key]
        if points:
            step = max(points)
            rows.append(f"<tr><td>{html.escape(key)}</td><td>{step}</td><td>{points[step]:.6g}</td></tr>")
    return "\n".join(rows)


def render_dashboard(run_dir: str | Path, out_dir: str | Path | None = None) -> dict:
    """Write the PNGs and ``index.html``; returns {"html": path, "plots": {panel name: path}}."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl" if run_dir.is_dir() else run_dir
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics}: no metrics.jsonl (the run directory is --run-dir of train.py)")
    series = read_metrics(metrics)
    if not series:
        raise ValueError(f"{metrics}: no numeric metrics logged yet")
    out = Path(out_dir) if out_dir else metrics.parent / "dashboard"
    out.mkdir(parents=True, exist_ok=True)
    plots, sections = {}, []
    for panel in PANELS:
        keys = panel_keys(panel, series)
        if not keys:
            continue
        path = out / f"{panel.name}.png"
        _plot(panel, series, keys, path)
        plots[panel.name] = path
        image = base64.b64encode(path.read_bytes()).decode()
        sections.append(f'<figure id="{panel.name}"><img alt="{html.escape(panel.title)}" '
                        f'src="data:image/png;base64,{image}"><figcaption>{html.escape(", ".join(keys))}'
                        f"</figcaption></figure>")
    steps = sorted({s for points in series.values() for s in points})
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>slime run {html.escape(str(metrics.parent))}</title>
<style>body{{font:13px system-ui,sans-serif;margin:16px;color:#1f2328}} .grid{{display:flex;flex-wrap:wrap;gap:12px}}
figure{{margin:0;border:1px solid #e3e5e8;padding:6px;background:#fff}} figcaption{{color:#57606a;font-size:11px;
max-width:820px}} table{{border-collapse:collapse}} td{{padding:1px 8px;border-bottom:1px solid #eef0f2}}</style>
</head><body>
<h1>{html.escape(str(metrics.parent))}</h1>
<p>{len(steps)} steps ({steps[0]}–{steps[-1]}), {len(series)} metrics; rendered {time.strftime("%Y-%m-%d %H:%M:%S")}
from {html.escape(str(metrics))}.</p>
<div class="grid">{"".join(sections)}</div>
<h2>Last values</h2><table><tr><th>metric</th><th>step</th><th>value</th></tr>
{_last_values_table(series)}</table>
</body></html>
"""
    index = out / "index.html"
    index.write_text(page)
    return {"html": index, "plots": plots}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Plots of a run's metrics.jsonl (PNG + one HTML page).")
    parser.add_argument("run_dir", help="the run directory (--run-dir) or its metrics.jsonl")
    parser.add_argument("--out-dir", default=None, help="where to write (default: RUN_DIR/dashboard)")
    args = parser.parse_args(argv)
    try:
        result = render_dashboard(args.run_dir, args.out_dir)
    except (FileNotFoundError, ValueError) as exc:
        parser.exit(2, f"error: {exc}\n")
    for name, path in result["plots"].items():
        print(f"{name}: {path}")
    print(f"wrote {result['html']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
