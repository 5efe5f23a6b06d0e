"""Tiny offline FLUX and SD3 pipelines, built once per session and reloaded with HF_HUB_OFFLINE=1.

Nothing is downloaded: :mod:`flowrl.testing.tiny_pipelines` writes complete pipeline
directories (real diffusers / transformers classes, random weights, hand-made tokenizers) under
a session temp directory, and every test loads them from there by path.
"""

from __future__ import annotations

import os

# Before diffusers / huggingface_hub are imported by any test module: the hub reads it at import.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
#: --set overrides that shrink a real-model recipe to the tiny pipelines on a CPU.
TINY_MODEL = ["model.height=32", "model.width=32", "model.max_sequence_length=16", "model.dtype=fp32",
              "model.denoiser_dtype=auto", "model.vae_batch_size=8"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    dlog.disable_progress_bar()
    tlog.disable_progress_bar()
    tlog.set_verbosity_error()  # the tiny T5 truncation warnings are expected
    dlog.set_verbosity_error()
    return tmp_path_factory.mktemp("tiny_pipelines")


@pytest.fixture(scope="session")
def tiny_flux(tiny_dir) -> Path:
    from flowrl.testing.tiny_pipelines import build_tiny_flux

    return build_tiny_flux(tiny_dir / "flux")


@pytest.fixture(scope="session")
def tiny_flux_schnell(tiny_dir) -> Path:
    from flowrl.testing.tiny_pipelines import build_tiny_flux

    return build_tiny_flux(tiny_dir / "flux_schnell", guidance_embeds=False, seed=1)


@pytest.fixture(scope="session")
def tiny_sd3(tiny_dir) -> Path:
    from flowrl.testing.tiny_pipelines import build_tiny_sd3

    return build_tiny_sd3(tiny_dir / "sd3")


_TINY = dict(dtype="fp32", height=32, width=32, max_sequence_length=16)


@pytest.fixture(scope="session")
def make_flux(tiny_flux):
    """``make_flux(**config)``: a FLUX adapter on the tiny pipeline (fp32, 32x32 by default)."""
    from flowrl_plugins.diffusers_models.flux import FluxConfig, FluxModel

    return lambda **kw: FluxModel(FluxConfig(**{"path": str(tiny_flux), **_TINY, **kw}))


@pytest.fixture(scope="session")
def make_sd3(tiny_sd3):
    """``make_sd3(**config)``: an SD3 adapter on the tiny pipeline (true CFG 4.5 by default)."""
    from flowrl_plugins.diffusers_models.sd3 import SD3Config, SD3Model

    return lambda **kw: SD3Model(SD3Config(**{"path": str(tiny_sd3), **_TINY, **kw}))


@pytest.fixture(scope="session")
def flux_model(make_flux):
    """A shared FLUX adapter on the tiny pipeline. Do not modify it (deep-copy first)."""
    return make_flux()


@pytest.fixture(scope="session")
def sd3_model(make_sd3):
    """A shared SD3 adapter (true CFG 4.5) on the tiny pipeline. Do not modify it."""
    return make_sd3()


@pytest.fixture(scope="session")
def tiny_overrides():
    """``--set`` overrides that shrink a real-model recipe to the tiny pipelines on a CPU."""
    return list(TINY_MODEL)


class DiffusersCli:
    """``flowrl`` command lines for the diffusers tests, run through the ``flowrl_cli`` fixture in this
    process, from the repository root, 250 columns wide: ``run(*argv)`` -> (code, stdout, stderr);
    ``merged(*argv)`` -> (code, stdout followed by stderr), for a failure message."""

    def __init__(self, flowrl_cli):
        self.flowrl_cli = flowrl_cli

    def run(self, *argv):
        (result,) = self.flowrl_cli.in_process([[str(a) for a in argv]])
        return result.returncode, result.stdout, result.stderr

    def merged(self, *argv):
        code, out, err = self.run(*argv)
        return code, out + err

    def train_two_iterations_and_export(self, recipe, settings: list[str], out: Path) -> Path:
        """``flowrl train RECIPE --set ...`` into ``out / "run"`` (2 iterations, checked in its
        metrics), then ``flowrl export`` of it into ``out / "lora"``, which is returned."""
        from flowrl.runlog import read_metrics

        sets = [a for item in settings for a in ("--set", item)]
        run = out / "run"
        code, text = self.merged("train", recipe, *sets, "-o", run)
        assert code == 0, text
        assert [r["iteration"] for r in read_metrics(run)] == [0, 1]
        code, text = self.merged("export", run, "-o", out / "lora")
        assert code == 0, text
        return out / "lora"


@pytest.fixture(scope="module")
def module_cli(flowrl_cli) -> DiffusersCli:
    """The diffusers tests' ``flowrl`` runner for module-scoped fixtures (see :class:`DiffusersCli`)."""
    return DiffusersCli(flowrl_cli)


@pytest.fixture
def cli(module_cli):
    """``cli(*argv)`` -> (code, stdout, stderr), run from the repository root, wide output."""
    return module_cli.run


_RUN_GEOMETRY = ["train.iterations=2", "train.prompts_per_iteration=1", "train.group_size=2",
                 "train.micro_batch_size=2", "train.optimizer_steps_per_update=1", "rewards.0.use=brightness",
                 "log.progress=false", "log.image_every=0", "run.device=cpu", "model.gradient_checkpointing=false",
                 f"prompts.source=\"{REPO / 'recipes' / 'prompts' / 'general.txt'}\""]
# Large steps so that two updates visibly move the policy (these runs test plumbing, not learning).
_LORA = ["train.finetune=lora", "train.lora_rank=4", "train.lora_alpha=8.0", "train.lr=0.05", "train.max_grad_norm=0"]
_FULL = ["train.finetune=full", "train.lr=0.002", "train.max_grad_norm=0"]


def _train(recipe: str, model_path: Path, extra: list[str], out: Path) -> Path:
    from rich.console import Console

    from flowrl.recipe import load_recipe
    from flowrl.train import train

    overrides = [f"model.path={model_path}", *TINY_MODEL, *_RUN_GEOMETRY, *extra, f"run.output_dir=\"{out}\""]
    return train(load_recipe(REPO / "recipes" / recipe, overrides), console=Console(quiet=True))


@pytest.fixture(scope="session")
def flux_lora_run(tiny_flux, tmp_path_factory) -> Path:
    """A 2-iteration LoRA (r 4, alpha 8) run of recipes/chunk_grpo_flux.toml on the tiny FLUX."""
    return _train("chunk_grpo_flux.toml", tiny_flux, _LORA, tmp_path_factory.mktemp("runs") / "flux_lora")


@pytest.fixture(scope="session")
def flux_full_run(tiny_flux, tmp_path_factory) -> Path:
    """A 2-iteration full fine-tuning run of recipes/chunk_grpo_flux.toml on the tiny FLUX."""
    return _train("chunk_grpo_flux.toml", tiny_flux, _FULL, tmp_path_factory.mktemp("runs") / "flux_full")


@pytest.fixture(scope="session")
def sd3_lora_run(tiny_sd3, tmp_path_factory) -> Path:
    """A 2-iteration LoRA run of recipes/chunk_grpo_sd3.toml on the tiny SD3."""
    return _train("chunk_grpo_sd3.toml", tiny_sd3, _LORA, tmp_path_factory.mktemp("runs") / "sd3_lora")
