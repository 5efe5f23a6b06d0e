"""Built-in plugin (to be implemented): registers nothing yet."""
