"""What a run writes for people, on the main process: the resolved recipe, ``metrics.jsonl``
(one row per iteration), annotated image grids, and the trackers' copies.

Pictures (``RUN_DIR/images``)::

    iter_000010.png              one group of training iteration 10: its prompt, each sample's
                                 rewards and advantage; a degenerate group (every reward equal,
                                 so every advantage 0) says so. Every [log].image_every
                                 iterations, and always the last one.
    eval/iter_000010.png         the fixed evaluation set after 10 completed iterations (same
                                 prompts, same starting noise at every evaluation; at most 64
                                 images), captioned with prompt and score; one per evaluation
                                 (iter_<iterations> is the final evaluation).
    eval/evolution.png           the first few evaluation prompts (rows) across evaluations
                                 (columns, at most 8, evenly spaced): the same noise, watched
                                 while the policy trains. Redrawn at each evaluation.
    eval/strips/iter_*.png,json  what evolution.png is drawn from (those prompts' images, scores).

A video model's clips are drawn as filmstrips (frames left to right) in every PNG, and each
evaluation grid is also written as a looping animation of the same grid, frame by frame:
``eval/iter_000010.gif`` and, with the ``video`` extra, ``eval/iter_000010.mp4``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ..artefacts import ARTEFACT_MEASURES
from ..errors import counted
from ..files import write_text_atomic
from ..interfaces import NeedsRunDir, ProfilingChunker, RewindsOnResume
from ..recipe import dump_toml
from ..runlog import MetricsLog, image_grid, with_condition
from ..video import filmstrip, is_clip, mp4_available, write_gif, write_mp4
from .device_memory import peak_memory
from .inputs import record_inputs
from .run_dir import LOCK_NAME

#: Evaluation prompts shown in ``eval/evolution.png``, and at most this many evaluations.
EVOLUTION_PROMPTS, EVOLUTION_COLUMNS = 4, 8
#: At most this many images in an evaluation grid (the first ones).
EVAL_GRID_MAX = 64


class RunOutputs:
    """The run directory's human-facing files; on processes other than the main one it does nothing.

    The run's files are written here, after everything that can reject the run has passed; if
    starting a tracker fails, what was written into a fresh run directory (one holding nothing
    but its lock, :mod:`flowrl.train.run_dir`) is removed again, and the lock's release removes
    the directory it made.
    """

    def __init__(self, run_dir: Path, session, ctx, start_iteration: int, run_info: dict | None = None):
        self.run_dir = run_dir
        self.enabled = ctx.is_main
        self.image_every = session.recipe.log.image_every
        self.trackers = session.components.trackers
        self.decode = session.model.decode  # the group grid's pictures when training decoded nothing
        self.device = session.device  # memory/* of CUDA runs
        self.metrics: MetricsLog | None = None
        if not self.enabled:
            return
        existed = run_dir.exists()
        fresh = not existed or all(p.name == LOCK_NAME for p in run_dir.iterdir())
        try:
            self._open(session, start_iteration, run_info)
        except BaseException:
            if not existed:
                shutil.rmtree(run_dir, ignore_errors=True)
            elif fresh:
                for path in run_dir.iterdir():
                    if path.name == LOCK_NAME:
                        continue
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)
            raise

    def _open(self, session, start_iteration: int, run_info: dict | None) -> None:
        run_dir = self.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / "recipe.toml", dump_toml(session.recipe.to_toml_dict()))
        resumed = (run_dir / "metrics.jsonl").is_file()  # an earlier start of this run logged here
        if not resumed:
            record_inputs(session.recipe, run_dir)  # what a resume must find unchanged
        if run_info is not None:  # run constants: device, model FLOPs (flowrl.train.throughput)
            write_text_atomic(run_dir / "run_info.json", json.dumps(run_info, indent=1) + "\n")
        chunker = session.components.chunker
        if isinstance(chunker, ProfilingChunker) and chunker.needs_model:
            chunker.save_profile(run_dir / "profile.json")  # the profile measured at start
        (run_dir / "images").mkdir(exist_ok=True)
        for old in (run_dir / "images" / "eval" / "strips").glob("iter_*"):  # from iterations redone now
            if int(old.stem.removeprefix("iter_")) >= start_iteration:
                old.unlink()
        for tracker in self.trackers:
            if resumed and isinstance(tracker, RewindsOnResume):  # the iterations redone now, from 0 too
                tracker.rewind(start_iteration)
            if isinstance(tracker, NeedsRunDir):
                tracker.start(run_dir)
        self.metrics = MetricsLog(run_dir / "metrics.jsonl", resume_from=start_iteration)

    def write_iteration(self, record: dict[str, Any], seconds: dict[str, float],
                        speed: dict[str, float] | None = None) -> None:
        """Append one iteration's metrics row (``seconds`` per phase as ``time/<phase>``; on CUDA the
        run's peak memory as ``memory/*``), on disk
        when this returns, then hand it to the trackers (which also get ``speed``, the
        iteration's throughput; it is not written to the row).

        The loop writes the checkpoint only after this: a process killed at any moment never
        loses the row of an iteration that a checkpoint says is complete (resume drops rows
        from the checkpoint's iteration on)."""
        record.update({f"time/{k}": v for k, v in seconds.items()})
        record.update(peak_memory(self.device))  # CUDA: the allocator's high-water marks (flowrl.train.device_memory)
        if not self.enabled:
            return
        self.metrics.write(record)
        scalars = {k: v for k, v in record.items() if isinstance(v, float)}
        for tracker in self.trackers:
            tracker.log_metrics(record["iteration"], {**scalars, **(speed or {})})

    def write_row(self, record: dict[str, Any]) -> None:
        """Append a row that is not an iteration's (the final evaluation)."""
        if self.enabled:
            self.metrics.write(record)
            for tracker in self.trackers:
                tracker.log_metrics(record["iteration"], {k: v for k, v in record.items() if isinstance(v, float)})

    def write_group_grid(self, batch, group_size: int, last: bool = False) -> None:
        """Every ``[log].image_every`` iterations and at the last (``last``): the first group of
        the batch, its prompt as the title, each sample captioned with its rewards and advantage;
        a degenerate group (no reward spread) is marked as such. An offline batch has no group
        (its images are the table's): the evaluation grids show what the policy draws."""
        every = self.image_every
        if not self.enabled or not every or not (batch.iteration % every == 0 or last) or batch.data is not None:
            return
        n = min(group_size, len(batch.indices))
        finite = batch.advantages is not None
        caps = []
        for i in range(n):
            lines = [f"{label} {v[i]:.3f}" for label, v in list(batch.rewards.items())[:3]]
            lines.append(f"A {batch.advantages[i].mean():+.2f}" if finite else "non-finite reward")
            caps.append("\n".join(lines))
        title = f'iteration {batch.iteration}, one group of {n}: "{batch.prompts[0]}"'
        shown = batch.images[:n] if batch.images is not None else self._decoded(batch.trajectory.image_latents[:n])
        note = degenerate_note(shown, {k: v[:n] for k, v in batch.rewards.items()})
        images, caps = with_condition(filmstrip(shown), caps, batch.prompts[0])  # editing: the condition first
        grid = image_grid(images, caps, title=title + (f"\nNOTE: {note}" if note else ""))
        grid.save(self.run_dir / "images" / f"iter_{batch.iteration:06d}.png")
        for tracker in self.trackers:
            tracker.log_image(batch.iteration, "group", grid)

    def _decoded(self, latents: torch.Tensor) -> torch.Tensor:
        """The group's images for its grid when training decoded nothing (every reward scores
        latents): only the samples shown, and not counted as training's decode."""
        with torch.no_grad():
            return self.decode(latents)

    def write_eval_grids(self, iteration: int, prompts: list[str], images: torch.Tensor,
                         scores: dict[str, torch.Tensor], final: bool = False) -> None:
        """The evaluation set's images after ``iteration`` completed iterations (``images [P * S,
        3, H, W]``, or clips ``[P * S, F, 3, H, W]``, in the order of :func:`flowrl.train.evaluate.evaluation_items`), and the
        evolution picture of the first prompts over all evaluations so far."""
        if not self.enabled:
            return
        label = next(iter(scores))
        rewards = [k for k in scores if k not in ARTEFACT_MEASURES] or [label]  # every reward, in recipe order
        eval_dir = self.run_dir / "images" / "eval"
        (eval_dir / "strips").mkdir(parents=True, exist_ok=True)
        n, shown = len(prompts), min(len(images), EVAL_GRID_MAX)
        caps = [prompts[j % n] + "".join(f"\n{k} {scores[k][j]:.3f}" for k in rewards) for j in range(shown)]
        when = "final evaluation" if final else f"evaluation before iteration {iteration}"
        title = (f"{when} ({counted(iteration, 'iteration')} trained): fixed prompts and starting noise; mean "
                 + ", ".join(f"{k} {scores[k].mean():.3f}" for k in rewards))
        grid = image_grid(filmstrip(images[:shown]), caps, columns=min(n, 8), title=title)
        grid.save(eval_dir / f"iter_{iteration:06d}.png")
        if is_clip(images):  # the same grid as an animation, one frame of every clip at a time
            frames = [image_grid(images[:shown, f], caps, columns=min(n, 8), title=f"{title} (frame {f + 1})")
                      for f in range(images.shape[1])]
            write_gif(frames, eval_dir / f"iter_{iteration:06d}.gif")
            if mp4_available():
                write_mp4(frames, eval_dir / f"iter_{iteration:06d}.mp4")
        for tracker in self.trackers:
            tracker.log_image(iteration, "eval", grid)
        k = min(EVOLUTION_PROMPTS, n)
        save_strip(filmstrip(images[:k]), eval_dir / "strips" / f"iter_{iteration:06d}.png")
        meta = {"iteration": iteration, "prompts": prompts[:k], "label": label,
                "scores": [float(x) for x in scores[label][:k]]}
        write_text_atomic(eval_dir / "strips" / f"iter_{iteration:06d}.json", json.dumps(meta))
        evolution_grid(eval_dir / "strips").save(eval_dir / "evolution.png")

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        for tracker in self.trackers:
            tracker.close()


def degenerate_note(images: torch.Tensor, rewards: dict[str, torch.Tensor]) -> str:
    """A note for a group that trains nothing: every reward equal (so every advantage is 0), and
    whether its images are identical too; empty for a healthy group."""
    if not rewards or any(float(v.max() - v.min()) > 0 for v in rewards.values()):
        return ""
    values = ", ".join(f"{k} {float(v[0]):.3f}" for k, v in rewards.items())
    same = bool((images - images[:1]).abs().max() < 1 / 255)
    return (f"degenerate group: all {len(images)} {'images identical, ' if same else ''}rewards equal ({values}), "
            "advantages 0; it teaches nothing")


def save_strip(images: torch.Tensor, path: Path) -> None:
    """``images [k, 3, H, W]`` side by side at their own size, lossless (PNG)."""
    from PIL import Image

    row = torch.cat(list(images.detach().float().clamp(0, 1)), dim=2)
    Image.fromarray((row * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()).save(path)


def evolution_grid(strips: Path):
    """``evolution.png``: rows = the first evaluation prompts, columns = evaluations (at most
    :data:`EVOLUTION_COLUMNS`, evenly spaced, first and last included), each image captioned with
    its iteration and score."""
    import numpy as np
    from PIL import Image

    metas = sorted((json.loads(p.read_text()) for p in strips.glob("iter_*.json")), key=lambda m: m["iteration"])
    if len(metas) > EVOLUTION_COLUMNS:
        picks = sorted({round(i * (len(metas) - 1) / (EVOLUTION_COLUMNS - 1)) for i in range(EVOLUTION_COLUMNS)})
        metas = [metas[i] for i in picks]
    columns = []
    for m in metas:
        strip = np.array(Image.open(strips / f"iter_{m['iteration']:06d}.png").convert("RGB"))
        columns.append(torch.from_numpy(strip).permute(2, 0, 1).float().div(255).chunk(len(m["prompts"]), dim=2))
    k = min(len(c) for c in columns)
    tiles = torch.stack([columns[c][r] for r in range(k) for c in range(len(metas))])
    caps = [f"{counted(metas[c]['iteration'], 'iteration')}\n{metas[c]['label']} {metas[c]['scores'][r]:.3f}"
            for r in range(k) for c in range(len(metas))]
    return image_grid(tiles, caps, columns=len(metas), row_labels=metas[-1]["prompts"][:k],
                      title="the same prompts and starting noise at each evaluation, as training goes on")
