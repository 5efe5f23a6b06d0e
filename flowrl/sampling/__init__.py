"""Sampling: what makes a trajectory, one module per concern.

- :mod:`~flowrl.sampling.schedules`: sigma schedules.
- :mod:`~flowrl.sampling.kernels`: the step kernels (SDE and ODE) and their log-probs.
- :mod:`~flowrl.sampling.solvers`: deterministic multistep solvers (DPM-Solver++(2M)).
- :mod:`~flowrl.sampling.trajectory`: the stored rollout.
- :mod:`~flowrl.sampling.rollout`: the one rollout loop (``rollout_steps``, driven by a per-step
  plan), the plain rollout on it, re-scoring, and the ODE sampler (``ode_sample``).
- :mod:`~flowrl.sampling.windows` and :mod:`~flowrl.sampling.plans`: where the SDE window sits,
  and rollouts whose window moves per iteration or per sample.
- :mod:`~flowrl.sampling.branching`: branch (tree) rollouts and their advantages.
"""
