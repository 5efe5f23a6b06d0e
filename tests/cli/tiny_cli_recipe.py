"""The one-iteration recipe the CLI tests train before they run a command on its run directory:
the randomly initialised embedded model, 4 sampling steps, 2 prompts x 2 samples, a checkpoint
at the end. Each test names its run and seed, its ``[prompts]`` table and its rewards."""

from __future__ import annotations

AREA = '[[rewards]]\nuse = "area"\n'


def tiny_recipe(name: str, seed: int, *, prompts: str = "num_eval = 2\neval_seeds = 1", rewards: str = AREA) -> str:
    return f"""
[run]
name = "{name}"
seed = {seed}
device = "cpu"

[model]
use = "embedded"
random_init = true

[sampler]
steps = 4

[chunker]
use = "fixed"
size = 1

[train]
iterations = 1
prompts_per_iteration = 2
group_size = 2
micro_batch_size = 2

[prompts]
{prompts}

[log]
progress = false
image_every = 0

[checkpoint]
every = 1

{rewards}"""


def train_in_process(*args: str, capsys) -> tuple[int, str]:
    """``flowrl train ARGS`` through flowrl.cli.main in this process: (exit code, stderr)."""
    from flowrl import cli

    capsys.readouterr()
    try:
        cli.main(["train", *args])
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err
