"""`flowrl profile` end to end on the embedded model (random init), in-process: files, determinism,
--compare against a checkpoint, clean errors, and a training run of quickstart_dynamics."""

import json
from pathlib import Path

import pytest
import torch

from flowrl.runlog import read_metrics

ROOT = Path(__file__).resolve().parents[2]
BASE = ["profile", "--model", "embedded", "--model-param", "random_init=true", "--steps", "6",
        "--num-prompts", "4", "--seeds", "2", "--num-chunks", "2"]


def test_profile_writes_files_and_is_deterministic(tmp_path, flowrl_cli):
    first, again = flowrl_cli.in_process([BASE + ["-o", str(tmp_path / "a")],
                                          BASE + ["--batch-size", "3", "--no-plot", "-o", str(tmp_path / "b.json")]])
    assert first.returncode == 0, first.stderr
    out = first.stdout
    assert "Chunk proposals" in out and 'use = "explicit"' in out
    data = json.loads((tmp_path / "a" / "profile.json").read_text())
    assert (tmp_path / "a" / "profile.png").stat().st_size > 10_000
    assert data["settings"]["model"] == {"use": "embedded", "weights": "", "random_init": True, "seed": 0,
                                         "timestep_conditioning": "exact"}
    assert data["settings"]["kernel"] == {"use": "flow", "a": 0.7} and len(data["positions"]) == 5
    assert len(data["settings"]["prompts"]) == 4 and data["settings"]["num_seeds"] == 2
    for method in ("dp", "curvature", "derivative"):
        assert sum(data["proposals"]["l1rel"][method]["sizes"]) == 5
    # same seed, other batch size and a .json output path: same curves and boundaries
    assert again.returncode == 0, again.stderr
    again = json.loads((tmp_path / "b.json").read_text())
    sizes = {c: {m: p["sizes"] for m, p in by.items()} for c, by in data["proposals"].items()}
    assert {c: {m: p["sizes"] for m, p in by.items()} for c, by in again["proposals"].items()} == sizes
    for name, entry in data["curves"].items():
        assert again["curves"][name]["mean"] == pytest.approx(entry["mean"], rel=1e-5)
    assert not (tmp_path / "b.png").exists()


def test_profile_options_and_errors(tmp_path, flowrl_cli):
    dance, curve, ode, chunks, compare = flowrl_cli.in_process([
        BASE + ["--kernel", "dance", "--noise", "0.5", "--no-plot", "-o", str(tmp_path / "d")],
        BASE + ["--curve", "nope"],
        BASE + ["--kernel", "ode", "--noise", "0.1"],
        BASE + ["--num-chunks", "9"],
        ["profile", "--compare", str(tmp_path)],
    ])
    assert dance.returncode == 0, dance.stderr
    data = json.loads((tmp_path / "d" / "profile.json").read_text())
    assert data["settings"]["kernel"] == {"use": "dance", "eta": 0.5}
    assert curve.returncode == 2 and "unknown curve 'nope'" in curve.stderr
    assert ode.returncode == 2 and "no single noise parameter" in ode.stderr
    assert chunks.returncode == 2 and "cannot be cut into num_chunks = 9" in chunks.stderr
    assert compare.returncode == 2 and "no recipe.toml" in compare.stderr


def test_compare_against_a_checkpoint(tmp_path, flowrl_cli):
    from flowrl.recipe import dump_toml, load_recipe
    from flowrl.train.checkpoint import save_checkpoint
    from flowrl.train.finetune import trainable_state_dict
    from flowrl_plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel

    recipe = load_recipe(ROOT / "recipes" / "quickstart_hacking.toml", ["model.random_init=true", "sampler.steps=6", "chunker.use=step"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "recipe.toml").write_text(dump_toml(recipe.to_toml_dict()))
    model = EmbeddedModel(EmbeddedConfig(random_init=True))
    model.denoiser.requires_grad_(True)
    with torch.no_grad():  # a "trained" policy: every weight moved a little
        for p in model.denoiser.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_checkpoint(run_dir / "checkpoints", "iter_000001", model=trainable_state_dict(model.denoiser),
                    optimizer={"state": {}, "param_groups": []}, state={"iteration": 1}, recipe_toml="")
    (compared,) = flowrl_cli.in_process([["profile", "--compare", str(run_dir), "--num-prompts", "4", "--seeds", "1"]])
    assert compared.returncode == 0, compared.stderr
    out_dir = run_dir / "profile"
    base = json.loads((out_dir / "base.json").read_text())
    trained = json.loads((out_dir / "trained.json").read_text())
    summary = json.loads((out_dir / "compare.json").read_text())
    assert (out_dir / "compare.png").is_file()
    assert trained["settings"]["weights"].endswith("iter_000001")
    assert base["curves"]["v_change"]["mean"] != trained["curves"]["v_change"]["mean"]
    change = summary["curves"]["l1rel"]
    assert change["relative_change"][0] == pytest.approx((change["trained"][0] - change["base"][0]) / change["base"][0])
    assert "proposals on l1rel" in compared.stdout


def test_quickstart_dynamics_trains(tmp_path, flowrl_cli):
    # from the repository root: profile paths in the recipe are relative to it
    args = ["train", "recipes/quickstart_dynamics.toml", "-o", str(tmp_path / "run"),
            "--set", "model.random_init=true", "--set", "train.iterations=1", "--set", "train.prompts_per_iteration=1",
            "--set", "train.group_size=2", "--set", "train.micro_batch_size=2", "--set", "prompts.num_eval=0",
            "--set", "log.progress=false", "--set", "log.image_every=0"]
    (trained,) = flowrl_cli.in_process([args], cwd=ROOT)
    assert trained.returncode == 0, trained.stderr
    record = read_metrics(tmp_path / "run")[0]
    from flowrl.dynamics.profile_file import read_profile

    expected = read_profile(ROOT / "recipes" / "profiles" / "embedded.json")
    assert sum(record["chunk_sizes"]) == 16 and len(record["chunk_sizes"]) == 4
    assert all(len(units) == 2 for units in record["trained_units"])  # weighted: 2 of 4 chunks
    assert expected["format"] == "flowrl-profile"


@pytest.mark.slow
def test_the_profile_pages_commands_run_as_written(tmp_path, flowrl_cli):
    """docs/profile.md's command block, line by line, from a directory holding ``recipes/`` (the
    run that ``--compare runs/quickstart`` reads: the quickstart trained for 2 iterations)."""
    import re

    REPO = Path(__file__).resolve().parents[2]

    text = (REPO / "docs" / "profile.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```bash\n(.*?)```", text, re.S)[:1]
    commands = [line.split("#")[0].split()[1:] for line in block.splitlines() if line.startswith("flowrl ")]
    assert len(commands) == 5 and commands[-1][:2] == ["profile", "--compare"]
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    train = ["train", "recipes/quickstart.toml", "--set", "train.iterations=2", "--set", "prompts.eval_seeds=1",
             "--set", "log.progress=false"]
    results = flowrl_cli.in_process([train, *commands], cwd=tmp_path)
    for r in results:
        assert r.returncode == 0 and "Traceback" not in r.stderr, (r.argv, r.stderr[-2000:])
    assert (tmp_path / "out" / "profile.json").is_file() and list((tmp_path / "profiles").glob("*/profile.json"))
