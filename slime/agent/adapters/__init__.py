"""HTTP adapters that let OpenAI- and Anthropic-speaking agents drive the policy (docs/INTERFACES.md §6)."""

from slime.agent.adapters.anthropic_adapter import AnthropicAdapter
from slime.agent.adapters.common import BaseAdapter, Session, TurnRecord, call_sglang_generate
from slime.agent.adapters.openai_adapter import OpenAIAdapter

__all__ = ["AnthropicAdapter", "BaseAdapter", "OpenAIAdapter", "Session", "TurnRecord", "call_sglang_generate"]
