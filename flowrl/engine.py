"""The training loop, top to bottom: one engine for the whole GRPO family.

    rollout -> rewards -> advantages -> chunk selection -> policy update -> logs and checkpoints

Step-level GRPO, GSPO, fixed chunks and Chunk-GRPO differ only in the components the recipe
names (chunker, selector, loss); nothing below branches on the algorithm.

Reproducibility: every random draw comes from a generator seeded by (seed, purpose, iteration,
global sample index) (:mod:`flowrl.seeding`), so rollouts, rewards and chunk selections do not
depend on the number of processes, and a resumed run repeats exactly what the uninterrupted one
would have done. (With ``optimizer_steps_per_update > 1`` which samples share an optimizer step
depends on the process layout; with 1 the whole update does not.)
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from . import distributed
from .checkpoint import LATEST, latest_checkpoint, load_checkpoint, save_checkpoint, set_rng_state, write_text_atomic
from .chunk_update import lean_chunk_backward
from .errors import FlowrlError
from .finetune import load_trainable_state_dict, prepare_trainable, trainable_state_dict
from .geometry import resolve_geometry
from .interfaces import TextEmbeddings, score, select_embeddings
from .plugins import get_registry
from .recipe import Recipe, dump_toml, read_toml
from .reference import ReferencePolicy, kl_backward
from .recipe import validate as validate_recipe
from .runlog import MetricsLog, image_grid
from .sampling import make_kernels, make_step_log_prob_fn, rollout, trainable_mask
from .trajectory import Trajectory
from .seeding import generator, sample_generators


@dataclasses.dataclass
class Components:
    """Everything the recipe names, built."""

    model: Any
    schedule: Any
    kernel: Any
    chunker: Any
    selector: Any
    advantage: Any
    loss: Any
    rewards: list[tuple[str, float, Any]]  # (label, weight, reward)
    trackers: list[Any]


def build_components(recipe: Recipe, registry=None) -> Components:
    registry = registry or get_registry()

    def build(section):
        choice = recipe.components[section]
        return registry.get(section, choice.use).build(choice.params)

    rewards = []
    for choice in recipe.rewards:
        reward = registry.get("reward", choice.use).build(choice.params)
        rewards.append((choice.label, choice.weight, reward))
    trackers = [registry.get("tracker", t.use).build(t.params) for t in recipe.trackers]
    return Components(
        model=build("model"),
        schedule=build("schedule"),
        kernel=build("kernel"),
        chunker=build("chunker"),
        selector=build("selector"),
        advantage=build("advantage"),
        loss=build("loss"),
        rewards=rewards,
        trackers=trackers,
    )


def build_sampler(recipe: Recipe, comps: Components, device: torch.device):
    """The sampler training uses: sigmas ``[N + 1]`` (float32, on ``device``), one kernel per
    step (the SDE kernel inside ``sde_window``, ODE outside) and T, the number of trainable
    transitions. ``flowrl profile`` calls this too, so it measures exactly this sampler."""
    n = recipe.sampler.steps
    sigmas = comps.schedule.sigmas(n, comps.model).to(device=device, dtype=torch.float32)
    window = tuple(recipe.sampler.sde_window) if recipe.sampler.sde_window else None
    kernels = make_kernels(n, comps.kernel, window)
    T = int(trainable_mask(kernels, sigmas.cpu(), recipe.sampler.image_from).sum())
    return sigmas, kernels, T


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError as exc:
        raise FlowrlError(f"invalid device '{name}'", where="[run].device", hint="'auto', 'cpu', 'cuda' or 'cuda:N'") from exc


class PhaseTimer:
    """Seconds per phase for this iteration (synchronising CUDA so the numbers are real)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[phase] += time.perf_counter() - start


class GracefulInterrupt:
    """First Ctrl-C: finish the current phase safely, checkpoint, exit. Second: stop now."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True

        try:
            self._previous = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread
            self._previous = None
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class PromptCache:
    """Text embeddings computed once per prompt and reused (users.md item 10).

    Each prompt is encoded on its own, so its embedding does not depend on which other prompts
    happened to be new in the same iteration (batched matmuls may round differently with the
    batch size): an uninterrupted run and a resumed one see bit-identical embeddings. The cost
    is one encoder call per distinct prompt over the whole run.


    The cache lives in CPU memory and keeps the ``max_prompts`` most recently used prompts, so a
    large prompt set (HPDv2 has 100k+) neither fills the GPU nor grows without bound; an evicted
    prompt is re-encoded to the identical embedding.
    """

    def __init__(self, model, max_prompts: int = 1024):
        from collections import OrderedDict

        self.model = model
        self.max_prompts = max_prompts
        self.cache: OrderedDict[str, TextEmbeddings] = OrderedDict()

    def get(self, prompts: list[str], device: torch.device | str = "cpu") -> TextEmbeddings:
        rows = {}
        for p in dict.fromkeys(prompts):
            if p in self.cache:
                self.cache.move_to_end(p)
            else:
                with torch.no_grad():
                    self.cache[p] = {k: v[:1].cpu() for k, v in self.model.encode_prompts([p]).items()}
                if len(self.cache) > self.max_prompts:
                    self.cache.popitem(last=False)
            rows[p] = self.cache[p]
        keys = rows[prompts[0]].keys()
        return {k: torch.cat([rows[p][k] for p in prompts]).to(device) for k in keys}


class OnPolicyProbe:
    """Largest per-step ``|log pi_new - log pi_old|`` seen while re-scoring, before any update.

    Wraps the step log-prob function handed to :func:`flowrl.chunk_update.lean_chunk_backward`
    and reads every recomputation of a selected transition, with or without grad (the lean
    update scores the last position of each chunk only with grad), so the check costs no extra
    forward. Before the first optimizer step every call is on-policy. It is stricter than
    looking at unit ratios: a per-step error cannot cancel inside a chunk mean.
    """

    def __init__(self):
        self.max_abs = 0.0

    def wrap(self, fn, old_lp: torch.Tensor):
        """``fn(t, b, grad)`` with ``old_lp [len(micro-batch), T]`` the rollout log-probs."""

        def probed(t: int, b: torch.Tensor, grad: bool) -> torch.Tensor:
            lp = fn(t, b, grad)
            d = float((lp.detach().float() - old_lp[b, t].float()).abs().max())
            if not d <= self.max_abs:  # also catches NaN
                self.max_abs = d
            return lp

        return probed


def read_prompts(source: str, model, where: str) -> list[str]:
    if source == "model":
        prompts = model.prompt_source()
        if not prompts:
            raise FlowrlError("the model has no prompt source of its own", where=where, hint="give a prompt file path")
        return list(prompts)
    path = Path(source)
    if not path.is_file():
        raise FlowrlError(f"prompt file not found: {path}", where=where)
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise FlowrlError(f"prompt file {path} is empty", where=where)
    return prompts


def prompts_for_iteration(prompts: list[str], seed: int, iteration: int, count: int) -> list[str]:
    """The global prompts of one iteration: epoch-wise shuffles of the list, seeded.

    The data position is fully determined by (seed, iteration), which makes resume exact.
    """
    out = []
    start = iteration * count
    for k in range(start, start + count):
        epoch, pos = divmod(k, len(prompts))
        perm = torch.randperm(len(prompts), generator=generator(seed, "data", epoch))
        out.append(prompts[int(perm[pos])])
    return out


def initial_noise(seed: int, iteration: int, indices, group_size: int, shape, same_in_group: bool) -> torch.Tensor:
    """Starting noise ``[len(indices), *shape]`` of the samples with these GLOBAL indices.

    Sample ``j`` draws from a generator seeded by (seed, iteration, j), or by its group's first
    index with ``same_in_group`` (every sample of a prompt starts from the same noise and the
    groups differ only through the SDE noise): the same on any process layout.
    """
    keys = [(j // group_size) * group_size if same_in_group else j for j in indices]
    return torch.stack([torch.randn(tuple(shape), generator=generator(seed, "noise", iteration, k)) for k in keys])


def lr_lambda(train, total_steps: int):
    def f(step: int) -> float:
        if train.warmup_steps and step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        progress = min(1.0, (step - train.warmup_steps) / max(1, total_steps - train.warmup_steps))
        if train.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        if train.lr_schedule == "linear":
            return 1.0 - progress
        return 1.0

    return f


def _eval_metrics(scores: dict[str, torch.Tensor]) -> dict[str, float]:
    """Mean and standard error of the mean of each reward over the evaluation set."""
    out = {}
    for label, v in scores.items():
        out[f"eval/{label}/mean"] = v.mean().item()
        out[f"eval/{label}/sem"] = (v.std() / math.sqrt(v.numel())).item()
    return out


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    x = x.float()
    return {
        f"{prefix}/mean": x.mean().item(),
        f"{prefix}/std": x.std(unbiased=False).item() if x.numel() > 1 else 0.0,
        f"{prefix}/min": x.min().item(),
        f"{prefix}/max": x.max().item(),
    }


def _resumable_recipe(recipe: Recipe, run_dir: Path, registry) -> None:
    """A resumed run must use the recipe that wrote it; only iterations, [log], [checkpoint]
    and [[trackers]] (what is recorded, never what is trained) may change."""
    saved = run_dir / "recipe.toml"
    if not saved.is_file():
        return
    data = read_toml(saved)
    data.pop("trackers", None)  # may change, and the old tracker's plugin need not be installed
    old = validate_recipe(data, source=str(saved), registry=registry).to_toml_dict()
    new = recipe.to_toml_dict()
    for section in ("log", "checkpoint", "trackers"):
        old.pop(section, None)
        new.pop(section, None)
    for d in (old, new):
        d["train"].pop("iterations", None)
        d["run"].pop("output_dir", None)
    if old != new:
        diff = sorted(
            f"[{s}]" for s in set(old) | set(new) if old.get(s) != new.get(s)
        )
        raise FlowrlError(
            f"the recipe differs from the one that started {run_dir} in {', '.join(diff)}",
            hint=f"resume with `flowrl train {saved} --resume {run_dir}` (only iterations, [log], [checkpoint] and [[trackers]] may change)",
        )


@torch.no_grad()
def evaluate(model, schedule_sigmas, rewards, prompts: list[str], seeds: int, seed: int, cache: PromptCache, batch: int):
    """Mean reward on a fixed prompt set with fixed noise and ODE sampling (the policy's mean)."""
    from .sde import ODEKernel

    kernels = (ODEKernel(),) * (len(schedule_sigmas) - 1)
    scores: dict[str, list[torch.Tensor]] = defaultdict(list)
    items = [(p, s) for s in range(seeds) for p in prompts]
    for start in range(0, len(items), batch):
        chunk = items[start : start + batch]
        ps = [p for p, _ in chunk]
        text = cache.get(ps, schedule_sigmas.device)
        gens = [generator(seed, "eval", i + start) for i in range(len(chunk))]
        noise = torch.stack([torch.randn(model.latent_shape, generator=g) for g in gens]).to(schedule_sigmas.device)
        traj = rollout(lambda x, s: model.velocity(x, s, text), noise, schedule_sigmas, kernels, image_from="final")
        images = model.decode(traj.image_latents)
        for label, _, reward in rewards:
            scores[label].append(score(reward, images, ps).scores)
    return {label: torch.cat(v) for label, v in scores.items()}


def _advantages(estimator, rewards, choices, groups, num_chunks: int) -> torch.Tensor:
    """``[S]`` advantages, or ``[S, K]`` when a reward weights chunks differently.

    With per-chunk weights (``[[rewards]] chunk_weights``, e.g. more weight on a preference
    reward in high-noise chunks and on a structure reward in low-noise ones), chunk k's advantage
    is the estimator's output under chunk k's weights, so both multi-reward modes keep their
    meaning. The loss then pairs each trained chunk with its own advantage.
    """
    if not any(c.chunk_weights for c in choices):
        return estimator(rewards, {c.label: c.weight for c in choices}, groups).float()
    for c in choices:
        if c.chunk_weights and len(c.chunk_weights) != num_chunks:
            raise FlowrlError(
                f"reward '{c.label}' has {len(c.chunk_weights)} chunk_weights but there are {num_chunks} chunks",
                where="[[rewards]].chunk_weights",
                hint="keep the number of chunks fixed (dynamics: num_chunks) or match the weights to it",
            )
    per_chunk = [
        estimator(rewards, {c.label: (c.chunk_weights[k] if c.chunk_weights else c.weight) for c in choices}, groups)
        for k in range(num_chunks)
    ]
    return torch.stack(per_chunk, dim=1).float()


def _share_l1rel(comps: Components, T: int, refresh: bool = False) -> None:
    """A ``weighted`` selector without its own profile takes the chunker's L1rel curve."""
    selector, chunker = comps.selector, comps.chunker
    if not hasattr(selector, "l1rel") or not hasattr(chunker, "l1rel"):
        return
    if getattr(getattr(selector, "config", None), "profile", ""):
        return  # the selector reads its own profile file
    if selector.l1rel is None or refresh:
        selector.l1rel = chunker.l1rel(T)


def _selector_l1rel(comps: Components):
    l1rel = getattr(comps.selector, "l1rel", None)
    return None if l1rel is None else [float(x) for x in l1rel]


def _update_aggregate(key: str) -> str:
    """How a per-micro-batch update metric combines over micro-batches and processes."""
    if key.endswith("min"):
        return "min"
    if key.endswith("max") or key == "recompute_mismatch":
        return "max"
    if key == "num_units":  # units trained in the iteration, whatever the micro-batching
        return "sum"
    return "mean"


def _resume_hint(run_dir: Path) -> str:
    return f"flowrl train {run_dir / 'recipe.toml'} --resume {run_dir}"


def train(
    recipe: Recipe,
    *,
    resume: Path | None = None,
    dry_run: bool = False,
    console: Console | None = None,
    registry=None,
    _fail_checkpoint_after: str | None = None,
) -> Path:
    """Run (or resume) training for a validated recipe; returns the run directory.

    ``_fail_checkpoint_after`` is a test hook: see :func:`flowrl.checkpoint.save_checkpoint`.
    """
    console = console or Console()
    registry = registry or get_registry()  # the CLI passes its own (honours --disable-plugin)
    cfg, train_cfg = recipe, recipe.train

    # ---- Setup: device, processes, batch geometry ------------------------------------------
    device = resolve_device(cfg.run.device)
    ctx = distributed.setup(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", ctx.local_rank)
    geometry = resolve_geometry(train_cfg, ctx.world_size, cfg.source)
    run_dir = Path(resume) if resume is not None else cfg.output_dir
    if ctx.is_main:
        console.print(f"[bold]flowrl[/bold] {cfg.source} -> {run_dir}")
        console.print(f"geometry: {geometry.describe()}")
        if geometry.groups_split_across_processes:
            console.print(
                f"[yellow]note:[/yellow] {geometry.prompts_per_iteration} prompts over {ctx.world_size} processes "
                "split groups across processes; advantages use the rewards gathered from all of them"
            )
    if dry_run:
        return run_dir
    if resume is not None:
        if not run_dir.is_dir():
            raise FlowrlError(f"cannot resume: {run_dir} does not exist", where="--resume")
        _resumable_recipe(recipe, run_dir, registry)
    elif (run_dir / "checkpoints" / LATEST).exists():
        raise FlowrlError(
            f"{run_dir} already holds a run with checkpoints; a new run would overwrite it",
            where="[run].output_dir",
            hint=f"continue it with `{_resume_hint(run_dir)}`, or pass another --output-dir",
        )

    # ---- Build the components the recipe names ---------------------------------------------
    comps = build_components(recipe, registry)
    model = comps.model
    model.to(device)
    sigmas, kernels, T = build_sampler(cfg, comps, device)
    train_prompts = read_prompts(cfg.prompts.source, model, f"{cfg.source}: [prompts].source")

    # ---- Chunk layout: a chunker may ask to profile the model first (dynamics chunks) -------
    if getattr(comps.chunker, "needs_model", False):
        comps.chunker.profile_at_start(comps, sigmas, kernels, train_prompts,
                                       image_from=cfg.sampler.image_from, seed=cfg.run.seed)
    try:
        sizes = distributed.broadcast_object(tuple(comps.chunker.sizes(T)), ctx)
    except ValueError as exc:
        raise FlowrlError(f"{exc} (the sampler has T = {T} trainable transitions)", where=f"{cfg.source}: [chunker]") from exc
    _share_l1rel(comps, T)
    params = prepare_trainable(model, train_cfg)
    # KL regularisation: the reference is fixed now, before any update (and before a resume
    # loads trained weights). The old-policy kind needs no reference model.
    beta, kl_kind = float(getattr(comps.loss, "beta", 0.0) or 0.0), getattr(comps.loss, "kl", "gaussian_exact")
    reference = ReferencePolicy(model) if beta > 0 and kl_kind != "old_policy_k3" else None
    optimizer = torch.optim.AdamW(
        params, lr=train_cfg.lr, betas=tuple(train_cfg.adam_betas), eps=train_cfg.adam_eps,
        weight_decay=train_cfg.weight_decay,
    )
    total_opt_steps = train_cfg.iterations * geometry.updates_per_rollout * geometry.optimizer_steps_per_update
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(train_cfg, total_opt_steps))
    eval_prompts: list[str] = []
    if cfg.prompts.num_eval:
        pool = read_prompts(cfg.prompts.eval_source or cfg.prompts.source, model, f"{cfg.source}: [prompts].eval_source")
        perm = torch.randperm(len(pool), generator=generator(cfg.run.seed, "eval-prompts"))
        eval_prompts = [pool[int(i)] for i in perm[: cfg.prompts.num_eval]]
    cache = PromptCache(model)
    first_reward = comps.rewards[0][0]

    # ---- Resume: weights, optimizer, LR schedule, RNG, position ------------------------------
    start_iteration, nonfinite_steps = 0, 0
    if resume is not None:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is not None:
            state = load_checkpoint(ckpt)
            load_trainable_state_dict(model.denoiser, state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["state"]["lr_scheduler"])
            set_rng_state(state["rng"])
            start_iteration = state["state"]["iteration"]
            saved_world = state["state"].get("world_size", ctx.world_size)
            if saved_world != ctx.world_size and train_cfg.optimizer_steps_per_update > 1 and ctx.is_main:
                console.print(
                    f"[yellow]note:[/yellow] the run was saved with {saved_world} processes and resumes with "
                    f"{ctx.world_size}; with optimizer_steps_per_update > 1 the grouping of samples into "
                    "optimizer steps changes, so the continuation is valid but not bit-identical"
                )
            nonfinite_steps = state["state"]["nonfinite_steps"]
            saved_sizes = tuple(state["state"].get("chunk_sizes", sizes))
            if saved_sizes != sizes:  # moved by adaptive re-profiling before the interruption
                comps.chunker.set_sizes(saved_sizes)
                sizes = saved_sizes
            if state["state"].get("selector_l1rel") is not None:
                comps.selector.l1rel = torch.tensor(state["state"]["selector_l1rel"], dtype=torch.float32)
            if ctx.is_main:
                console.print(f"resumed from {ckpt} at iteration {start_iteration}")
        elif ctx.is_main:
            console.print(f"[yellow]note:[/yellow] {run_dir} has no checkpoint yet; starting at iteration 0")
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / "recipe.toml", dump_toml(recipe.to_toml_dict()))
        if getattr(comps.chunker, "needs_model", False):
            comps.chunker.save_profile(run_dir / "profile.json")
        (run_dir / "images").mkdir(exist_ok=True)
        for tracker in comps.trackers:
            if hasattr(tracker, "start"):
                tracker.start(run_dir)
    metrics_log = MetricsLog(run_dir / "metrics.jsonl", resume_from=start_iteration) if ctx.is_main else None
    local = geometry.local_sample_range(ctx.rank)
    G = geometry.group_size
    per_step = geometry.micro_batch_size * geometry.grad_accumulation  # samples per optimizer step, per process

    def checkpoint(next_iteration: int) -> Path:
        return save_checkpoint(
            run_dir / "checkpoints",
            f"iter_{next_iteration:06d}",
            model=trainable_state_dict(model.denoiser),
            optimizer=optimizer.state_dict(),
            state={
                "iteration": next_iteration,
                "nonfinite_steps": nonfinite_steps,
                "lr_scheduler": scheduler.state_dict(),
                "data_position": next_iteration * geometry.prompts_per_iteration,
                "world_size": ctx.world_size,
                "chunk_sizes": list(sizes),
                "selector_l1rel": _selector_l1rel(comps),
            },
            recipe_toml=dump_toml(recipe.to_toml_dict()),
            keep_last=cfg.checkpoint.keep_last,
            _fail_after=_fail_checkpoint_after,
        )

    progress = _progress(console, cfg.log.progress and ctx.is_main)
    task = progress.add_task("training", total=train_cfg.iterations, completed=start_iteration, reward="-")
    interrupted = False
    next_iteration = start_iteration  # the first iteration not yet completed
    try:
        with progress, GracefulInterrupt() as interrupt:
            for iteration in range(start_iteration, train_cfg.iterations):
                timer = PhaseTimer(device)
                record: dict[str, Any] = {"iteration": iteration, "world_size": ctx.world_size}

                # ---- Adaptive chunking: re-profile the current policy and move the boundaries ----
                every = getattr(getattr(comps.chunker, "config", None), "reprofile_every", 0)
                if every and iteration > 0 and iteration % every == 0:
                    with timer("profile"):
                        _, new_sizes = comps.chunker.reprofile(
                            comps, sigmas, kernels, train_prompts, image_from=cfg.sampler.image_from, seed=cfg.run.seed
                        )
                        new_sizes = distributed.broadcast_object(tuple(new_sizes), ctx)
                        comps.chunker.set_sizes(new_sizes)
                        _share_l1rel(comps, T, refresh=True)
                    if new_sizes != sizes:
                        record["chunk_sizes_changed"] = {"from": list(sizes), "to": list(new_sizes)}
                        if ctx.is_main:
                            console.print(f"iteration {iteration}: chunk boundaries {list(sizes)} -> {list(new_sizes)}")
                        sizes = new_sizes

                # ---- Evaluate the current policy on the fixed set (before this iteration's update)
                if eval_prompts and iteration % cfg.log.eval_every == 0:
                    with timer("eval"):
                        if ctx.is_main:
                            ev = evaluate(model, sigmas, comps.rewards, eval_prompts, cfg.prompts.eval_seeds,
                                          cfg.run.seed, cache, train_cfg.micro_batch_size * 4)
                            record.update(_eval_metrics(ev))

                # ---- Prompts and text embeddings (cached per prompt) -----------------------------
                with timer("encode"):
                    global_prompts = prompts_for_iteration(train_prompts, cfg.run.seed, iteration, geometry.prompts_per_iteration)
                    sample_prompts = [global_prompts[j // G] for j in local]
                    group_ids = torch.tensor([j // G for j in local])
                    text = cache.get(sample_prompts, device)

                # ---- Rollout: every local sample in one batched trajectory -----------------------
                # Noise and SDE draws come from per-sample generators keyed by the GLOBAL sample
                # index, so a sample is the same on any number of processes and after a resume.
                with timer("rollout"):
                    noise = initial_noise(cfg.run.seed, iteration, local, G, model.latent_shape,
                                          train_cfg.same_noise_in_group).to(device)
                    gens = sample_generators(cfg.run.seed, "rollout", iteration, local)
                    rollout_batch = cfg.sampler.batch_size or len(local)
                    parts = []
                    for lo in range(0, len(local), rollout_batch):
                        b = torch.arange(lo, min(lo + rollout_batch, len(local)))
                        sub_text = select_embeddings(text, b) if rollout_batch < len(local) else text
                        parts.append(rollout(
                            lambda x, s, sub_text=sub_text: model.velocity(x, s, sub_text), noise[lo : lo + len(b)],
                            sigmas, kernels, generators=gens[lo : lo + len(b)], image_from=cfg.sampler.image_from,
                            reduction=cfg.sampler.logprob_reduction, prompts=sample_prompts[lo : lo + len(b)],
                            group_ids=group_ids[lo : lo + len(b)],
                        ))
                    traj = parts[0] if len(parts) == 1 else Trajectory.cat(parts)

                # ---- Decode and score with every reward -----------------------------------------
                with timer("decode"):
                    images = model.decode(traj.image_latents)
                local_rewards: dict[str, torch.Tensor] = {}
                local_extras: dict[str, torch.Tensor] = {}
                with timer("reward"):
                    for label, _, reward in comps.rewards:
                        out = score(reward, images, sample_prompts)
                        local_rewards[label] = out.scores
                        local_extras.update({f"{label}/{k}": v.reshape(-1) for k, v in sorted(out.extras.items())})

                # ---- Advantages over whole groups (rewards gathered from every process) ----------
                with timer("advantage"):
                    all_rewards = {k: distributed.all_gather_cat(v, ctx) for k, v in local_rewards.items()}
                    all_groups = distributed.all_gather_cat(group_ids, ctx)
                    finite = all(bool(torch.isfinite(v).all()) for v in all_rewards.values())
                    for label, v in all_rewards.items():
                        record.update({f"reward/{label}/{k.split('/')[-1]}": x for k, x in _stats("r", v).items()})
                    for key, v in local_extras.items():
                        record[f"reward/{key}/mean"] = distributed.all_gather_cat(v, ctx).float().mean().item()
                    if finite:
                        advantages_all = _advantages(comps.advantage, all_rewards, recipe.rewards, all_groups, len(sizes))
                        offset = ctx.rank * geometry.samples_per_process
                        advantages = advantages_all[offset : offset + geometry.samples_per_process].to(device)
                        record.update({f"advantage/{k.split('/')[-1]}": x for k, x in _stats("a", advantages_all).items()})

                # A Ctrl-C during the rollout stops here: the iteration is redone on resume.
                if distributed.any_rank(interrupt.requested, ctx):
                    interrupted = True
                    break

                # ---- Policy update: chunk selection, memory-lean chunk backward, optimizer --------
                update_metrics: dict[str, list[float]] = defaultdict(list)
                trained_mask = torch.zeros(len(local), len(sizes), dtype=torch.bool)  # units of the first pass, logged
                skipped = not finite
                record["lr"] = scheduler.get_last_lr()[0]  # the LR this iteration's first step uses
                with timer("update"):
                    step_fn = make_step_log_prob_fn(
                        lambda idx: (lambda x, s: model.velocity(x, s, select_embeddings(text, idx))), traj
                    )
                    old_lp = traj.trainable_log_probs.to(device)
                    for epoch in range(geometry.updates_per_rollout if finite else 0):
                        order = torch.randperm(len(local), generator=generator(cfg.run.seed, "order", iteration, epoch, ctx.rank))
                        for opt_step in range(geometry.optimizer_steps_per_update):
                            optimizer.zero_grad(set_to_none=True)
                            # The first optimizer step of a rollout is exactly on-policy: check it.
                            probe = OnPolicyProbe() if epoch == 0 and opt_step == 0 else None
                            step_loss = 0.0
                            for mb in range(geometry.grad_accumulation):
                                start = opt_step * per_step + mb * geometry.micro_batch_size
                                idx = order[start : start + geometry.micro_batch_size]
                                sel_gens = [generator(cfg.run.seed, "select", iteration, epoch, local[int(i)]) for i in idx]
                                mask = comps.selector.select(len(idx), sizes, sel_gens).cpu()
                                if epoch == 0:
                                    trained_mask[idx] = mask
                                idx = idx.to(device)
                                fn = (lambda t, b, grad, idx=idx: step_fn(t, idx[b], grad))
                                if probe is not None:
                                    fn = probe.wrap(fn, old_lp[idx])
                                loss_value, m = lean_chunk_backward(
                                    fn, old_lp[idx], advantages[idx], sizes, mask.to(device),
                                    comps.loss.objective, normaliser=per_step,
                                )
                                step_loss += float(loss_value)
                                if beta > 0:
                                    velocity_for = lambda rows: (lambda x, s, rows=rows: model.velocity(x, s, select_embeddings(text, rows)))
                                    kl_value, kl_term = kl_backward(
                                        velocity_for, reference, lambda rows: select_embeddings(text, rows), traj,
                                        idx, mask.to(device), sizes, kind=kl_kind, beta=beta, normaliser=per_step,
                                    )
                                    update_metrics[f"kl/{kl_kind}"].append(kl_value)
                                    step_loss += beta * kl_term
                                for k, v in m.items():
                                    update_metrics[k].append(float(v))
                            if probe is not None:
                                deviation = distributed.all_reduce_scalar(probe.max_abs, ctx, "max")
                                record["on_policy/max_abs_log_ratio"] = deviation
                                if not deviation <= train_cfg.on_policy_tolerance:
                                    raise FlowrlError(
                                        f"on-policy check failed: max |log pi_new - log pi_old| = {deviation:.3g} > "
                                        f"{train_cfg.on_policy_tolerance:g} before any update; rollout and training "
                                        "log-probs disagree",
                                        where=f"{cfg.source}: [train].on_policy_tolerance",
                                        hint="the model adapter must be deterministic for a given batch (dropout? dtype casts?)",
                                    )
                            distributed.average_gradients(params, ctx)
                            grad_norm = torch.nn.utils.clip_grad_norm_(
                                params, train_cfg.max_grad_norm if train_cfg.max_grad_norm > 0 else float("inf")
                            )
                            # grad_norm is global after averaging; the loss is summed so that every
                            # process takes the same skip decision.
                            step_loss = distributed.all_reduce_scalar(step_loss, ctx) / ctx.world_size
                            if not (math.isfinite(step_loss) and math.isfinite(float(grad_norm))):
                                skipped = True
                                optimizer.zero_grad(set_to_none=True)
                                continue
                            optimizer.step()
                            scheduler.step()
                            update_metrics["loss"].append(step_loss)
                            update_metrics["grad_norm"].append(float(grad_norm))
                if skipped:
                    nonfinite_steps += 1
                    record["skipped_nonfinite"] = True
                    if ctx.is_main:
                        what = "reward" if not finite else "loss or gradient"
                        console.print(
                            f"[yellow]warning:[/yellow] iteration {iteration}: non-finite {what}; update skipped "
                            f"({nonfinite_steps} so far, at most {train_cfg.max_nonfinite_steps} tolerated)"
                        )
                record["nonfinite_steps"] = nonfinite_steps
                local_agg = {}
                for k, v in update_metrics.items():
                    how = _update_aggregate(k)
                    local_agg[k] = {"min": min, "max": max, "sum": sum}.get(how, lambda xs: sum(xs) / len(xs))(v)
                record.update(distributed.reduce_metrics(local_agg, {k: _update_aggregate(k) for k in local_agg}, ctx))
                if finite:
                    all_trained = distributed.all_gather_cat(trained_mask, ctx)  # [S, K], global sample order
                    record["trained_units"] = [torch.nonzero(row).flatten().tolist() for row in all_trained]
                record["chunk_sizes"] = list(sizes)

                # ---- Image grid of one group, annotated with reward and advantage ---------------
                if ctx.is_main and cfg.log.image_every and iteration % cfg.log.image_every == 0:
                    caps = [
                        f"r={local_rewards[first_reward][i]:.3f}\nA={advantages[i].mean():+.2f}" if finite else "non-finite"
                        for i in range(min(G, len(local)))
                    ]
                    grid = image_grid(images[: len(caps)], caps)
                    grid.save(run_dir / "images" / f"iter_{iteration:06d}.png")
                    for tracker in comps.trackers:
                        tracker.log_image(iteration, "group", grid)

                # ---- Checkpoint, metrics, progress ------------------------------------------------
                done = next_iteration = iteration + 1
                stop = distributed.any_rank(interrupt.requested, ctx)
                if done % cfg.checkpoint.every == 0 or done == train_cfg.iterations or stop:
                    with timer("checkpoint"):
                        if ctx.is_main:
                            checkpoint(done)
                record.update({f"time/{k}": v for k, v in timer.seconds.items()})
                if ctx.is_main and (iteration % cfg.log.every == 0 or done == train_cfg.iterations or skipped):
                    metrics_log.write(record)
                    for tracker in comps.trackers:
                        tracker.log_metrics(iteration, {k: v for k, v in record.items() if isinstance(v, float)})
                progress.update(task, advance=1, reward=f"{first_reward}={record.get(f'reward/{first_reward}/mean', float('nan')):.4f}")
                if nonfinite_steps > train_cfg.max_nonfinite_steps:
                    raise FlowrlError(
                        f"stopping: {nonfinite_steps} updates skipped for non-finite values "
                        f"(at most max_nonfinite_steps = {train_cfg.max_nonfinite_steps} are tolerated)",
                        where=f"{cfg.source}: [train].max_nonfinite_steps",
                        hint=f"inspect {run_dir / 'metrics.jsonl'} (skipped_nonfinite); check the reward, or lower the learning rate",
                    )
                if stop:
                    interrupted = True
                    break

            # ---- Final evaluation ------------------------------------------------------------------
            if not interrupted and eval_prompts and ctx.is_main and start_iteration < train_cfg.iterations:
                ev = evaluate(model, sigmas, comps.rewards, eval_prompts, cfg.prompts.eval_seeds, cfg.run.seed, cache,
                              train_cfg.micro_batch_size * 4)
                metrics_log.write({"iteration": train_cfg.iterations, "final": True, **_eval_metrics(ev)})

        # ---- Interrupted: make sure the last completed iteration is checkpointed --------------
        if interrupted and ctx.is_main:
            ckpt = latest_checkpoint(run_dir)
            if ckpt is None or json.loads((ckpt / "state.json").read_text())["iteration"] != next_iteration:
                checkpoint(next_iteration)
            console.print(
                f"interrupted after {next_iteration} completed iteration(s); checkpoint written. "
                f"Continue with `{_resume_hint(run_dir)}`"
            )
    finally:
        if metrics_log is not None:
            metrics_log.close()
        for tracker in comps.trackers:
            tracker.close()
        distributed.teardown()
    if interrupted:
        raise KeyboardInterrupt
    if ctx.is_main:
        console.print(f"done: {train_cfg.iterations} iterations in {run_dir}; reward curves: `flowrl plot {run_dir}`")
    return run_dir


def _progress(console: Console, enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[reward]}"), TimeElapsedColumn(), TimeRemainingColumn(),
        console=console, disable=not enabled, transient=False,
    )
