"""Objectives with state of their own (DiffusionNFT's and the ELBO losses' old policy; GARDO's reset reference, gate
share and reset counter) resume exactly: interrupted after iteration 1 and resumed, the metrics
and the weights equal the uninterrupted run's bit for bit. AWM, Flow-DPPO, online DPO and DGPO keep
nothing across iterations (AWM's anchors, Flow-DPPO's step KLs and the preference objectives'
rollout errors live for one rollout): their checkpoints hold
no objective state, and they resume exactly too (two passes per rollout, so the anchors and the
KL mask take part)."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_helpers import REPO, InterruptAt, load, quiet_console

from flowrl.plugins import temporary_plugin
from flowrl.runlog import read_metrics
from flowrl.train import train
from flowrl.train.checkpoint import latest_checkpoint, load_checkpoint

SHORT = ["train.iterations=3", "train.prompts_per_iteration=2", "train.group_size=4", "train.micro_batch_size=4",
         "checkpoint.every=1", "log.eval_every=100", "prompts.num_eval=2", "log.image_every=0", "log.progress=false"]
# the recipe is copied away from its prompt file (recipes/prompts/shapes.csv)
SHAPES = [f"prompts.source={str(REPO / 'recipes' / 'prompts' / 'shapes.csv')!r}"]
CASES = {
    "nft": ("quickstart_nft.toml", ["sampler.steps=9", "loss.timesteps=4"]),
    # a reset of the reference before the interrupt, so the reset reference must be restored
    "gardo": ("quickstart_gardo.toml", ["loss.reset_every=1", "sampler.steps=9", "chunker.sizes=[2, 2, 4]"]),
    # the reference kept in CPU memory (accelerate's cpu_offload: its parameters are meta), reset and saved
    "gardo_reference_on_cpu": ("quickstart_gardo.toml", ["loss.reset_every=1", "sampler.steps=9",
                                                         "chunker.sizes=[2, 2, 4]", "train.reference_on_cpu=true"]),
    "awm": ("quickstart_awm.toml", [*SHAPES, "sampler.steps=9", "train.updates_per_rollout=2", "loss.timesteps=3"]),
    "dppo": ("quickstart_dppo.toml", [*SHAPES, "sampler.steps=17", "sampler.sde_window=[0, 4]",
                                      "loss.kl_threshold=1e-8"]),
    "dpo": ("quickstart_dpo.toml", [*SHAPES, "sampler.steps=9", "train.updates_per_rollout=2", "loss.timesteps=2"]),
    "dgpo": ("quickstart_dgpo.toml", [*SHAPES, "sampler.steps=9", "train.updates_per_rollout=2", "loss.timesteps=2"]),
    # the ELBO's trailing old policy (decay type 1: it differs from the trained weights after the first
    # step) is state; two passes per rollout, so the second scores against it off-policy
    "epg": ("quickstart_epg.toml", [*SHAPES, "sampler.steps=9", "train.updates_per_rollout=2", "likelihood.timesteps=3"]),
    "pepg": ("quickstart_pepg.toml", [*SHAPES, "sampler.steps=9", "train.updates_per_rollout=2",
                                      "likelihood.timesteps=3"]),
    "par": ("quickstart_par.toml", [*SHAPES, "sampler.steps=9", "train.updates_per_rollout=2", "likelihood.timesteps=3"]),
    "vgrpo": ("quickstart_vgrpo.toml", [*SHAPES, "sampler.steps=9", "train.updates_per_rollout=2",
                                        "likelihood.timesteps=3"]),
    # FDFO's rollout weights (a trailing copy) score v_ref on the second pass
    "fdfo": ("quickstart_fdfo.toml", [*SHAPES, "sampler.steps=9", "train.updates_per_rollout=2", "loss.timesteps=2",
                                      "train.group_size=2", "train.prompts_per_iteration=4"]),
}
STATELESS = {"awm", "dppo", "dpo", "dgpo"}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_objective_state_resumes_bitwise(tmp_path, name):
    recipe_name, extra = CASES[name]
    recipe = tmp_path / recipe_name
    shutil.copy(REPO / "recipes" / recipe_name, recipe)
    sets = [*SHORT, *extra]
    whole = train(load(recipe, *sets, f"run.output_dir={str(tmp_path / 'whole')!r}"), console=quiet_console())
    saved = load_checkpoint(latest_checkpoint(whole))
    if name in STATELESS:
        assert not saved.get("objective"), "no objective state expected"
    else:
        assert "objective" in saved["state"] and saved["objective"], saved["state"].keys()

    parts = tmp_path / "parts"
    tracked = tmp_path / f"tracked_{recipe_name}"
    tracked.write_text(recipe.read_text() + '\n[[trackers]]\nuse = "interrupt_at"\n')
    with temporary_plugin(InterruptAt(1), name="interrupt-at-1"):
        with pytest.raises(KeyboardInterrupt):
            train(load(tracked, *sets, f"run.output_dir={str(parts)!r}"), console=quiet_console())
    assert latest_checkpoint(parts).name == "iter_000002"
    train(load(recipe, *sets, f"run.output_dir={str(parts)!r}"), resume=parts, console=quiet_console())

    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    assert strip(read_metrics(parts)) == strip(read_metrics(whole))
    got = load_checkpoint(latest_checkpoint(parts))
    for part in ("model",) if name in STATELESS else ("model", "objective"):
        assert sorted(got[part]) == sorted(saved[part])
        for k, v in saved[part].items():
            assert torch.equal(got[part][k], v), (part, k)
