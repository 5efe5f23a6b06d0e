"""Temporal dynamics of a sampler, and chunk boundaries from them (``flowrl profile``).

- :mod:`~flowrl.dynamics.measure`: the curves (L1rel, x0_hat and velocity change) of the
  training sampler, with their spread across prompts and seeds;
- :mod:`~flowrl.dynamics.segment`: the segmentation rules that turn a curve into chunk sizes;
- :mod:`~flowrl.dynamics.report`: the terminal report and the plot;
- :mod:`~flowrl.dynamics.profile_file`: ``profile.json``, which the ``dynamics`` chunker and the
  ``weighted`` selector read.
"""
