"""slime.rollout.filter_hub.base_types.call_dynamic_filter: the one way a dynamic-sampling filter is run."""

import pytest

from slime.rollout.filter_hub.base_types import DynamicFilterOutput, call_dynamic_filter


def test_call_dynamic_filter_wraps_bools_and_passes_kwargs():
    seen = {}

    def keep_all(args, samples, **kwargs):
        seen.update(args=args, samples=samples, kwargs=kwargs)
        return True

    assert call_dynamic_filter(keep_all, "ARGS", ["s"], rollout_id=3) == DynamicFilterOutput(keep=True)
    assert seen == {"args": "ARGS", "samples": ["s"], "kwargs": {"rollout_id": 3}}
    verdict = DynamicFilterOutput(keep=False, reason="zero_std")
    assert call_dynamic_filter(lambda args, samples: verdict, None, []) is verdict


def test_call_dynamic_filter_names_a_filter_with_a_bad_return():
    def bad_filter(args, samples):
        return "yes"

    with pytest.raises(TypeError, match=r"--dynamic-sampling-filter-path .*bad_filter: .*got str"):
        call_dynamic_filter(bad_filter, None, [])
