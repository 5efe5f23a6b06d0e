"""Built-in plugin package: FLUX.1 and SD3 model adapters on diffusers (see docs/models.md)."""
