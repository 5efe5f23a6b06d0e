"""Serving rewards over HTTP: the wire format (:mod:`.protocol`), the dependency-free server
(:mod:`.simple`) and the LitServe reward fleet (:mod:`.fleet`, extra ``flowrl-diffusion[fleet]``).

The client is the ``http`` reward plugin (``flowrl_plugins.rewards.http``). Nothing here imports
LitServe until a fleet is started.
"""
