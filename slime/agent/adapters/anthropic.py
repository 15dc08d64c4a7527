"""Upstream's module name for the Anthropic-speaking adapter: ``slime.agent.adapters.anthropic``."""

from slime.agent.adapters.anthropic_adapter import *  # noqa: F401,F403
from slime.agent.adapters.anthropic_adapter import AnthropicAdapter  # noqa: F401
