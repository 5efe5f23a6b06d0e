"""Objectives: what turns a rollout and its advantages into a gradient, one module per family.

- :mod:`~flowrl.objectives.base`: what the update hands an objective per micro-batch and gets back.
- :mod:`~flowrl.objectives.policy_gradient`: the ratio-based GRPO family (step GRPO, GSPO, chunks).
- :mod:`~flowrl.objectives.chunk_gradient`: its memory-lean chunk-level backward.
- :mod:`~flowrl.objectives.kl`: the KL term to the reference policy.
- :mod:`~flowrl.objectives.guard`: GRPO-Guard; :mod:`~flowrl.objectives.gardo`: GARDO;
  :mod:`~flowrl.objectives.nft`: DiffusionNFT.
- :mod:`~flowrl.objectives.losses`: surrogates and KL forms; :mod:`~flowrl.objectives.advantages`:
  group advantages.

The training loop (:mod:`flowrl.train`) calls these; they never import it.
"""
