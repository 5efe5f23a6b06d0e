"""`flowrl zoo` (to be implemented)."""
