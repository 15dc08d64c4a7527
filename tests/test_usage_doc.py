from pathlib import Path

from slime.arguments import flag_reference_markdown


def test_usage_doc_lists_every_flag():
    doc = (Path(__file__).parents[1] / "docs" / "usage.md").read_text()
    assert flag_reference_markdown() in doc, "docs/usage.md is stale: regenerate its flag section with `python -m slime.arguments`"
