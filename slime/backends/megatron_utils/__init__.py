"""Megatron-Core trainer backend (imports Megatron lazily; see loss.py for the loss built-ins)."""
