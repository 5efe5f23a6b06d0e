"""``flowrl reward serve NAME``: run any registered reward as a small HTTP server.

The trainer then scores through the ``http`` reward (``url = "http://HOST:PORT"``), so a reward
whose dependencies clash with the trainer's (HPSv3's transformers pin) runs in its own
environment, or on another GPU or machine. Protocol: :mod:`flowrl.reward_protocol`.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from .base import app, registry

reward_app = typer.Typer(name="reward", help="Reward utilities: serve a reward over HTTP.", no_args_is_help=True)
app.add_typer(reward_app, name="reward")


def build_reward(name: str, settings: list[str]):
    """Build reward ``name`` from ``key=value`` settings (TOML values), validated like a recipe."""
    from ..errors import RecipeError
    from ..recipe import component_choice, tomllib

    table: dict = {"use": name}
    for text in settings:
        if "=" not in text:
            raise RecipeError(f"setting '{text}' must look like key=value", where="--set",
                              hint="e.g. --set device=cuda:1 --set scale=cosine")
        key, raw = (part.strip() for part in text.split("=", 1))
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # bare words are strings, as in `flowrl train --set`
        table[key] = value
    choice = component_choice(registry(), "reward", table, "flowrl reward serve")
    return registry().get("reward", name).build(choice.params)


@reward_app.command("serve")
def serve(
    name: Annotated[str, typer.Argument(help="A registered reward (see `flowrl plugins`).")],
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", "-s", help="A reward parameter: key=value (TOML value). Repeatable.")
    ] = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (127.0.0.1 = this machine only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", help="Port to listen on; 0 picks a free one.")] = 8700,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every request.")] = False,
) -> None:
    """Serve reward NAME over HTTP for the `http` reward (GET /health, POST /score)."""
    from ..reward_protocol import make_server

    reward = build_reward(name, list(set_ or []))
    server = make_server(reward, name=name, host=host, port=port, verbose=verbose)
    # Printed (and flushed) only once the socket is bound, so scripts can wait for this line.
    print(f"serving reward '{name}' on {server.url} (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
