"""`flowrl profile` (to be implemented)."""
