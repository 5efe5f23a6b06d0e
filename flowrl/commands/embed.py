"""``flowrl embed``: encode a recipe's prompts once and keep them on disk.

::

    flowrl embed recipes/chunk_grpo_flux.toml -o runs/embeddings/chunk_grpo_flux
    flowrl train recipes/chunk_grpo_flux.toml --set prompts.embeddings=runs/embeddings/chunk_grpo_flux

It loads the recipe's model as training does, encodes every distinct prompt of the training
source, of the evaluation pool, of an offline run's ``[data]`` table and of each ``--prompts``
file, one at a time, exactly as a
run's prompt cache would (under the training loop's attention,
:func:`flowrl.train.accel.loop_attention`: the recipe's ``[train].attention_backend`` with math
for what it has no kernel for), and writes them as a store (:mod:`flowrl.embeddings`). A recipe with
``[prompts] embeddings = "DIR"`` then reads them back: the diffusers models load no text encoder
or tokenizer (FLUX.1's T5-XXL alone is 9.5 GB in bf16), and the run equals one that encodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .base import DeviceOpt, RecipeArg, SetOpt, app, console, load


@app.command()
def embed(
    recipe: RecipeArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="A new directory for the embeddings.")],
    prompts_file: Annotated[Optional[list[Path]], typer.Option(
        "--prompts", help="Another prompt file to embed as well (a text file, one prompt a line, or a table read as "
                          "the recipe's [prompts] names its columns). Repeatable.")] = None,
    set_: SetOpt = None,
    device: DeviceOpt = None,
) -> None:
    """Encode the recipe's prompts once and keep them: `[prompts] embeddings = DIR` then loads no text encoder."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..embeddings import recipe_fingerprint, write_store
    from ..errors import FlowrlError
    from ..offline import read_offline_rows
    from ..prompts import read_prompts
    from ..train.accel import check_attention_backend, loop_attention
    from ..train.session import Session

    output = Path(output)
    if output.exists():
        raise FlowrlError(f"{output} exists", where="--output",
                          hint="give a new directory: a store is written whole, never added to")
    cfg = load(recipe, [*(set_ or []), "prompts.embeddings=''"])  # encode, whatever store the recipe names
    p = cfg.prompts
    if p.condition_column:
        raise FlowrlError("the prompts carry condition images ([prompts].condition_column): a store keeps prompt "
                          "text only", where=f"{cfg.source}: [prompts].condition_column",
                          hint="image-editing runs encode their prompts as they come")
    from ..distributed import resolve_device
    from ..files import ensure_writable

    # what can be refused without the model, refused before it loads (minutes for a large one)
    ensure_writable(output, where="--output", directory=True)
    extra_texts = [str(x) for extra in prompts_file or [] for x in read_prompts(str(extra), None, "--prompts", p,
                                                                              role="eval")]
    session = Session.open(cfg, rewards=False, trackers=False,
                           device=resolve_device(device, where="--device") if device else cfg.run.device)
    model = session.model
    texts = [str(x) for x in read_prompts(p.source, model, f"{cfg.source}: [prompts].source", p)]
    if p.num_eval or p.eval_source:  # the whole evaluation pool: `flowrl eval` and `sample` read it too
        texts += [str(x) for x in read_prompts(p.eval_source or p.source, model, f"{cfg.source}: [prompts]", p,
                                               role="eval")]
    if cfg.data.enabled:  # an offline run trains on its table's prompts
        texts += read_offline_rows(cfg.data.path, f"{cfg.source}: [data].path").prompts
    texts = list(dict.fromkeys(texts + extra_texts))
    check_attention_backend(cfg.train.attention_backend, session.device, cfg.source)
    with loop_attention(cfg.train.attention_backend, session.device, cfg.source), Progress(TextColumn("[bold]embedding prompts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("embed", total=len(texts))

        def rows():
            for text in texts:
                yield text, session.cache.encode(text)
                progress.advance(task)

        try:
            count = write_store(output, rows(), recipe_fingerprint(cfg))
        except OSError as exc:
            raise FlowrlError(f"cannot write the embeddings to {output}: {exc.strerror or exc}", where="--output",
                              hint="give a directory you can write to") from None
    size = sum(f.stat().st_size for f in output.iterdir())
    console.print(f"wrote {count} prompt embeddings ({size / 2**20:.1f} MiB) to {output}", markup=False)
    console.print(f'use them: [prompts] embeddings = "{output}" in the recipe (relative to its file), or '
                  f"--set prompts.embeddings={output}", markup=False)
