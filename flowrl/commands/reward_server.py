"""`flowrl reward_server` (to be implemented)."""
