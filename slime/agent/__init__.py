"""slime.agent: adapters that record agent sessions as exact-token training samples (docs/INTERFACES.md §6).

``slime.agent.adapters`` (OpenAIAdapter, AnthropicAdapter), ``slime.agent.trajectory``
(TrajectoryManager, TurnRecord), ``slime.agent.parsing`` (parse_model_output) and
``slime.agent.aiohttp_threaded`` (run_app_in_thread). Nothing is imported here, so importing one
submodule does not pull in the others.
"""
