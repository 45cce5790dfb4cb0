"""File formats: the `.qctx` context binary reader and writer (docs/FORMAT.md)."""
