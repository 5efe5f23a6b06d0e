"""Diagnostics: what ``flowrl doctor`` and ``flowrl selftest`` check, and the report they print.

- :mod:`flowrl.diagnostics.report`: a check's result (:class:`~flowrl.diagnostics.report.Check`),
  its printed line and its JSON, shared by both commands.
- :mod:`flowrl.diagnostics.doctor`: the environment checks (torch build, packages, devices,
  attention kernels, launcher, a recipe's memory plan and weights); no model runs.
- :mod:`flowrl.diagnostics.selftest`: a tiny FLUX trained on this machine's device (fast path,
  chunk-graph update, on-policy check, kill and resume, kernels, sharding).
- :mod:`flowrl.diagnostics.gpu_check`: ``flowrl selftest --gpu``, the one command that proves
  flowrl on a GPU: every step above plus the GPU test lane, the quickstart, a full-size FLUX.1-dev
  iteration and planned-against-measured memory, each in its own time budget.

These are diagnostics of a machine, not test support for plugin authors (that is
:mod:`flowrl.testing`): the test kit never imports the commands, and the commands never import
the test kit except through here.
"""
