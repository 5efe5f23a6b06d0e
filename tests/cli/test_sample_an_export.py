"""An export of an embedded run is sampled as docs/embedded.md says (`flowrl sample --weights`, and
the Python snippet that loads the transformer with diffusers), and gives the run's own images.

A new user's trial: the quickstart's export held `transformer/` only, so the README's
`Pipeline.from_pretrained(OUT)` did not apply, `from diffusers import FluxTransformer2DModel`
failed beside a CUDA torchvision until flowrl's compatibility call ran, and no page said how to
sample the export. One tiny full fine-tune of the shipped embedded model (one iteration, a high
learning rate so that its weights move) is trained and exported once for the module.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tiny_recipe import tiny_recipe

from flowrl.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "embedded.md"
SECTION = DOC.read_text(encoding="utf-8").split("## Sampling an export", 1)[1].split("\n## ", 1)[0]
RECIPE = tiny_recipe(run={"name": "export_me", "seed": 5}, model={"random_init": None},
                     train={"iterations": 1, "lr": 1e-3})
PROMPT = "a red circle on a blue background"


def quiet():
    import os

    from rich.console import Console

    return Console(file=open(os.devnull, "w"), width=200)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, flowrl_cli):
    """``(root, run_dir, export_dir)``: the run at ``root/runs/quickstart`` (the path the doc's
    commands name) and its export, written by the doc's own `flowrl export` line."""
    from flowrl.train import train

    root = tmp_path_factory.mktemp("export")
    (root / "tiny.toml").write_text(RECIPE)
    run = train(load_recipe(root / "tiny.toml", [f"run.output_dir={json.dumps(str(root / 'runs' / 'quickstart'))}"]),
                console=quiet())
    export_line, sample_line = doc_commands()
    (result,) = flowrl_cli.in_process([export_line], cwd=root)
    assert result.returncode == 0, result.stderr
    out = root / export_line[export_line.index("-o") + 1]
    return root, Path(run), out, result


def doc_commands() -> list[list[str]]:
    import shlex

    (block,) = re.findall(r"```bash\n(.*?)```", SECTION, flags=re.S)
    lines = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert [line[:2] for line in lines] == [["flowrl", "export"], ["flowrl", "sample"]], lines
    return [line[1:] for line in lines]


def pixels(folder: Path) -> dict[str, bytes]:
    import numpy as np
    from PIL import Image

    return {p.name: np.asarray(Image.open(p).convert("RGB")).tobytes() for p in sorted(folder.glob("*.png"))}


def test_the_export_is_the_transformer_and_says_how_to_sample_it(exported):
    root, run, out, result = exported
    info = json.loads((out / "flowrl_export.json").read_text())
    assert info["format"] == "diffusers_model" and info["model"] == "embedded"
    assert info["model_table"]["use"] == "embedded" and info["model_table"]["random_init"] is False
    assert sorted(p.name for p in (out / "transformer").iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    said = result.flat_out
    assert f"sample it with: flowrl sample --weights {out.name} --prompt" in said  # as the doc wrote -o
    assert "FluxTransformer2DModel.from_pretrained(" in said and "ensure_torchvision_importable()" in said


def test_the_documented_sample_command_runs_as_written(exported, flowrl_cli):
    root, run, out, _ = exported
    _, sample_line = doc_commands()
    (result,) = flowrl_cli.in_process([sample_line], cwd=root)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    written = root / "runs" / "samples" / "quickstart_export"  # where the doc says it writes
    assert len(pixels(written / "images")) == int(sample_line[sample_line.index("--seeds") + 1])
    settings = json.loads((written / "settings.json").read_text())
    assert settings["weights"] == "quickstart_export" and settings["steps"] == 28  # `--model embedded`'s default


def test_the_documented_python_snippet_runs_as_written(exported, monkeypatch, capsys):
    root, run, out, _ = exported
    (code,) = re.findall(r"```python\n(.*?)```", SECTION, flags=re.S)
    monkeypatch.chdir(root)
    exec(compile(code, str(DOC), "exec"), {"__name__": "__doc_snippet__"})
    printed = capsys.readouterr().out
    scores = [float(x) for x in re.findall(r"\d\.\d+", printed)]
    assert len(scores) == 4 and all(0.0 <= s <= 1.0 for s in scores), printed


def test_sampling_the_export_gives_the_runs_own_images(exported, flowrl_cli):
    """The same prompt, seed, steps and schedule: the export's images are the run checkpoint's,
    pixel for pixel, and not the base model's (the weights were loaded, not the shipped ones)."""
    root, run, out, _ = exported
    same = ["--prompt", PROMPT, "--seeds", "2", "--seed", "0", "--steps", "5", "--schedule", "shift"]
    calls = [["sample", str(run), *same, "-o", str(root / "from_run")],
             ["sample", "--weights", str(out), *same, "-o", str(root / "from_export")],
             ["sample", "--model", "embedded", *same, "-o", str(root / "base")]]
    for r in flowrl_cli.in_process(calls, cwd=root):
        assert r.returncode == 0 and "Traceback" not in r.stderr, (r.argv, r.stderr)
    from_run, from_export, base = (pixels(root / name / "images") for name in ("from_run", "from_export", "base"))
    assert len(from_run) == 2 and from_export == from_run
    assert from_export != base


def test_the_rebuilt_model_holds_every_exported_weight(exported):
    import torch

    from flowrl.commands.inference import load_policy, resolve_source
    from flowrl.commands.sample import export_overrides, load_exported_weights, read_export

    root, run, out, _ = exported
    trained = load_policy(resolve_source(run, None, [], None), "cpu").denoiser.state_dict()
    info = read_export(out, None, None)
    policy = load_policy(resolve_source(None, info["model"], export_overrides(info), None), "cpu")
    moved = [k for k, v in policy.denoiser.state_dict().items() if not torch.equal(v, trained[k])]
    assert moved  # the base differs from the trained transformer before loading
    load_exported_weights(policy, out, info)
    loaded = policy.denoiser.state_dict()
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in trained)


def test_what_weights_cannot_sample_is_one_message(exported, tmp_path, flowrl_cli):
    root, run, out, _ = exported
    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / "flowrl_export.json").write_text(json.dumps({"format": "diffusers_model_lora", "model": "embedded"}))
    old = tmp_path / "old"
    old.mkdir()
    (old / "flowrl_export.json").write_text(json.dumps({"format": "diffusers_model", "model": "embedded"}))
    base = ["--prompt", PROMPT]
    calls = {
        "with_a_run": ["sample", str(run), "--weights", str(out), *base],
        "not_an_export": ["sample", "--weights", str(tmp_path), *base],
        "a_lora": ["sample", "--weights", str(lora), *base],
        "older_export": ["sample", "--weights", str(old), *base],
        "other_model": ["sample", "--weights", str(out), "--model", "embedded_video", *base],
        "compare_base": ["sample", "--weights", str(out), "--compare-base", *base],
    }
    results = dict(zip(calls, flowrl_cli.in_process(list(calls.values()), cwd=tmp_path)))
    for name, r in results.items():
        assert r.returncode == 2 and "Traceback" not in r.stderr, (name, r.stderr)
    assert "give no run, checkpoint or recipe with it" in results["with_a_run"].flat_err
    assert "no flowrl_export.json" in results["not_an_export"].flat_err
    assert "'diffusers_model_lora'" in results["a_lora"].flat_err and "--merge" in results["a_lora"].flat_err
    assert "export the run again" in results["older_export"].flat_err
    assert "is an export of 'embedded'" in results["other_model"].flat_err
    assert "--compare-base needs a trained checkpoint" in results["compare_base"].flat_err


def test_export_and_sample_name_the_same_formats():
    from flowrl.commands.export import SAMPLED_BY_WEIGHTS
    from flowrl.commands.sample import EXPORTED_WEIGHTS

    assert set(SAMPLED_BY_WEIGHTS) == set(EXPORTED_WEIGHTS)


def test_the_readme_says_how_to_load_an_embedded_export():
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    row = next(line for line in readme.split("| `flowrl ") if line.startswith("export RUN_DIR"))
    assert "flowrl sample --weights OUT" in row and "ensure_torchvision_importable()" in row
    assert "operator torchvision::nms does not exist" in row and "docs/embedded.md#sampling-an-export" in row
