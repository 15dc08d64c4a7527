"""Small shared helpers: the plugin loader and a singleton metaclass."""

from __future__ import annotations

import importlib
import threading


def load_function(path: str):
    """Resolve a dotted path ``package.module.attr`` to the object it names.

    The path is split at its last dot; the left part is imported with ``importlib.import_module``
    and the right part read with ``getattr``. ``module:attr`` is accepted as an alias. Errors name
    the path, the module tried and what was missing.
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"expected a dotted path 'package.module.attr', got {path!r}")
    path = path.strip()
    if ":" in path:
        module_name, _, attr = path.rpartition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"cannot load {path!r}: expected a dotted path 'package.module.attr' with at least one dot "
            f"separating the module from the attribute"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ImportError(
            f"cannot load {path!r}: module {module_name!r} could not be imported ({e}). "
            f"Is the module on PYTHONPATH (the job's working directory is)?"
        ) from e
    try:
        return getattr(module, attr)
    except AttributeError:
        public = sorted(n for n in dir(module) if not n.startswith("_"))
        hint = f"; it defines {public[:20]}" if public else ""
        raise AttributeError(
            f"cannot load {path!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no attribute "
            f"{attr!r}{hint}"
        ) from None


class SingletonMeta(type):
    """Metaclass giving one instance per class (per process); ``clear_instances()`` resets them."""

    _instances: dict = {}
    _lock = threading.Lock()

    def __call__(cls, *args, **kwargs):
        with SingletonMeta._lock:
            if cls not in SingletonMeta._instances:
                SingletonMeta._instances[cls] = super().__call__(*args, **kwargs)
            return SingletonMeta._instances[cls]

    @staticmethod
    def clear_instances() -> None:
        with SingletonMeta._lock:
            SingletonMeta._instances.clear()


def custom_config_value(args, key: str, default=None):
    """A setting that only ``--custom-config-path``'s YAML puts on ``args`` (it is no flag), else ``default``."""
    return getattr(args, key, default)
