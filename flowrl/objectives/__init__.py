"""Objectives: what turns a rollout and its advantages into a gradient, one module per family.

- :mod:`~flowrl.objectives.base`: what the update and an objective hand each other (the
  :class:`~flowrl.objectives.base.UpdateContext`, a micro-batch and its result).
- :mod:`~flowrl.objectives.policy_gradient`: the ratio-based GRPO family (step GRPO, GSPO, chunks),
  its re-scoring of stored transitions and its per-micro-batch backward.
- :mod:`~flowrl.objectives.chunk_gradient`: its memory-lean chunk-level backward.
- :mod:`~flowrl.objectives.kl`: the KL term to the reference policy.
- :mod:`~flowrl.objectives.guard`: GRPO-Guard; :mod:`~flowrl.objectives.gardo`: GARDO;
  :mod:`~flowrl.objectives.nft`: DiffusionNFT.
- :mod:`~flowrl.objectives.losses`: surrogates and KL forms; :mod:`~flowrl.objectives.advantages`:
  group advantages.

Words: an *objective* (:class:`flowrl.interfaces.Objective`) is what an update optimises, owning
the forward and backward of each micro-batch; a *unit objective*
(:data:`flowrl.objectives.losses.UnitObjective`, a :class:`~flowrl.interfaces.PolicyLoss`'s
``objective``, e.g. :class:`~flowrl.objectives.losses.ClippedObjective`) is the per-unit loss
``(z [B, K], A [B, K]) -> [B, K]`` that the policy-gradient objective back-propagates.

The training loop (:mod:`flowrl.train`) calls these, handing them an ``UpdateContext``; they never
import it.
"""
