"""`flowrl export` (to be implemented)."""
