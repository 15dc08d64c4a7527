"""Dynamic-sampling filters (docs/INTERFACES.md §2.5)."""
