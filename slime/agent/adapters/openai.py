"""Upstream's module name for the OpenAI-speaking adapter: ``slime.agent.adapters.openai``."""

from slime.agent.adapters.openai_adapter import *  # noqa: F401,F403
from slime.agent.adapters.openai_adapter import OpenAIAdapter, translate_chat, translate_responses  # noqa: F401
