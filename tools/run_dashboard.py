"""Plots of a run without wandb: ``python tools/run_dashboard.py RUN_DIR [--out-dir DIR]``.

Same as ``python -m slime.observability.dashboard``: reward, response length, KL, entropy, losses,
step-time breakdown and throughput from ``RUN_DIR/metrics.jsonl`` as PNGs plus ``index.html`` in
``RUN_DIR/dashboard/``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from slime.observability.dashboard import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
