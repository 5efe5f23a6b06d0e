"""`flowrl plan` (to be implemented)."""
