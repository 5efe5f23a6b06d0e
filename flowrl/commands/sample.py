"""`flowrl sample` (to be implemented)."""
