"""Per-stage store layouts: what each stage writes and reads back (arrays, attributes, progress)."""
