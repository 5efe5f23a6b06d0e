"""`flowrl evaluate` (to be implemented)."""
