"""Prompt embeddings from a store on the diffusers models: built inside
``without_text_encoders()`` (as a run with ``[prompts] embeddings`` builds them), every text-to-image
and text-to-video adapter loads no text encoder or tokenizer and denoises from the stored
embeddings exactly as the adapter that encoded them; `flowrl embed` then `flowrl train` on the
tiny FLUX equals the run that encodes, and its session holds no text encoder."""

from __future__ import annotations

import importlib

import pytest
import torch
from conftest import REPO, TINY_MODEL

from flowrl.embeddings import without_text_encoders
from flowrl.errors import FlowrlError
from flowrl.runlog import read_metrics

ADAPTERS = {  # builder, module, config, model, settings
    "flux": ("build_tiny_flux", "flux", "FluxConfig", "FluxModel", {}),
    "sd3": ("build_tiny_sd3", "sd3", "SD3Config", "SD3Model", {}),
    "qwen_image": ("build_tiny_qwen_image", "qwen_image", "QwenImageConfig", "QwenImageModel", {"max_sequence_length": 64}),
    "flux2_klein": ("build_tiny_flux2_klein", "flux2", "Flux2KleinConfig", "Flux2KleinModel", {"max_sequence_length": 48}),
    "zimage": ("build_tiny_zimage", "zimage", "ZImageConfig", "ZImageModel", {"max_sequence_length": 64}),
    "wan": ("build_tiny_wan", "wan", "WanConfig", "WanModel", {"num_frames": 5}),
    "ltx": ("build_tiny_ltx", "ltx", "LTXConfig", "LTXModel", {"num_frames": 9, "width": 64}),
}


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_an_adapter_built_without_text_encoders_denoises_from_stored_embeddings(name, tiny_dir, tmp_path):
    from flowrl.testing import tiny_pipelines

    builder, module, config, model, settings = ADAPTERS[name]
    path = getattr(tiny_pipelines, builder)(tiny_dir / f"store_{name}")
    mod = importlib.import_module(f"flowrl_plugins.diffusers_models.{module}")
    cfg = getattr(mod, config)(**{"path": str(path), "dtype": "fp32", "height": 32, "width": 32,
                                  "max_sequence_length": 16, **settings})
    encoding = getattr(mod, model)(cfg)
    with without_text_encoders():
        reading = getattr(mod, model)(cfg)
    components = {n: c for n, c in reading.pipe.components.items() if n.startswith(("text_encoder", "tokenizer"))}
    assert components and all(c is None for c in components.values()), components
    assert any(getattr(encoding.pipe, n) is not None for n in components)
    text = {k: v[:1] for k, v in encoding.encode_prompts(["a red fox"]).items()}  # what a store holds
    x = torch.randn(1, *encoding.latent_shape, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.7])
    with torch.no_grad():
        torch.testing.assert_close(reading.velocity(x, sigma, text), encoding.velocity(x, sigma, text), rtol=0, atol=0)
    with pytest.raises(FlowrlError, match="loaded without its text encoders"):  # a pipeline without them is no pipeline
        reading.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _doc_commands() -> list[list[str]]:
    """The two commands of docs/models.md's section on the store, as argument lists."""
    text = (REPO / "docs" / "models.md").read_text()
    section = text[text.index("## Prompt embeddings from a store"):].split("\n## ", 1)[0]
    return [line.split()[1:] for line in section.splitlines() if line.startswith("    flowrl ")]


def test_the_docs_commands_on_the_tiny_flux_equal_the_run_that_encodes_and_load_no_text_encoder(tiny_flux, cli, tmp_path):
    """docs/models.md's `flowrl embed` and `flowrl train`, as written but for the tiny FLUX and a
    2-iteration geometry, beside the same run without the store."""
    from flowrl.recipe import load_recipe
    from flowrl.train.session import Session

    embed, train = _doc_commands()
    assert embed[:2] == ["embed", "recipes/chunk_grpo_flux.toml"] and train[:2] == ["train", embed[1]]
    sets = [f"model.path={tiny_flux}", *TINY_MODEL, "train.iterations=2", "train.prompts_per_iteration=1",
            "train.group_size=2", "train.micro_batch_size=2", "train.optimizer_steps_per_update=1",
            "rewards.0.use=brightness", "log.progress=false", "log.image_every=1", "run.device=cpu",
            "prompts.num_eval=2", "log.eval_every=1"]
    flags = [a for s in sets for a in ("--set", s)]
    relocate = lambda args: [a.replace("runs/", f"{tmp_path}/") for a in args]  # noqa: E731
    code, out, err = cli(*relocate(embed), *flags)
    assert code == 0, out + err
    for run, args in (("encoded", train[:2]), ("read", relocate(train))):
        code, out, err = cli(*args, *flags, "-o", tmp_path / run)
        assert code == 0, out + err
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "speed/"))} for r in rows]  # noqa: E731
    encoded, read = read_metrics(tmp_path / "encoded"), read_metrics(tmp_path / "read")
    assert len(encoded) == 3 and strip(encoded) == strip(read)
    store = relocate([train[-1]])[0]
    session = Session.open(load_recipe(REPO / embed[1], [*sets, store]), rewards=False)
    assert session.model.pipe.text_encoder is None and session.model.pipe.text_encoder_2 is None

    # sampling (a prompt the store lacks too), the run's evaluation and a whole-pipeline export of
    # the run that trained from the store load the encoders, and diffusers loads the export
    run = tmp_path / "read"
    for argv in (["sample", run, "--prompt", "a prompt no store holds", "--steps", "2", "--no-grid", "-o", tmp_path / "s"],
                 ["eval", run], ["export", run, "-o", tmp_path / "exported"]):
        code, out, err = cli(*argv)
        assert code == 0, (argv[0], out + err)
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tmp_path / "exported")
    assert pipe.text_encoder is not None and pipe.tokenizer_2 is not None
