"""slime.agent.harness is a package: each harness module imports on its own, and the package keeps
exporting what its single module did."""

import subprocess
import sys

import slime.agent.harness as harness


def test_each_harness_module_imports_on_its_own():
    for module in ("common", "claude_code", "codex"):
        code = f"import slime.agent.harness.{module} as m; print(m.__name__)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == f"slime.agent.harness.{module}", out.stderr


def test_the_package_exports_the_same_objects():
    from slime.agent.harness.claude_code import ClaudeCodeHarness
    from slime.agent.harness.codex import CodexHarness
    from slime.agent.harness.common import BaseHarness, HarnessContext
    from slime.agent.sandbox import exec_and_wait

    assert (harness.ClaudeCodeHarness, harness.CodexHarness) == (ClaudeCodeHarness, CodexHarness)
    assert (harness.BaseHarness, harness.HarnessContext, harness.exec_and_wait) == (BaseHarness, HarnessContext, exec_and_wait)
    assert issubclass(ClaudeCodeHarness, BaseHarness) and issubclass(CodexHarness, BaseHarness)
    assert set(harness.__all__) <= set(dir(harness))
    context = HarnessContext(workdir="/w", session_id="sid", adapter_url="http://a")
    assert CodexHarness().config_toml(context).count('base_url = "http://a/v1"') == 1
    assert ClaudeCodeHarness().settings(context)["env"]["ANTHROPIC_AUTH_TOKEN"] == "sid"
