"""Dynamic-sampling filters (INTERFACES §2.5)."""
