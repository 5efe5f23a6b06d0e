"""Every built-in component honours its interface and the optional protocols it claims
(flowrl.testing.components), and every optional protocol in flowrl.interfaces is exercised."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Protocol

import pytest
import torch

from flowrl import interfaces
from flowrl.plugins import get_registry
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.testing.components import check_component

REPO = Path(__file__).resolve().parents[1]
PROFILE = str(REPO / "recipes" / "profiles" / "embedded.json")
#: Rewards that need downloaded weights, an extra or a server: they have their own tests (video_align's
#: conformance check runs on a tiny checkpoint there).
NEEDS_MORE = {"pickscore", "clip", "geneval", "hpsv3", "hpsv3_upstream", "http", "video_align", "vlm_judge"}
#: Params for components whose defaults cannot run alone here.
PARAMS = {("chunker", "dynamics"): {"profile": PROFILE}, ("schedule", "flux_dynamic"): {"image_seq_len": 1024},
          ("tracker", "wandb"): {"mode": "offline"},  # wandb: no network in tests
          ("loss", "gardo"): {"auxiliary": ["verifier"]},  # gardo needs an auxiliary reward label
          ("reward", "ocr"): {"device": "cpu", "threads": 1},  # ONNX Runtime ignores OMP_NUM_THREADS
          ("window", "branch"): {"steps": [1, 3], "factors": [2, 2]}}  # the default tree is filled in from a profile
#: What else a check needs: the 'model' schedule reads the adapter's own sigmas.
CONTEXT = {("schedule", "model"): {"model": SimpleNamespace(sigmas=lambda n: shifted_sigmas(n, 2.0))},
           # an editing reward reads the prompts' condition images from the metadata the engine passes
           ("reward", "condition_fidelity"): {"metadata": {"condition_images": torch.rand(
               3, 3, 32, 32, generator=torch.Generator().manual_seed(1))}},
           # the embedded video model's rewards read its grammar
           ("reward", "video_verifier"): {"prompts": ["a red circle moving left on a blue background"] * 3},
           ("reward", "video_motion"): {"prompts": ["a red circle moving left on a blue background"] * 3},
           # the compositional world's rewards read its grammar
           ("reward", "compose_geneval"): {"prompts": ["a red circle and a blue square", "two crosses", "a square"]},
           ("reward", "compose_geneval_strict"): {"prompts": ["a red circle and a blue square", "two crosses", "a square"]},
           ("reward", "compose_geneval_exact"): {"prompts": ["a red circle and a blue square", "two crosses", "a square"]},
           ("reward", "compose_clip"): {"prompts": ["a red circle and a blue square", "two crosses", "a square"]},
           # the OCR reward reads the text a prompt quotes
           ("reward", "ocr"): {"prompts": ['a shop sign that says "OPEN"'] * 3},
           # a reward that scores latents reads its model's (the embedded model's packed [64, 48])
           ("reward", "latent_verifier"): {"latents": torch.randn(3, 64, 48, generator=torch.Generator().manual_seed(2))}}
KINDS = ("schedule", "kernel", "chunker", "selector", "advantage", "loss", "likelihood", "window", "reward", "tracker")


def _builtins():
    registry = get_registry()
    for kind in KINDS:
        for name, comp in sorted(registry.components[kind].items()):
            if comp.plugin == "embedded" and kind != "reward" or (kind == "reward" and name in NEEDS_MORE):
                continue
            yield kind, name


@pytest.mark.parametrize("kind, name", list(_builtins()))
def test_builtin_component_conforms(kind, name, record_property):
    comp = get_registry().get(kind, name)
    extra = PARAMS.get((kind, name), {})
    params = comp.params(**extra) if comp.params is not None else None
    if kind == "tracker":
        pytest.importorskip(name)  # the tracker's extra: tensorboard, wandb
    claimed = check_component(kind, comp.build(params), **CONTEXT.get((kind, name), {}))
    record_property("protocols", claimed)


def test_every_optional_protocol_is_exercised_by_a_builtin():
    """A protocol no built-in implements would go untested: each must be claimed at least once."""
    registry = get_registry()
    claimed = set()
    for kind, name in _builtins():
        if kind == "tracker":
            continue
        comp = registry.get(kind, name)
        extra = PARAMS.get((kind, name), {})
        built = comp.build(comp.params(**extra) if comp.params else None)
        claimed |= set(check_component(kind, built, **CONTEXT.get((kind, name), {})))
    claimed |= {"Tracker", "NeedsRunDir", "RewindsOnResume"}  # the tensorboard and wandb trackers (checked above)
    model_protocols = {"ModelAdapter", "HasReferencePolicy", "CountsForwards", "DeclaresTimestep", "HasImageSeqLen", "HasLoraTargets",
                       "SavesLora", "SavesPretrained", "DiffusersLoraModule", "PlansMemory", "PlansRewardMemory", "HasShardableBlocks",
                       "RewardPlacement", "Reward", "TakesConditionImage", "HasBenchmarkSuites",
                           "EncodesImages"}  # checked by flowrl.testing.conformance and the plan tests
    protocols = {name for name, obj in vars(interfaces).items()
                 if inspect.isclass(obj) and obj is not Protocol and getattr(obj, "_is_protocol", False)}
    missing = protocols - claimed - model_protocols
    assert not missing, f"no built-in exercises {sorted(missing)} in flowrl.testing.components"
