"""The compositional embedded model as a flowrl model: ``embedded_compose``.

The ``embedded`` adapter's code path (a tiny diffusers FLUX transformer over 64 packed tokens of
48 channels, the lossless pixel "VAE"), with the compositional grammar's prompts and its GenEval
suite: the held-out prompts, sampled and scored by the embedded detector under GenEval's rules.
"""

from __future__ import annotations

import dataclasses
from flowrl.config import param
from flowrl.interfaces import BenchmarkSuite

from ..adapter import EmbeddedConfig, PixelImageAdapter
from .evaluate import IMAGES_PER_CATEGORY, eval_items, score_images
from .grammar import all_prompts, metadata
from .network import ComposeT2I, load_compose_pretrained


@dataclasses.dataclass(frozen=True)
class ComposeConfig(EmbeddedConfig):
    weights: str = param("", "Path to compose.safetensors (and its .json); empty = the weights shipped in the package.", path=True)


class EmbeddedComposeModel(PixelImageAdapter):
    """Several coloured shapes on a 32x32 canvas from GenEval-style prompts; latent [64, 48]."""

    Config = ComposeConfig
    network_class = ComposeT2I
    load = staticmethod(load_compose_pretrained)

    def prompt_source(self):
        return all_prompts()

    def benchmark_suite(self, name):
        if name != "geneval":
            return None
        items = eval_items("eval", IMAGES_PER_CATEGORY)
        prompts = list(dict.fromkeys(p for p, _ in items))
        counts = {p: sum(1 for q, _ in items if q == p) for p in prompts}
        return BenchmarkSuite(
            name="geneval", prompts=prompts, images_per_prompt=[counts[p] for p in prompts],
            categories=[metadata(p)["tag"] for p in prompts], score=score_images, steps=16,
            description="the compositional world's held-out prompts, the embedded detector, GenEval's rules")
