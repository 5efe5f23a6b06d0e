"""flowrl's built-in plugins (installed as ``flowrl_plugins``).

Each module is an ordinary plugin, registered through the ``flowrl`` entry-point group in
pyproject.toml exactly as a third-party plugin would be. Their hook implementations are
``trylast`` so that third parties can override the defaults.
"""
