"""Test helpers shipped with flowrl, for plugin authors as much as for flowrl itself.

- :mod:`flowrl.testing.conformance`: the model-adapter conformance suite
  (``check_adapter(adapter)``, or ``run_check(adapter, name)`` per pytest test).
- :mod:`flowrl.testing.tiny_pipelines`: tiny random FLUX, SD3, Qwen-Image, FLUX.2 [klein] and
  Z-Image diffusers pipelines built offline (``build_tiny_flux(path)``, ``build_tiny_sd3(path)``,
  ``build_tiny_qwen_image(path)``, ``build_tiny_flux2_klein(path)``, ``build_tiny_zimage(path)``)
  to test against the real code paths without downloading weights.
"""
