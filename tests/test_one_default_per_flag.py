"""Each flag's default lives in the parser only: slime reads parsed flags as ``args.flag``, never as
``getattr(args, "flag", default)`` with a second default beside the parser's. Values that are no flag go
through a named helper that says why they may be absent (``sglang_value``, ``custom_config_value``)."""

import ast
from pathlib import Path

import slime

SLIME = Path(slime.__file__).parent


def getattr_reads(root: Path) -> list[str]:
    """``file:line name`` of each ``getattr(<args>, "<name>", ...)`` under ``root``; ``<args>`` is ``args`` or
    any ``<x>.args``; names with a leading underscore are markers slime keeps on the namespace, not flags."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and len(node.args) == 3 and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)):
                continue
            target = node.args[0]
            is_args = (isinstance(target, ast.Name) and target.id == "args") or (
                isinstance(target, ast.Attribute) and target.attr == "args")
            if is_args and not node.args[1].value.startswith("_"):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.args[1].value}")
    return found


def test_no_flag_is_read_with_a_second_default():
    assert getattr_reads(SLIME) == []


def test_a_second_default_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text('def f(args, self):\n    return getattr(args, "lr", 0.1), getattr(self.args, "x", 1), '
                                  'getattr(args, "_done", False), getattr(other, "y", 2)\n')
    assert getattr_reads(package) == ["pkg/m.py:2 lr", "pkg/m.py:2 x"]


def test_the_test_helper_holds_the_parser_defaults():
    from slime.arguments import get_parser
    from tests.parsed_args import default_args

    parser, _ = get_parser(parse_sglang=False)
    args = default_args(rollout_temperature=0.5)
    assert args.rollout_temperature == 0.5
    assert args.eps_clip == parser.get_default("eps_clip") and args.loss_type == parser.get_default("loss_type")
    assert default_args().rollout_temperature == parser.get_default("rollout_temperature")  # a fresh copy each call
