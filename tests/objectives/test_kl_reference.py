"""Which objectives get the engine's KL reference (flowrl.objectives.kl.KLSettings.of).

The engine fixes one frozen reference before the denoiser is sharded and lays it out like the
denoiser (Strategy.prepare_frozen); an objective must not take its own copy later, which would
copy the sharded module outside what ``flowrl plan`` counts.
"""

from __future__ import annotations

import torch

from flowrl.interfaces import NeedsReferencePolicy
from flowrl.objectives.kl import KLSettings
from flowrl.objectives.nft import ForwardProcessObjective


class _Model:
    def __init__(self):
        self.denoiser = torch.nn.Linear(3, 3)


def _nft(beta_kl: float) -> ForwardProcessObjective:
    return ForwardProcessObjective(beta=1.0, clip=5.0, timesteps=2, decay_type=0, beta_kl=beta_kl)


def test_nft_with_a_velocity_kl_gets_the_engines_frozen_reference():
    model = _Model()
    nft = _nft(0.01)
    assert isinstance(nft, NeedsReferencePolicy) and nft.needs_reference()
    kl = KLSettings.of(nft, model)
    assert kl.beta == 0.0  # NFT's own KL term, not the ratio family's
    frozen = kl.reference.frozen
    assert frozen is not model.denoiser and not any(p.requires_grad for p in frozen.parameters())
    assert torch.equal(frozen.weight, model.denoiser.weight)


def test_nft_without_a_velocity_kl_gets_no_reference():
    assert KLSettings.of(_nft(0.0), _Model()).reference is None
