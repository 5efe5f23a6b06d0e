"""Time to reward: the wall time and the model forwards each configuration needs to
reach a fixed rise of the held-out reward, on the embedded model in the learning regime of
docs/study_shapes.md, seeds paired, with the second judge (CLIP) beside it.

    OMP_NUM_THREADS=1 python benchmarks/time_to_reward.py                       # every config, 5 seeds
    OMP_NUM_THREADS=1 python benchmarks/time_to_reward.py --configs flow_grpo egrpo_replay --seeds 2 --iterations 30
    python benchmarks/time_to_reward.py --smoke --out /tmp/ttr                   # 2 iterations, 2 configs, 1 seed
    OMP_NUM_THREADS=1 python benchmarks/time_to_reward.py --world compose         # the compositional world (below)
    OMP_NUM_THREADS=1 python benchmarks/time_to_reward.py --world compose --seeds 5   # trains what the archive lacks
    python benchmarks/time_to_reward.py --world compose --seeds 5 --report-only       # trains nothing; names what is missing
    python benchmarks/time_to_reward.py --world compose --check                   # validate every config there, run nothing

Run from the repository root. Finished runs are reused (delete ``--out`` to start over); the
report (``report.json``, ``report.md``, ``time_to_reward.png``) is written into ``--out``.

Every configuration is ``recipes/study_embedded.toml`` (the regime: verifier soft correctness
as the reward, 33 steps with the SDE in the first 16, lr 5e-5, 2 passes per rollout) with the
``--set`` overrides of :data:`CONFIGS`, so only what names the method differs:

- the peers' defaults, reproduced as flowrl recipes: ``flow_grpo`` (Flow-GRPO: step units, every
  SDE transition trained, clip 1e-4), ``dance_grpo`` (DanceGRPO: its constant-noise kernel
  eta = 0.3, 9 of 15 steps, i.e. fraction 0.6, clip 1e-4), ``gcpo`` (GCPO's Chunk-GRPO: the
  study recipe itself, dynamics-guided chunks [2, 2, 4, 8], weighted sampling of half of them,
  clip 5e-5);
- flowrl's fast configurations: ``replay`` (flow_grpo with ``[replay]``: the previous rollout
  trained on again, unit weights), ``egrpo`` (the entropy selector, the 8 highest-entropy steps),
  ``egrpo_replay`` (both), ``flash`` (one step per group), ``chunk8_replay`` (chunks [8, 8], one
  trained, with replay), ``window`` (a sliding SDE window of 8 steps), ``branch`` (flow_grpo
  sampled as trees, ``[window] use = "branch"``: one root per group of 8, split in 2 at steps 2, 6
  and 10 of the SDE window) and ``branch_egrpo`` / ``branch_egrpo4`` (trees and the entropy
  selector, 8 or 4 steps), and ``branch_tree`` (the trees with BranchGRPO's tree advantage,
  ``[advantage] use = "tree"``: each transition gets its node's advantage, and a shared
  transition is trained once);
- another objective: ``nft`` (DiffusionNFT as ``recipes/quickstart.toml`` ran it until 2026-11-29: ODE rollouts by
  the second-order ``dpm2m`` solver, the flow-matching loss at 8 timesteps, beta 1, one pass per
  rollout, each sample of a group from its own starting noise, since an ODE rollout adds none) on
  the study's 33-step schedule, so its held-out evaluation is the others' own; ``nft_fast``
  (the same with 10-step rollouts, DiffusionNFT's own count: its objective needs no SDE and no
  particular solver, so the rollout may use fewer steps than the evaluation, which stays at 33
  through ``[log].eval_steps``) and ``nft_fast4`` (``nft_fast`` trained at 4 timesteps per sample
  instead of 8).

Measured per run, from its ``metrics.jsonl``: the held-out verifier at every evaluation
(``--eval-every`` iterations; 18 held-out prompts x 4 noises, ODE sampling), the train time up to
each evaluation (the sum of the per-iteration ``time/*`` fields except evaluation and
checkpointing: wall-clock seconds of the phases that train) and the model forwards up to it
(``compute/<phase>/forward`` summed over the phases that train: rollout, update, reference,
replay, profile; rows are denoiser rows, 1 per sample per velocity call). A run "reaches" the
target at its first evaluation whose verifier is at least its own first evaluation (the base
model, same noise) plus ``--target-rise``; the time and forwards are those spent before it.
A run that never reaches it is reported as such and left out of the intervals (never imputed).

Statistics: mean over seeds ± the half-width of the 95% Student t interval (``flowrl.stats``);
the comparison with ``flow_grpo`` is paired by seed (the ratio of times, seed by seed). The bar:
the fastest configuration reaches the target in at most half of ``flow_grpo``'s
time on every paired seed (a seed where ``flow_grpo`` never reached counts when the config reached
within half of ``flow_grpo``'s whole run: the censored ratio, :func:`ratio_bound`), the two time
intervals do not overlap (the config's over its seeds, all of which reached if the first test
holds; ``flow_grpo``'s with a seed it never reached counted at its whole run's train time, a lower
bound, so censoring makes the test harder, never easier), and its CLIP change (final
minus first evaluation) is no worse (the paired difference's interval is not wholly below 0).
The second judge's change is also given in standard errors as ``benchmarks/objectives.py``
computes them (``rise``).

Train time depends on the machine's load: runs are made one at a time unless ``--jobs`` says
otherwise, and the report says how many ran at once.

``--world compose`` runs the same design on the compositional world (docs/compose.md):
the base recipe is ``recipes/study_compose.toml`` (the GRPO-family regime of this benchmark carried
over: 17 steps with the SDE in the first 16, so T = 16 again; reward ``compose_geneval_exact``; 8
prompts x 8 samples; 96 held-out prompts x 2 noises, 16 a category, ODE at 16 steps), the held-out
metric is ``eval/compose_geneval_strict/mean`` (GenEval's strict verdict; the categories are
balanced, so its mean is GenEval's overall), the second judge ``eval/compose_clip/mean``, the
target rise 0.10, an evaluation every 10 iterations and two runs at a time by default, and the
output ``runs/time_to_reward_compose``. Its default
configurations are one per objective flowrl ships: ``flow_grpo`` (the paired baseline),
``dance_grpo``, ``chunk_grpo`` (GCPO's Chunk-GRPO with its released layout [2, 3, 4, 7], uniform
half), ``gcpo`` (dynamics-guided chunks from the recipe's own profile,
``recipes/profiles/compose_window16.json``: [2, 3, 8, 3], with weighted sampling), ``gspo``,
``mixgrpo``, ``nft``, ``nft_fast``, ``nft_fast4``, ``awm``, ``dgpo``, ``dppo`` (Flow-DPPO),
``branch_tree``, and the 2026 objectives as their quickstart-world recipes run them: ``epg``,
``pepg`` and ``vgrpo`` on the final image's ELBO (10-step dpm2m ODE rollouts, one pass, evaluated
at the world's 16 steps), ``epg_onpolicy`` (EPG as ``recipes/quickstart.toml`` runs it: on-policy,
3 points) and ``fdfo`` (32 pairs an iteration from shared noise, so 64 samples as the others);
every other config runs there too when ``--configs`` names it. The six added for the compositional
world (``chunk_grpo``, ``gspo``, ``mixgrpo``, ``awm``, ``dgpo``, ``dppo``) take their objective's
keys from the recipes named in :data:`CONFIGS`; ``chunk_grpo``, ``gspo``, ``mixgrpo`` and ``dppo``
keep the regime's update (lr 5e-5, 2 passes, clip 5e-5 where a ratio is clipped), ``awm`` and
``dgpo`` run as ``nft`` does (dpm2m ODE rollouts, one pass). On the shapes world these and the 2026
objectives (:data:`COMPOSE_ONLY`) run only when ``--configs`` names them, so the default shapes run is today's. Every config's overrides validate on
both base recipes (``--check``); a config that does not apply on a world is listed in that world's
``not_applicable`` with its reason and skipped with that reason printed and kept in the report (none
today). The report adds ``hf_share``'s change (the artefact measure) beside the second judge's on
both worlds. On the compose world every config has run on seeds 42-46, the 5-seed table
(docs/benchmarks.md).

The 5-seed table takes longer than a working session here, and ``runs/`` does not outlive one, so
on the compose world every finished run's evaluation curve (:func:`curve`) is kept in
``benchmarks/results/time_to_reward_compose/CONFIG_sSEED.json`` (``--archive``), with the settings
that make it that run (overrides, iterations, evaluation interval, a hash of the base recipe and
its profiles) and the machine and load it ran under. A later session asks for the same table
(``--seeds 5``, or ``--seed-list``) and trains only the runs the archive does not hold under the
same settings; the report is the same whether a run's curve comes from the archive or its folder.
``--report-only`` trains nothing and reports what the archive and ``--out`` hold: each config over
the seeds it has, paired with ``flow_grpo`` on the seeds both have, every missing run named (never
imputed), and the bar left unjudged for a config that lacks an asked seed. A run folder in ``--out``
counts when its saved recipe is the one asked for; unlike the archive, a folder does not record the
runs at once it was timed under."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from objectives import rise  # noqa: E402  (the held-out SE as benchmarks/objectives.py computes it)

from flowrl.processes import exits_with_parent  # noqa: E402
from flowrl.errors import FlowrlError  # noqa: E402
from flowrl.sweeps import parse_seed_list  # noqa: E402
from flowrl.stats import paired_interval, t_interval  # noqa: E402

RECIPE = "recipes/study_embedded.toml"
STEP = ["chunker.use='step'"]
BRANCH = ["window.use='branch'", "window.steps=[2, 6, 10]", "window.factors=[2, 2, 2]"]
#: DiffusionNFT (the quickstart's objective until 2026-11-29) on the study's sampler (the same steps, so the same evaluation)
NFT = [*STEP, "selector.use='all'", "loss.use='nft'", "loss.beta=1.0", "loss.timesteps=8", "window.use='ode'",
       "window.solver='dpm2m'", "sampler.image_from='final'", "train.updates_per_rollout=1",
       "train.same_noise_in_group=false"]  # deterministic rollouts: a group differs by its starting noise alone
#: DiffusionNFT's rollouts need no SDE and no particular solver: 10 dpm2m steps of the same schedule,
#: the held-out evaluation still at the base recipe's count ([log].eval_steps: 33 on shapes, 16 on
#: compose, filled in per world), so its numbers are the others'
NFT_FAST = ["sampler.steps=10", "sampler.sde_window=[]", "log.eval_steps={eval_steps}"]
REPLAY = ["replay.size=1", "replay.max_staleness=1", "replay.weight_level='unit'"]
#: the other ODE-rollout objectives (recipes/quickstart_awm.toml, quickstart_dgpo.toml) on the study's
#: sampler, as NFT: dpm2m rollouts, one pass, each sample of a group from its own starting noise
ODE_ROLLOUT = [*STEP, "selector.use='all'", "window.use='ode'", "window.solver='dpm2m'", "sampler.image_from='final'",
               "train.updates_per_rollout=1", "train.same_noise_in_group=false"]
#: the ELBO objectives' rollouts (recipes/quickstart_epg.toml and its siblings): 10-step dpm2m ODE, one
#: pass, the final image's ELBO as the likelihood, evaluated at the world's own step count
ELBO_ROLLOUT = [*ODE_ROLLOUT, *NFT_FAST, "likelihood.use='elbo'"]
#: config -> (what it is, the --set overrides of the world's base recipe). ``{dyn}`` in a description
#: is the base recipe's dynamics chunks on that world, ``{eval_steps}`` in an override its evaluation steps.
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "flow_grpo": ("Flow-GRPO default: step units, all 16 SDE steps, clip 1e-4",
                  [*STEP, "selector.use='all'", "loss.eps_low=1e-4", "loss.eps_high=1e-4"]),
    "dance_grpo": ("DanceGRPO default: kernel dance eta 0.3, 60% of steps, clip 1e-4",
                   [*STEP, "kernel.use='dance'", "kernel.eta=0.3", "selector.use='uniform'", "selector.fraction=0.6",
                    "loss.eps_low=1e-4", "loss.eps_high=1e-4"]),
    "gcpo": ("GCPO Chunk-GRPO default: dynamics chunks {dyn}, weighted half, clip 5e-5", []),
    "replay": ("flow_grpo + replay of the previous rollout (unit weights, c = 2)",
               [*STEP, "selector.use='all'", "loss.eps_low=1e-4", "loss.eps_high=1e-4", *REPLAY]),
    "egrpo": ("E-GRPO selector: the 8 highest-entropy steps, clip 5e-5",
              [*STEP, "selector.use='entropy'", "selector.rule='top'", "selector.fraction=0.5"]),
    "egrpo_replay": ("egrpo + replay of the previous rollout",
                     [*STEP, "selector.use='entropy'", "selector.rule='top'", "selector.fraction=0.5", *REPLAY]),
    "flash": ("Flash selector: one step per group in the first 8",
              [*STEP, "selector.use='flash'", "selector.span=0.5"]),
    "chunk8_replay": ("chunks [8, 8], one trained per sample, with replay",
                      ["chunker.use='fixed'", "chunker.size=8", "selector.use='uniform'", "selector.fraction=0.5",
                       *REPLAY]),
    "window": ("sliding SDE window of 8 steps (fewer trained transitions per rollout)",
               [*STEP, "selector.use='all'", "window.use='sliding'", "window.size=8"]),
    "branch": ("flow_grpo with branch rollouts: one root per group, split in 2 at steps 2, 6 and 10",
               [*STEP, "selector.use='all'", "loss.eps_low=1e-4", "loss.eps_high=1e-4", *BRANCH]),
    "branch_egrpo": ("branch rollouts + the E-GRPO selector (the 8 highest-entropy steps)",
                     [*STEP, "selector.use='entropy'", "selector.rule='top'", "selector.fraction=0.5", *BRANCH]),
    "branch_egrpo4": ("branch rollouts + the E-GRPO selector, the 4 highest-entropy steps",
                      [*STEP, "selector.use='entropy'", "selector.rule='top'", "selector.fraction=0.25", *BRANCH]),
    "branch_tree": ("branch rollouts with BranchGRPO's tree advantage: each distinct transition trained once",
                    [*STEP, "selector.use='all'", "loss.eps_low=1e-4", "loss.eps_high=1e-4", *BRANCH,
                     "advantage.use='tree'"]),
    "nft": ("DiffusionNFT as the quickstart ran it until 2026-11-29: ODE rollouts (dpm2m), 8 timesteps, beta 1, one pass",
            [*NFT]),
    "nft_fast": ("DiffusionNFT with 10-step rollouts (its paper's count; any solver serves it), evaluated at {eval_steps}",
                 [*NFT, *NFT_FAST]),
    "nft_fast4": ("nft_fast trained at 4 timesteps per sample instead of 8 (half the update)",
                  [*NFT, *NFT_FAST, "loss.timesteps=4"]),
    # the objectives flowrl ships that the configurations above do not cover; not in the
    # shapes world's default set (today's runs unchanged), in the compose world's
    "chunk_grpo": ("Chunk-GRPO with GCPO's released layout: chunks [2, 3, 4, 7], uniform half, clip 5e-5",
                   ["chunker.use='explicit'", "chunker.sizes=[2, 3, 4, 7]", "selector.use='uniform'",
                    "selector.fraction=0.5"]),
    "gspo": ("GSPO: one chunk of all 16 SDE steps (the sequence ratio), clip 5e-5",
             ["chunker.use='sequence'", "selector.use='all'"]),
    "mixgrpo": ("MixGRPO as recipes/quickstart_mixgrpo.toml: a sliding window of 4 SDE steps moved every 5 iterations",
                [*STEP, "selector.use='all'", "window.use='sliding'", "window.size=4", "window.every=5",
                 "window.stride=1"]),
    "awm": ("AWM as recipes/quickstart_awm.toml: ODE rollouts (dpm2m), 6 timesteps, one pass",
            [*ODE_ROLLOUT, "loss.use='awm'", "loss.timesteps=6"]),
    "dgpo": ("DGPO as recipes/quickstart_dgpo.toml: ODE rollouts (dpm2m), beta 100, 4 timesteps, one pass",
             [*ODE_ROLLOUT, "loss.use='dgpo'", "loss.beta=100.0", "loss.timesteps=4"]),
    "dppo": ("Flow-DPPO as recipes/quickstart_dppo.toml: step units, half of them, KL threshold 1e-5",
             [*STEP, "selector.use='uniform'", "selector.fraction=0.5", "loss.use='dppo'", "loss.kl_threshold=1e-5"]),
    # the 2026 objectives (docs/objectives.md): ELBO losses on 10-step dpm2m ODE rollouts, one pass,
    # evaluated at the world's count as nft_fast is; FDFO on paired SDE rollouts of the world's sampler
    "epg": ("EPG on the ELBO as recipes/quickstart_epg.toml: 10-step ODE rollouts, 4 points, trailing old policy (decay 1)",
            [*ELBO_ROLLOUT, "loss.use='epg'", "likelihood.timesteps=4"]),
    "epg_onpolicy": ("EPG as recipes/quickstart.toml runs it: on-policy (decay 0, no old-policy forward), 3 points",
                     [*ELBO_ROLLOUT, "loss.use='epg'", "likelihood.timesteps=3", "likelihood.decay_type=0"]),
    "pepg": ("PEPG on the ELBO as recipes/quickstart_pepg.toml (PAR has its gradient): 10-step ODE rollouts, 4 points",
             [*ELBO_ROLLOUT, "loss.use='pepg'", "likelihood.timesteps=4"]),
    "vgrpo": ("V-GRPO as recipes/quickstart_vgrpo.toml: one clipped ELBO ratio per sample, 4 group-shared stratified points",
              [*ELBO_ROLLOUT, "loss.use='vgrpo'", "loss.eps=1e-3", "loss.adv_soft_clip=3.0", "likelihood.timesteps=4",
               "likelihood.units='sample'", "likelihood.noise='group'", "likelihood.stratified=true"]),
    "fdfo": ("FDFO as recipes/quickstart_fdfo.toml: 32 pairs from the same noise, 4 states per sample, clip 0.03",
             [*STEP, "selector.use='all'", "loss.use='fdfo'", "loss.clip_range=0.03", "loss.timesteps=4",
              "advantage.use='group_centred'", "train.group_size=2", "train.prompts_per_iteration=32",
              "train.same_noise_in_group=true", "train.updates_per_rollout=1"]),
}
BASELINE = "flow_grpo"
MAIN, SECOND = "verifier", "embedded_clip"
ARTEFACT = "hf_share"  # the evaluation's high-frequency share (texture), shown beside


#: the configurations added for the compositional world: on the shapes world only when --configs names them
COMPOSE_ONLY = ("chunk_grpo", "gspo", "mixgrpo", "awm", "dgpo", "dppo", "epg", "epg_onpolicy", "pepg", "vgrpo", "fdfo")


@dataclass(frozen=True)
class World:
    """What differs between the two embedded worlds: the base recipe, the held-out metric and the
    second judge (reward labels of ``eval/<label>/mean``), the target rise's default, the
    evaluation's steps, the dynamics chunks of the base recipe's profile (for the descriptions),
    the default and smoke configurations, and the configurations that do not apply (with why)."""

    recipe: str
    main: str
    second: str
    main_text: str
    second_text: str
    target_rise: float
    eval_steps: int
    dyn: str
    defaults: tuple[str, ...]
    smoke: tuple[str, ...]
    smoke_num_eval: int
    not_applicable: dict[str, str] = field(default_factory=dict)
    eval_every: int = 5  # --eval-every's default
    jobs: int = 1  # --jobs' default: runs at once


WORLDS = {
    # today's benchmark: the first embedded world, the configurations of the runs recorded in
    # docs/benchmarks.md (the ones added for the compositional world run there only when --configs names them)
    "shapes": World(RECIPE, MAIN, SECOND, "verifier", "CLIP", 0.03, 33, "[2,2,4,8]",
                    defaults=tuple(c for c in CONFIGS if c not in COMPOSE_ONLY),
                    smoke=(BASELINE, "egrpo_replay"), smoke_num_eval=4),
    # the compositional world (docs/compose.md): GenEval's strict verdict over balanced held-out
    # categories (its mean is GenEval's overall), the tiny CLIP as the second judge. Every
    # configuration's overrides validate on recipes/study_compose.toml (T = 16 there too, the
    # branch steps inside its SDE window, no configuration names the shapes world's profile:
    # `gcpo` takes the base recipe's own, profiles/compose_window16.json), so none is skipped;
    # a configuration that stops applying goes in `not_applicable` with its reason, and is then
    # skipped with that reason printed.
    "compose": World("recipes/study_compose.toml", "compose_geneval_strict", "compose_clip", "GenEval strict (overall)",
                     "compose_clip", 0.10, 16, "[2,3,8,3]",
                     defaults=("flow_grpo", "dance_grpo", "chunk_grpo", "gcpo", "gspo", "mixgrpo", "nft", "nft_fast",
                               "nft_fast4", "awm", "dgpo", "dppo", "branch_tree", "epg", "epg_onpolicy", "pepg",
                               "vgrpo", "fdfo"),
                     smoke=(BASELINE, "gcpo"), smoke_num_eval=6, not_applicable={},
                     # the archived runs' settings: 50 iterations, evaluated every 10, two runs at a time
                     eval_every=10, jobs=2),
}
#: phases whose forwards and seconds are the cost of training (not evaluation or checkpoints)
TRAIN_PHASES = ("rollout", "update", "reference", "replay", "profile")


def overrides(name: str, world: World) -> list[str]:
    """The config's ``--set`` overrides of ``world``'s base recipe."""
    return [o.replace("{eval_steps}", str(world.eval_steps)) for o in CONFIGS[name][1]]


def describe(name: str, world: World) -> str:
    return CONFIGS[name][0].replace("{dyn}", world.dyn).replace("{eval_steps}", str(world.eval_steps))


def applicable(names: list[str], world: World) -> list[str]:
    """The configs that apply on ``world``; each one that does not is named with its reason."""
    keep = []
    for name in names:
        if name in world.not_applicable:
            print(f"skipping {name}: it does not apply on this world: {world.not_applicable[name]}", flush=True)
        else:
            keep.append(name)
    return keep


def check(names: list[str], world: World) -> dict[str, str]:
    """Validate every config's overrides on the world's base recipe as ``flowrl validate`` does
    (in this process, so 20 configs take seconds): ``name -> "ok ..."`` or the error."""
    from flowrl.errors import FlowrlError
    from flowrl.plugins import get_registry
    from flowrl.recipe import check_startable, load_recipe

    registry, out = get_registry(), {}
    for name in names:
        try:
            r = load_recipe(REPO / world.recipe, overrides(name, world), registry=registry)
            check_startable(r, registry, devices=False)
            c = r.components
            out[name] = (f"ok: chunker={c['chunker'].use}, selector={c['selector'].use}, loss={c['loss'].use}, "
                         f"kernel={c['kernel'].use}, T={r.num_trainable}")
        except FlowrlError as e:
            out[name] = f"error: {e}"
    return out


#: where a world keeps every finished run's evaluation curve across working sessions (committed:
#: ``runs/`` does not outlive a session, and the 5-seed table takes several); ``--archive`` overrides
ARCHIVES = {"compose": "benchmarks/results/time_to_reward_compose"}


def _checkout_relative(value):
    """The resolved recipe with every absolute path inside this checkout made relative to it, so
    that the same regime hashes the same in any clone (the archive must serve every checkout)."""
    if isinstance(value, dict):
        return {k: _checkout_relative(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_checkout_relative(v) for v in value]
    if isinstance(value, str) and Path(value).is_absolute() and Path(value).is_relative_to(REPO):
        return Path(value).relative_to(REPO).as_posix()
    return value


#: recipe keys added after the archive's runs whose default changes nothing a run computes or
#: measures: left out of the regime's hash while they hold that default (any other value counts),
#: so that adding such a setting to flowrl does not orphan the archive
NEUTRAL_AT_DEFAULT = {("log", "kl_every"): 0,  # the KL measured at beta = 0: off
                      ("prompts", "embeddings"): ""}  # prompts encoded as they come (the same embeddings)


def regime_sha256(world: World) -> str:
    """One hash of what every run of a world is made of: its base recipe as resolved (so an edited
    comment does not count, a changed value does; :data:`NEUTRAL_AT_DEFAULT` aside) and the
    profiles it names."""
    import hashlib

    from flowrl.recipe import load_recipe, profile_keys

    recipe = load_recipe(REPO / world.recipe, [])
    resolved = recipe.to_toml_dict()
    for (table, key), default in NEUTRAL_AT_DEFAULT.items():
        if resolved.get(table, {}).get(key) == default:
            del resolved[table][key]
    h = hashlib.sha256(json.dumps(_checkout_relative(resolved), sort_keys=True, default=str).encode())
    for _, path in sorted(profile_keys(recipe)):
        if path:
            h.update(Path(path).read_bytes())
    return h.hexdigest()


def run_identity(name: str, seed: int, args) -> dict:
    """What an archived run must share with the one asked for to stand in for it: its settings,
    and the runs at once it was timed under (train seconds depend on the neighbours' load)."""
    world = WORLDS[args.world]
    return {"config": name, "seed": seed, "overrides": overrides(name, world), "iterations": args.iterations,
            "eval_every": args.eval_every, "jobs": args.jobs, "regime_sha256": args.regime_sha256}


def _archived(name: str, seed: int, args) -> tuple[Path, dict | None] | None:
    if args.archive is None:
        return None
    path = args.archive / f"{name}_s{seed}.json"
    return path, (json.loads(path.read_text()) if path.is_file() else None)


def _same_run(record: dict, name: str, seed: int, args) -> bool:
    return all(record.get(k) == v for k, v in run_identity(name, seed, args).items())


def archived_points(name: str, seed: int, args) -> list[dict] | None:
    """The archived evaluation curve of this run, if the archive holds it under the same identity."""
    found = _archived(name, seed, args)
    if found is None or found[1] is None or not _same_run(found[1], name, seed, args):
        return None
    return found[1]["points"]


def archive_run(name: str, seed: int, args, run_dir: Path) -> None:
    """Keep the finished run's evaluation curve (:func:`curve`: every evaluation with the train
    seconds and forwards before it), with the machine it ran on. A record of the same run under
    other settings is never overwritten (the run is then reported from its folder only), and a
    folder is archived only if it is a finished run of exactly these settings."""
    import platform
    from datetime import datetime, timezone

    found = _archived(name, seed, args)
    if found is None:
        return
    path, record = found
    if record is not None:
        if not _same_run(record, name, seed, args):
            differ = [k for k, v in run_identity(name, seed, args).items() if record.get(k) != v]
            print(f"  not archived: {path} holds {name} seed {seed} under other settings ({', '.join(differ)}); "
                  "it is kept", flush=True)
        return
    if not finished_as_asked(name, seed, args, run_dir):
        print(f"  not archived: {run_dir} is not a finished run of these settings", flush=True)
        return
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), None) if Path("/proc/cpuinfo").is_file() else None
    cpu = cpu or platform.processor()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, text=True, capture_output=True).stdout.strip()
    record = {**run_identity(name, seed, args), "points": curve(run_dir, WORLDS[args.world].main),
              "cpu": cpu, "commit_when_archived": commit,
              "archived": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def run_sets(name: str, seed: int, args, run_dir: Path) -> list[str]:
    """The ``--set`` overrides of one run: the config's, then the benchmark's own."""
    world = WORLDS[args.world]
    sets = [*overrides(name, world), f"run.output_dir='{run_dir}'", f"run.seed={seed}",
            f"train.iterations={args.iterations}", f"log.eval_every={args.eval_every}", "log.every=1",
            "log.progress=false", "log.image_every=0", f"checkpoint.every={args.iterations}"]
    if args.smoke:
        sets += [f"prompts.num_eval={world.smoke_num_eval}", "prompts.eval_seeds=1"]
    return sets


def finished_as_asked(name: str, seed: int, args, run_dir: Path) -> bool:
    """The run's folder holds a finished run made with exactly these settings: its saved recipe is
    the one this run would resolve to (output folder aside), and its metrics reach the final row."""
    import tomllib

    from flowrl.recipe import load_recipe

    metrics = run_dir / "metrics.jsonl"
    if not (metrics.is_file() and (run_dir / "recipe.toml").is_file()):
        return False
    if not any(json.loads(line).get("final") for line in metrics.read_text().splitlines() if line):
        return False
    asked = load_recipe(REPO / WORLDS[args.world].recipe, run_sets(name, seed, args, run_dir)).to_toml_dict()
    saved = tomllib.loads((run_dir / "recipe.toml").read_text())
    for recipe in (asked, saved):
        recipe.get("run", {}).pop("output_dir", None)
    return json.loads(json.dumps(asked, default=str)) == json.loads(json.dumps(saved, default=str))


def run(name: str, seed: int, args) -> Path | None:
    """Train one run unless it is archived or already finished as asked in ``--out``; archive it
    when done."""
    run_dir = args.out / f"{name}_s{seed}"
    if archived_points(name, seed, args) is not None:
        return None
    if finished_as_asked(name, seed, args, run_dir):
        archive_run(name, seed, args, run_dir)
        return run_dir
    world = WORLDS[args.world]
    sets = run_sets(name, seed, args, run_dir)
    cmd = [sys.executable, "-m", "flowrl", "train", world.recipe, "--overwrite", *[a for s in sets for a in ("--set", s)]]
    t0 = time.time()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, preexec_fn=exits_with_parent())
    if done.returncode:
        raise SystemExit(f"{name} seed {seed} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    print(f"  ran {name} seed {seed} in {time.time() - t0:.0f} s", flush=True)
    archive_run(name, seed, args, run_dir)
    return run_dir


def curve(run_dir: Path, main: str = MAIN) -> list[dict]:
    """Every evaluation of a run: the iteration, the held-out scores and their SEs, and the
    train seconds and forwards spent before it."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    seconds = forwards = 0.0
    out = []
    for r in rows:
        if f"eval/{main}/mean" in r:  # evaluated before this row's iteration trains
            out.append({"iteration": r["iteration"], "seconds": seconds, "forwards": forwards,
                        **{k: v for k, v in r.items() if k.startswith("eval/")}})
        seconds += sum(r.get(f"time/{p}", 0.0) for p in ("encode", "decode", "reward", "advantage", *TRAIN_PHASES))
        forwards += sum(r.get(f"compute/{p}/forward", 0.0) for p in TRAIN_PHASES)
    return out


def reached(points: list[dict], target_rise: float, main: str = MAIN) -> dict | None:
    base = points[0][f"eval/{main}/mean"]
    return next((p for p in points if p[f"eval/{main}/mean"] >= base + target_rise), None)


def summarise(args) -> dict:
    world = WORLDS[args.world]
    main, second = world.main, world.second
    seeds = args.seed_values
    report = {"world": args.world, "recipe": world.recipe, "metric": f"eval/{main}/mean",
              "second_judge": f"eval/{second}/mean", "target_rise": args.target_rise, "iterations": args.iterations,
              "eval_every": args.eval_every, "seeds": seeds, "jobs": args.jobs, "configs": {}}
    if getattr(args, "skipped", None):
        report["skipped"] = args.skipped
    per: dict[str, dict[int, dict]] = {}
    missing: dict[str, list[int]] = {}
    for name in args.configs:
        per[name] = {}
        for s in seeds:
            points = archived_points(name, s, args)
            if points is None and finished_as_asked(name, s, args, args.out / f"{name}_s{s}"):
                points = curve(args.out / f"{name}_s{s}", main)
            if points is None:
                if not getattr(args, "report_only", False):  # every asked run was made: never drop one silently
                    raise SystemExit(f"{name} seed {s}: neither the archive nor {args.out / f'{name}_s{s}'} holds a "
                                     "finished run of these settings")
                missing.setdefault(name, []).append(s)
                continue
            hit = reached(points, args.target_rise, main)
            first, final = points[0], points[-1]
            d2, z2 = rise(first, final, second)
            art = f"eval/{ARTEFACT}/mean"
            per[name][s] = {"reached": hit is not None, "seconds": hit["seconds"] if hit else None,
                            "forwards": hit["forwards"] if hit else None, "iteration": hit["iteration"] if hit else None,
                            "first": first[f"eval/{main}/mean"], "final": final[f"eval/{main}/mean"],
                            "second_change": d2, "second_change_se": z2,
                            "hf_share_first": first.get(art), "hf_share_final": final.get(art),
                            "total_seconds": final["seconds"], "curve": [(p["seconds"], p[f"eval/{main}/mean"])
                                                                        for p in points]}
        runs = per[name]
        got = [r for r in runs.values() if r["reached"]]
        hf = [r["hf_share_final"] - r["hf_share_first"] for r in runs.values() if r["hf_share_final"] is not None]
        none = t_interval([]).as_dict() if not runs else None  # no run yet: "n/a", not "not reached"
        entry = {"what": describe(name, world), "overrides": overrides(name, world), "runs": runs,
                 "reached": f"{len(got)}/{len(runs)}",
                 "seconds": t_interval([r["seconds"] for r in got]).as_dict() if got else none,
                 "forwards": t_interval([r["forwards"] for r in got]).as_dict() if got else none,
                 "final": t_interval([r["final"] for r in runs.values()]).as_dict(),
                 "second_change": t_interval([r["second_change"] for r in runs.values()]).as_dict(),
                 "hf_share_change": t_interval(hf).as_dict() if hf else None}
        report["configs"][name] = entry
    if missing:
        report["missing"] = missing
    if BASELINE in per:
        base = per[BASELINE]
        # the baseline's time for the "apart" test: a seed it never reached counts at its whole run's
        # train time, a lower bound of its time to target, so censoring can only make the test harder
        theirs = t_interval([r["seconds"] if r["reached"] else r["total_seconds"] for r in base.values()]).as_dict()
        report["configs"][BASELINE]["seconds_censored_low"] = theirs
        for name in args.configs:
            if name == BASELINE:
                continue
            paired = [s for s in seeds if s in per[name] and s in base]
            both = [s for s in paired if per[name][s]["reached"] and base[s]["reached"]]
            ratios = {s: per[name][s]["seconds"] / base[s]["seconds"] for s in both}
            clip = paired_interval({s: per[name][s]["second_change"] for s in paired},
                                   {s: base[s]["second_change"] for s in paired})
            entry = report["configs"][name]
            entry["time_ratio"] = t_interval(list(ratios.values())).as_dict() if ratios else None
            entry["time_ratio_per_seed"] = ratios
            entry["time_ratio_bounds"] = {s: ratio_bound(per[name][s], base[s]) for s in paired}
            entry["clip_vs_baseline"] = clip.as_dict()
            entry["final_vs_baseline"] = paired_interval({s: per[name][s]["final"] for s in paired},
                                                         {s: base[s]["final"] for s in paired}).as_dict()
            mine = entry["seconds"]
            apart = bool(mine and mine.get("hi") is not None and theirs.get("lo") is not None
                         and mine["hi"] < theirs["lo"])
            entry["bar"] = {
                # a seed where only the config reached counts when even the baseline's whole run was
                # more than twice the config's time to target
                "half_time_every_seed": len(paired) == len(seeds) and all(
                    b is not None and b[0] in ("=", "<") and b[1] <= 0.5 for b in entry["time_ratio_bounds"].values()),
                "intervals_apart": apart,
                "clip_no_worse": not (clip.hi is not None and clip.hi < 0),
            }
            # a config without every asked seed (its own and the baseline's) is not judged
            entry["bar"]["complete"] = len(paired) == len(seeds)
            entry["bar"]["met"] = all(entry["bar"].values())
    return report


def ratio_bound(mine: dict, baseline: dict) -> tuple[str, float] | None:
    """A config's time to target over the baseline's on one seed, censoring kept: ``("=", r)``
    when both reached; ``("<", r)`` when only the config did (the baseline needs more than its
    whole run, so the ratio is below the config's time over that); ``(">", r)`` when only the
    baseline did; None when neither."""
    if mine["reached"] and baseline["reached"]:
        return "=", mine["seconds"] / baseline["seconds"]
    if mine["reached"]:
        return "<", mine["seconds"] / baseline["total_seconds"]
    if baseline["reached"]:
        return ">", mine["total_seconds"] / baseline["seconds"]
    return None


def fmt_bounds(bounds: dict) -> str:
    """The censored seeds of a ratio column: e.g. ``; < 0.31 (s44)``."""
    parts = [f"{b[0]} {b[1]:.2f} (s{s})" for s, b in bounds.items() if b is not None and b[0] != "="]
    none = [f"s{s}" for s, b in bounds.items() if b is None]
    if none:
        parts.append(f"neither reached on {', '.join(none)}")
    return "; " + "; ".join(parts) if parts else ""


def fmt(iv: dict | None, digits: int = 1) -> str:
    if not iv:
        return "not reached"
    if iv.get("mean") is None:  # no run of this config yet (--report-only)
        return "n/a"
    hw = iv.get("half_width")
    return f"{iv['mean']:.{digits}f}" + (f" ± {hw:.{digits}f}" if hw is not None else " (n=1)")


def markdown(report: dict) -> str:
    world = WORLDS[report.get("world", "shapes")]
    main, second = world.main_text, world.second_text
    lines = [f"target: held-out {main} >= first evaluation + {report['target_rise']}; "
             f"{report['iterations']} iterations, evaluation every {report['eval_every']}; seeds {report['seeds']}; "
             f"{report['jobs']} run(s) at a time",
             "",
             f"| config | what | reached | train s to target | forwards to target | final {main} | final - flow_grpo's "
             f"(paired) | {second} change | hf_share change | time / flow_grpo (paired) | bar |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in report["configs"].items():
        ratio = "baseline" if name == BASELINE else \
            (fmt(e.get("time_ratio"), 2) if e.get("time_ratio") else "") + fmt_bounds(e.get("time_ratio_bounds", {}))
        ratio = ratio.removeprefix("; ") or ("not reached" if e.get("time_ratio_bounds") else "n/a")
        bar = ("" if "bar" not in e else "met" if e["bar"]["met"] else
               "not met" if e["bar"].get("complete", True) else "not judged (seeds missing)")
        hf = fmt(e["hf_share_change"], 4) if e.get("hf_share_change") else "n/a"
        versus = "" if name == BASELINE else fmt(e.get("final_vs_baseline"), 4)
        lines.append(f"| {name} | {e['what']} | {e['reached']} | {fmt(e['seconds'])} | {fmt(e['forwards'], 0)} | "
                     f"{fmt(e['final'], 4)} | {versus} | {fmt(e['second_change'], 4)} | {hf} | {ratio} | {bar} |")
    lines += ["", "mean ± half-width of the 95% Student t interval over seeds (n = 1: no interval); the time and "
              "forwards of a config are over the seeds that reached the target; the second judge's and hf_share's "
              "change: final minus first evaluation. The paired time ratio's interval is over the seeds where both "
              "reached; a seed where only one did gives a bound (`<`: only the config reached, so the ratio is below "
              "its time over the baseline's whole run; `>`: only the baseline did)."]
    for name, why in report.get("skipped", {}).items():
        lines.append(f"- {name}: not run on this world: {why}")
    for name, absent in report.get("missing", {}).items():
        lines.append(f"- {name}: seed(s) {', '.join(map(str, absent))} not run yet; left out, never imputed")
    return "\n".join(lines)


def family(overrides_: list[str]) -> str:
    """The config's kind of objective, for the chart's line style: the final image's ELBO, another
    ODE-rollout objective (likelihood-free), FDFO's paired rollouts, or a ratio on SDE transitions."""
    if "likelihood.use='elbo'" in overrides_:
        return "elbo"
    if "window.use='ode'" in overrides_:
        return "ode"
    return "fdfo" if "loss.use='fdfo'" in overrides_ else "sde"


#: line style per family (a legend of 18 configs needs more than colour to tell them apart)
STYLES = {"sde": "-", "ode": "--", "elbo": ":", "fdfo": "-."}


def chart(report: dict, path: Path) -> None:
    """One seed: every run's curve. Several: each config's mean curve over its seeds (the rise at
    each evaluation against the mean train seconds before it), and beside it the final rise over
    the first evaluation with its 95% interval, so that 18 configs x 5 seeds stay readable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    world = WORLDS[report.get("world", "shapes")]
    configs = {name: e for name, e in report["configs"].items() if e["runs"]}
    several = any(len(e["runs"]) > 1 for e in configs.values())
    if several:
        fig, (ax, fx) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    else:
        fig, ax = plt.subplots(figsize=(9.5, 4.5))
    palette = plt.get_cmap("tab20").colors
    colours = {name: palette[i % len(palette)] for i, name in enumerate(configs)}
    for name, e in configs.items():
        style, colour = STYLES[family(e["overrides"])], colours[name]
        runs = list(e["runs"].values())
        if several:  # evaluations sit at the same iterations in every run of a config
            k = min(len(r["curve"]) for r in runs)
            xs = [sum(r["curve"][j][0] for r in runs) / len(runs) for j in range(k)]
            ys = [sum(r["curve"][j][1] - r["first"] for r in runs) / len(runs) for j in range(k)]
            ax.plot(xs, ys, color=colour, ls=style, marker="o", ms=3, lw=1.2, label=f"{name} (n={len(runs)})")
            continue
        for k, r in enumerate(runs):
            xs, ys = zip(*r["curve"])
            ax.plot(xs, [y - r["first"] for y in ys], color=colour, ls=style, marker="o", ms=3,
                    lw=1.2, label=name if k == 0 else None)
    ax.axhline(report["target_rise"], color="k", ls="--", lw=1, label="target")
    ax.set_xlabel("train seconds (rollout, rewards, update, replay)" + (", mean over seeds" if several else ""))
    ax.set_ylabel(f"held-out {world.main_text} - first evaluation" + (" (mean)" if several else ""))
    ax.set_title("solid: ratio on SDE transitions; dashed: ODE rollouts, likelihood-free; "
                 "dotted: final-image ELBO; dash-dot: FDFO", fontsize=8)
    if several:
        # the forest's labels, in each config's colour, are the legend: the curves stay uncovered
        ends = {n: t_interval([r["final"] - r["first"] for r in e["runs"].values()]) for n, e in configs.items()}
        order = sorted(configs, key=lambda n: ends[n].mean)
        for y, name in enumerate(order):
            iv = ends[name]
            err = None if iv.half_width is None else [[iv.half_width], [iv.half_width]]
            fx.errorbar([iv.mean], [y], xerr=err, fmt="o", color=colours[name], capsize=3, ms=4)
        fx.set_yticks(range(len(order)), [f"{n} (n={ends[n].n})" for n in order], fontsize=7)
        for label, name in zip(fx.get_yticklabels(), order):
            label.set_color(colours[name])
        fx.axvline(0, color="grey", lw=0.8)
        fx.axvline(report["target_rise"], color="k", ls="--", lw=1)
        fx.set_xlabel("final - first evaluation, mean and 95% t interval over seeds")
        fx.set_title("where each config ends (labels: the curves' colours; no bar: one seed)", fontsize=8)
    else:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", choices=list(WORLDS), default="shapes",
                   help="shapes: recipes/study_embedded.toml, the verifier (default); compose: "
                        "recipes/study_compose.toml, GenEval's strict verdict")
    p.add_argument("--configs", nargs="*", default=None, choices=list(CONFIGS),
                   help="default: the world's set (shapes: the 16 of the recorded runs; compose: one per objective)")
    p.add_argument("--seeds", type=int, default=5, help="seeds 42 .. 42 + N - 1 (default 5)")
    p.add_argument("--seed-list", default=None, metavar="S1,S2,...", help="these seeds instead of --seeds")
    p.add_argument("--archive", type=Path, default=None,
                   help="where finished runs' curves are kept and reused (compose: default "
                        "benchmarks/results/time_to_reward_compose; shapes and --smoke: none; 'none': no archive)")
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=None, help="default: shapes 5, compose 10")
    p.add_argument("--target-rise", type=float, default=None, help="default: shapes 0.03, compose 0.10")
    p.add_argument("--jobs", type=int, default=None,
                   help="runs at once (train time then includes the neighbour's load; default: shapes 1, compose 2)")
    p.add_argument("--out", type=Path, default=None, help="default: runs/time_to_reward (shapes), "
                                                          "runs/time_to_reward_compose (compose)")
    p.add_argument("--smoke", action="store_true", help="2 iterations, a few evaluation prompts x 1 noise, 1 seed")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: report the runs the archive and --out hold, naming the ones missing")
    p.add_argument("--check", action="store_true",
                   help="validate every config's overrides on the world's base recipe, print, run nothing")
    args = p.parse_args(argv)
    world = WORLDS[args.world]
    if args.target_rise is None:
        args.target_rise = world.target_rise
    args.eval_every = world.eval_every if args.eval_every is None else args.eval_every
    args.jobs = world.jobs if args.jobs is None else args.jobs
    if args.out is None:
        args.out = REPO / "runs" / ("time_to_reward" if args.world == "shapes" else f"time_to_reward_{args.world}")
    if args.check:
        names = args.configs or list(CONFIGS)
        results = check(applicable(names, world), world)
        for name, verdict in results.items():
            print(f"{name}: {verdict}")
        return 1 if any(v.startswith("error") for v in results.values()) else 0
    if args.smoke:
        args.iterations, args.eval_every, args.seeds, args.seed_list = 2, 1, 1, None
        args.configs = args.configs or list(world.smoke)
    if args.seed_list is not None:  # as `flowrl sweep --seed-list` reads it
        try:
            args.seed_values = sorted(parse_seed_list(args.seed_list))
        except FlowrlError as e:
            p.error(str(e))
    else:
        args.seed_values = [42 + k for k in range(args.seeds)]
    if args.archive is None and not args.smoke and args.world in ARCHIVES:
        args.archive = REPO / ARCHIVES[args.world]
    elif args.archive is not None:
        args.archive = None if str(args.archive) == "none" else REPO / args.archive  # a relative path: from the repository root
    args.regime_sha256 = regime_sha256(world)
    asked = args.configs or list(world.defaults)
    args.configs = applicable(asked, world)
    args.skipped = {c: world.not_applicable[c] for c in asked if c in world.not_applicable}
    args.out.mkdir(parents=True, exist_ok=True)
    # seed-major: with --jobs 2 the configs of one seed run side by side, under the same load
    tasks = [(c, s) for s in args.seed_values for c in args.configs]
    if not args.report_only:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(lambda t: run(*t, args), tasks))
    report = summarise(args)
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (args.out / "report.md").write_text(text + "\n")
    chart(report, args.out / "time_to_reward.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
