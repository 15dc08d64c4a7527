"""Every dotted path docs/INTERFACES.md names (``slime.…`` / ``examples.…``) imports: users' scripts and
command lines refer to these by string (``--rollout-function-path slime.rollout.forge_load.generate_rollout``)."""

import importlib
import re
from pathlib import Path

INTERFACES = Path(__file__).resolve().parents[1] / "docs" / "INTERFACES.md"


def _resolve(dotted: str):
    """The object at ``dotted``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def test_every_path_the_interface_names_resolves():
    paths = sorted(set(re.findall(r"`((?:slime|examples)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", INTERFACES.read_text())))
    assert len(paths) > 50  # the document's hooks, built-ins and helpers
    missing = []
    for path in paths:
        try:
            _resolve(path)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{path} ({exc!r})")
    assert not missing, "named in docs/INTERFACES.md but not importable:\n" + "\n".join(missing)
