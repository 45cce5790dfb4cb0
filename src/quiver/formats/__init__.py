"""File formats (docs/FORMAT.md): the `.qctx` context binary and `.qsec` section readers and writers, their
layout, checksums and deflated skeletons, tuned configurations in a header, AIMET encodings, and opening and
mapping files safely (bounded reads, guarded mappings, private copies)."""
