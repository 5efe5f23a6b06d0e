"""A rollout process (``[pipeline] worker = "process"``): the behaviour policy in a process of its
own, on a device of its own, beside the training process that owns it.

The training process (the learner) starts one rollout process, with multiprocessing's ``spawn``
(safe after CUDA has started), and talks to it over one pipe, strictly in turn:

- ``weights``: the learner's trainable parameters (CPU copies), sent at every sync
  (``[pipeline].sync_every``) and once at the start (or, on resume, the checkpoint's behaviour
  weights); the process copies them into its own policy;
- ``draw``: the process collects the iteration's rollout with them (prompts, text embeddings,
  rollout, images, rewards: :func:`flowrl.train.collect.collect`, no collective) and answers with
  the :class:`~flowrl.batch.Batch` on the CPU, its phase seconds and its counted model
  work; the learner moves the batch to its own device.

The process builds the same components from the same recipe (:meth:`Session.open`, no
trackers), attaches the LoRA when the run trains one, and keeps the learner's place among the
processes (its rank and batch geometry), so that it draws exactly the samples, with exactly the
noise, that the learner's own copy would, under the loop's attention backend: a run with a rollout
process is the run with a worker thread, bit for bit on the CPU; on a GPU (measured on an H200, both
on the learner's GPU) the two agree to float32 rounding, not bit for bit.

The process ends when the learner closes the pipe, and with the learner whatever way that ends
(``PR_SET_PDEATHSIG``): killing a launcher leaves no rollout process behind. It ignores Ctrl-C
(the terminal sends it to the whole process group; the learner decides how to stop).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import time
import traceback
from typing import Any

import torch

from ..errors import FlowrlError
from ..processes import die_with_parent, spawned_children_ignore_sigint
from .accel import check_attention_backend, loop_attention
from .collect import collect
from .compute import ComputeCounter
from .finetune import prepare_trainable
from .parallel import autocast_like_accelerate
from .progress import PhaseTimer
from .run import Run
from .session import Session

__all__ = ["RolloutProcess", "rollout_device", "moved"]

#: Seconds the learner waits for a rollout process to end after closing its pipe, before killing it.
STOP_TIMEOUT = 10.0


def rollout_device(setting: str, learner: torch.device, local_rank: int) -> torch.device:
    """The device a rollout process draws on: the learner's (``""``), the CPU (``"cpu"``), or
    ``cuda:N`` offset by the learner's local rank (``N + local_rank``), so that the learners of a
    node on GPUs 0..P-1 and ``device = "cuda:P"`` put their rollout processes on GPUs P..2P-1."""
    if not setting:
        return learner
    device = torch.device(setting)
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + local_rank)
    return device


def moved(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor inside it (dataclasses, dicts, lists, tuples) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: moved(getattr(value, f.name), device) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    if isinstance(value, dict):
        return {k: moved(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not isinstance(value, range):
        items = [moved(v, device) for v in value]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    return value


@contextlib.contextmanager
def _without_main_module():
    """Processes spawned inside do not run the parent's ``__main__`` again. ``spawn`` would, so
    that the target can live there; the rollout process's target and data are flowrl's own, and a
    user's script calling :func:`flowrl.train.train` without an ``if __name__ == "__main__"``
    guard would otherwise start a second training run in the child."""
    from multiprocessing import spawn

    prepare = spawn.get_preparation_data

    def without_main(name):
        data = prepare(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    spawn.get_preparation_data = without_main
    try:
        yield
    finally:
        spawn.get_preparation_data = prepare


def _send(conn, message) -> None:
    """Send by value: the pickle's own bytes. multiprocessing would otherwise send torch tensors
    through torch's shared-memory reductions, whose descriptor-serving thread fails now and then
    when several processes do so at once (measured: a ``KeyError`` in ``resource_sharer``)."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn):
    """A message :func:`_send` sent (this run's own processes only; never a user's file)."""
    return pickle.loads(conn.recv_bytes())


class RolloutProcess:
    """The learner's handle on its rollout process: :meth:`load` the behaviour weights,
    :meth:`draw` a rollout, :meth:`close`. One call at a time (the pipeline waits for each draw
    before it sends anything else)."""

    def __init__(self, recipe, geometry, ctx, prompts, device: torch.device, learner: torch.device):
        self.learner, self.device = learner, device
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=serve, name=f"flowrl-rollout-{ctx.rank}", daemon=True,
            args=(child, os.getpid(), recipe, geometry, ctx, prompts, str(device), torch.get_num_threads()))
        with spawned_children_ignore_sigint(), _without_main_module():
            self.process.start()
        child.close()
        self._answer("ready")

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy ``weights`` (the trainable parameters, by name) into the process's policy."""
        _send(self.conn, ("weights", {k: v.detach().cpu() for k, v in weights.items()}))
        self._answer("loaded")

    def draw(self, iteration: int):
        """The iteration's rollout drawn by the process: ``(batch on the learner's device, phase
        seconds, counted work)``."""
        _send(self.conn, ("draw", iteration))
        batch, seconds, counts = self._answer("drawn")
        return moved(batch, self.learner), seconds, counts

    def abandon(self) -> None:
        """Kill the process now: what it is drawing is not wanted (the run is ending, a stopped
        run included), and a draw under way would be waited for otherwise. A thread waiting for
        its answer gets an error at once; :meth:`close` then finds it ended."""
        self.process.kill()
        self.process.join()

    def close(self) -> None:
        """End the process (it finishes what it is doing first; killed after ``STOP_TIMEOUT``)."""
        try:
            self.conn.close()
        finally:
            self.process.join(STOP_TIMEOUT)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()

    def _answer(self, expected: str):
        try:
            kind, payload = _recv(self.conn)
        except EOFError:
            self.process.join(STOP_TIMEOUT)
            raise RuntimeError(f"the rollout process ended unexpectedly (exit code {self.process.exitcode})") from None
        if kind == "refused":
            cls, message, where, hint = payload
            self.process.join(STOP_TIMEOUT)
            raise cls(f"the rollout process on {self.device}: {message}", where=where, hint=hint)
        if kind == "error":
            raise RuntimeError(f"the rollout process failed:\n{payload}")
        if kind != expected:
            raise RuntimeError(f"the rollout process answered {kind!r}, expected {expected!r}")
        return payload


def serve(conn, parent_pid: int, recipe, geometry, ctx, prompts, device: str, threads: int) -> None:
    """The rollout process: build the behaviour policy, then answer the learner until it closes
    the pipe."""
    die_with_parent(parent_pid)
    torch.set_num_threads(threads)
    try:
        run, counter = _build(recipe, geometry, ctx, torch.device(device))
        params = dict(run.session.model.denoiser.named_parameters())
        _send(conn, ("ready", None))
    except FlowrlError as error:  # a refusal (a backend or extra this device lacks): the learner's to report
        _send(conn, _refusal(error))
        return
    except BaseException:
        _send(conn, ("error", traceback.format_exc()))
        return
    while True:
        try:
            message = _recv(conn)
        except EOFError:  # the learner closed the pipe: done
            return
        try:
            if message[0] == "weights":
                with torch.no_grad():
                    for name, tensor in message[1].items():
                        params[name].copy_(tensor)
                _send(conn, ("loaded", None))
            elif message[0] == "draw":
                _send(conn, ("drawn", _draw(run, counter, prompts, message[1])))
        except FlowrlError as error:  # e.g. a plan the first rollout refuses
            _send(conn, _refusal(error))
            return
        except BaseException:
            _send(conn, ("error", traceback.format_exc()))
            return


def _refusal(error: FlowrlError) -> tuple:
    """The message that has the learner raise ``error`` again (:meth:`RolloutProcess._answer`)."""
    return "refused", (type(error), error.message, error.where, error.hint)


def _build(recipe, geometry, ctx, device: torch.device):
    """The behaviour policy: the recipe's components on ``device`` (no trackers), the LoRA
    attached when the run trains one, nothing requiring grad; its forwards counted."""
    check_attention_backend(recipe.train.attention_backend, device, recipe.source)
    session = Session.open(recipe, device=device, trackers=False)
    prepare_trainable(session.model, recipe.train, recipe.run.seed)
    session.model.to(device)  # LoRA matrices are created on the CPU
    session.model.denoiser.requires_grad_(False)
    if recipe.distributed.mixed_precision == "bf16":  # the learner's policy computes under accelerate's autocast
        autocast_like_accelerate(session.model.denoiser, device)
    counter = ComputeCounter(session.model.denoiser)
    return Run(session, geometry, ctx), counter


def _draw(run: Run, counter: ComputeCounter, prompts, iteration: int):
    """One rollout, as the learner's worker thread draws it: without grad, under the attention
    backend the training loop runs in (``[train].attention_backend``); the batch on the CPU, for
    the pipe."""
    recipe = run.session.recipe
    timer = PhaseTimer(run.session.device, counter=counter)
    start = time.perf_counter()
    with torch.no_grad(), loop_attention(recipe.train.attention_backend, run.session.device, recipe.source):
        batch = collect(run, prompts, iteration, timer)
    seconds = {**timer.seconds, "total": time.perf_counter() - start}
    counts = counter.counts()
    counter.take()
    return moved(batch, torch.device("cpu")), seconds, counts
