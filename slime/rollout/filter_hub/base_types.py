"""Return type of dynamic-sampling filters and the drop decision the default rollout applies."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicFilterOutput:
    """Verdict of a dynamic-sampling filter on one finished prompt group.

    keep: keep the group in the batch.
    reason: why it was dropped; counted as ``rollout/dynamic_filter/drop_<reason>``.
    keep_when_insufficient: keep it anyway when dropping would leave too few candidate groups.
    """

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def as_dynamic_filter_output(value) -> DynamicFilterOutput:
    """Accept a ``DynamicFilterOutput`` or a bare bool (legacy filters)."""
    if isinstance(value, DynamicFilterOutput):
        return value
    if isinstance(value, bool):
        return DynamicFilterOutput(keep=value)
    raise TypeError(f"dynamic sampling filter must return DynamicFilterOutput or bool, got {type(value).__name__}")


def call_dynamic_filter(dynamic_filter, args, samples, **kwargs) -> DynamicFilterOutput:
    """Run a ``--dynamic-sampling-filter-path`` function on one finished prompt group and return its
    verdict as a ``DynamicFilterOutput`` (a bare bool is wrapped); any other return raises, naming
    the filter."""
    value = dynamic_filter(args, samples, **kwargs)
    try:
        return as_dynamic_filter_output(value)
    except TypeError as e:
        name = getattr(dynamic_filter, "__qualname__", repr(dynamic_filter))
        raise TypeError(f"--dynamic-sampling-filter-path {getattr(dynamic_filter, '__module__', '?')}.{name}: {e}") from None


def should_drop_dynamic_filter_output(
    output: DynamicFilterOutput, *, remaining_batch_size: int, target_data_size: int
) -> bool:
    """Drop unless kept, or unless ``keep_when_insufficient`` and candidates no longer exceed the target."""
    if output.keep:
        return False
    if output.keep_when_insufficient and remaining_batch_size <= target_data_size:
        return False
    return True
