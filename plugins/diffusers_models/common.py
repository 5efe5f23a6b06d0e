"""What the FLUX and SD3 adapters share: loading, dtypes, devices, offloading, LoRA targets,
the reference model for KL, and export.

An adapter wraps a diffusers pipeline. ``denoiser`` is the pipeline's transformer (the module
that is trained and that LoRA attaches to); the text encoders and the VAE stay frozen and, with
``offload_encoders = true``, live on the CPU and visit the GPU only while they encode or decode.

Precision: ``dtype`` is the compute dtype and the storage dtype of the frozen parts;
``denoiser_dtype`` stores the transformer's weights. Full fine-tuning in bf16 storage loses
updates below bf16's resolution (an AdamW step of 1e-5 on a weight of 0.02 rounds away), so full
fine-tuning recipes keep the transformer in fp32 (``denoiser_dtype = "fp32"``) and compute in
bf16 under autocast; LoRA keeps the base in bf16 (peft keeps its own matrices in fp32).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterable, Sequence

import torch

from flowrl.compat import ensure_torchvision_importable
from flowrl.distributed import receives_weights
from flowrl.embeddings import loading_text_encoders
from flowrl.errors import FlowrlError
from flowrl.objectives.kl import frozen_copy

from .loading import dtype_kwarg, load_pipeline, resolve_dtype
from .quantize import is_quantized, quantize_blocks

#: LoRA target presets (module-name suffixes, as peft matches them). "attention" is DanceGRPO's
#: choice (with r = 128, alpha = 256); "attention_ff" is Flow-GRPO FLUX's (r = 64, alpha = 128).
ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
FEED_FORWARD = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]


def has_lora(module: torch.nn.Module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in module.modules())


@contextlib.contextmanager
def lora_disabled(module: torch.nn.Module):
    """Run ``module`` as its base model: every peft LoRA layer bypassed, restored afterwards."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    previous = [not m.disable_adapters for m in layers]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m, enabled in zip(layers, previous):
            m.enable_adapters(enabled)


def grid_ids(grid: tuple[int, int], width: int, first: float = 0.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[h * w, width]`` position ids of a token grid ``(h, w)``, row-major like the packing:
    ``(first, row, col, 0, ...)`` (FLUX.1: ``(0 or 1, row, col)``; FLUX.2: ``(0, row, col, 0)``)."""
    h, w = grid
    ids = torch.zeros(h, w, width, dtype=dtype)
    ids[..., 0] = first
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, width)


def pack_2x2(vae_latents: torch.Tensor) -> torch.Tensor:
    """VAE latents ``[B, C, H/8, W/8]`` -> tokens ``[B, seq, 4C]``: 2x2 patches, channel order
    ``c, dy, dx``, row-major (FLUX.1's and Qwen-Image's packing)."""
    b, c, hh, ww = vae_latents.shape
    x = vae_latents.reshape(b, c, hh // 2, 2, ww // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (hh // 2) * (ww // 2), 4 * c)


def unpack_2x2(latents: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Tokens ``[B, seq, 4C]`` on a ``grid`` of ``(h, w)`` tokens -> ``[B, C, 2h, 2w]`` (inverse of
    :func:`pack_2x2`)."""
    b, _, c4 = latents.shape
    h, w = grid
    x = latents.reshape(b, h, w, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, 2 * h, 2 * w)


def preset_targets(preset: str, attention, feed_forward) -> list[str]:
    """The LoRA targets of a ``lora_preset``: ``attention``, plus ``feed_forward`` for ``attention_ff``."""
    return list(attention) + (list(feed_forward) if preset == "attention_ff" else [])


class DiffusersAdapter:
    """Base class of the diffusers-backed adapters (see :mod:`flowrl.interfaces`)."""

    #: the diffusers pipeline class (FluxPipeline, StableDiffusion3Pipeline); also writes LoRAs.
    pipeline_class_name: str = ""
    #: default LoRA target modules (replaced per instance from ``lora_preset``).
    lora_targets: list[str] = ATTENTION
    #: true classifier-free guidance: the network runs an unconditional row beside each sample
    uses_cfg: bool = False
    #: no prompts of its own (prompt_source() is None): `flowrl validate` refuses [prompts] source = "model"
    ships_prompts: bool = False
    #: the components that make up the denoiser: built without weights on a process that receives them
    empty_components: tuple[str, ...] = ("transformer",)
    #: the pipeline's frozen components (text encoders, VAE), in the order they are moved and frozen
    frozen_names: tuple[str, ...] = ("text_encoder", "vae")
    #: built inside :func:`flowrl.embeddings.without_text_encoders`, it loads no text encoder
    loads_without_text_encoders: bool = True

    @property
    def forwards_per_velocity(self) -> int:
        """Network rows per sample in one velocity call (flowrl.interfaces.CountsForwards)."""
        return 2 if self.uses_cfg else 1

    def __init__(self, config, where: str):
        # With flowrl-diffusion[clip] on a CPU machine, torchvision may be a CUDA build whose compiled ops
        # fail to load, which breaks diffusers' and transformers' imports (flowrl.compat).
        ensure_torchvision_importable()
        self.config = config
        self.where = where
        self.dtype = resolve_dtype(config.dtype, f"{where}.dtype")
        self.denoiser_dtype = (
            self.dtype if config.denoiser_dtype == "auto" else resolve_dtype(config.denoiser_dtype, f"{where}.denoiser_dtype")
        )
        self.device = torch.device("cpu")
        self.text_encoders_loaded = loading_text_encoders()  # not with prompt embeddings from a store
        self.pipe = self._load()
        self.denoiser = self._denoiser_of(self.pipe)
        if self.denoiser_dtype != self.dtype:
            self.denoiser.to(self.denoiser_dtype)
        self.quantize = getattr(config, "quantize", "none")
        if self.quantize != "none":  # a frozen NF4 / int8 base for LoRA (quantize.py)
            if self.denoiser_dtype != self.dtype:
                raise FlowrlError("a quantised base keeps no master weights: denoiser_dtype must be 'auto'",
                                  where=f"{where}.denoiser_dtype", hint='set model.denoiser_dtype = "auto"')
            quantize_blocks(self.denoiser, self.quantize, self.dtype, f"{where}.quantize")
        for module in self._frozen_modules() + [self.denoiser]:
            module.requires_grad_(False)
            module.eval()
        if config.gradient_checkpointing:
            self.denoiser.enable_gradient_checkpointing()
        self.lora_targets = self._lora_preset(config.lora_preset)
        self._reference: torch.nn.Module | None = None
        self._reference_mode: str | None = None
        self._on_device: dict[str, torch.Tensor] = {}

    def _check_image_size(self, multiple_of_vae: int, why: str, vae_scale: int | None = None) -> int:
        """Set ``vae_scale`` and check height and width are multiples of ``vae_scale * multiple_of_vae``.

        Returns that step (pixels per latent token). ``why`` names the extra factor in the error.
        ``vae_scale`` defaults to an ``AutoencoderKL``'s ``2 ** (len(block_out_channels) - 1)``;
        VAEs that downsample differently pass their own.
        """
        self.vae_scale = vae_scale or 2 ** (len(self.pipe.vae.config.block_out_channels) - 1)
        step = self.vae_scale * multiple_of_vae
        for key in ("height", "width"):
            value = getattr(self.config, key)
            if value % step:
                raise FlowrlError(
                    f"{key} = {value} is not a multiple of {step} (VAE factor {self.vae_scale} x {why})",
                    where=f"{self.where}.{key}", hint=f"use a multiple of {step}",
                )
        return step

    def _check_frame_count(self) -> None:
        """Check ``num_frames`` is ``k * vae_scale_temporal + 1`` (the video VAE compresses time after
        the first frame); ``vae_scale_temporal`` is set by the video adapter first."""
        num_frames, factor = self.config.num_frames, self.vae_scale_temporal
        if (num_frames - 1) % factor:
            raise FlowrlError(
                f"num_frames = {num_frames} is not a multiple of the VAE's temporal factor {factor} plus 1",
                where=f"{self.where}.num_frames", hint=f"use {(num_frames - 1) // factor * factor + 1}",
            )

    def _packed_grid(self, why: str, latent_channels: int, channels_name: str, vae_scale: int | None = None) -> int:
        """For the adapters whose latents are 2x2-packed tokens ``[(H/16) * (W/16), 4 C]`` (FLUX.1,
        FLUX.2, Qwen-Image): check the image size (``why`` as in :meth:`_check_image_size`) and that
        the transformer reads ``4 x`` the VAE's ``latent_channels`` (``channels_name``: that VAE
        config field, for the error), then set ``grid``, ``latent_shape`` and ``image_seq_len``.
        Returns the transformer's input channels."""
        step = self._check_image_size(2, why, vae_scale)
        self.grid = (self.config.height // step, self.config.width // step)
        channels = self.denoiser.config.in_channels
        if channels != 4 * latent_channels:
            raise FlowrlError(
                f"transformer in_channels ({channels}) != 4 x VAE {channels_name} ({latent_channels})",
                where=f"{self.where}.path", hint="the pipeline's transformer and VAE do not belong together",
            )
        self.latent_shape = (self.grid[0] * self.grid[1], channels)
        self.image_seq_len = self.latent_shape[0]
        return channels

    # ---- loading ------------------------------------------------------------------------------

    @property
    def pipeline_class(self):
        import diffusers

        return getattr(diffusers, self.pipeline_class_name)

    def _load_kwargs(self) -> dict:
        return {}

    def _load(self):
        # a process that receives the denoiser's weights from rank 0 (fsdp2) builds it empty; a
        # quantised base is made from loaded weights, so it loads them
        empty = receives_weights() and getattr(self.config, "quantize", "none") == "none"
        return load_pipeline(
            self.pipeline_class, self.config.path, where=f"{self.where}.path", revision=self.config.revision,
            empty=self.empty_components if empty else (), **dtype_kwarg(self.dtype),
            **{**self._load_kwargs(), **self._without_text_encoders()},
        )

    def _without_text_encoders(self) -> dict:
        """``{component: None}`` for the pipeline's text encoders and tokenizers when the run reads
        its prompt embeddings from a store (:func:`flowrl.embeddings.without_text_encoders`): none
        of them is loaded, and ``encode_prompts`` is never called."""
        if self.text_encoders_loaded:
            return {}
        names = inspect.signature(self.pipeline_class.__init__).parameters
        return {n: None for n in names if n.startswith(("text_encoder", "tokenizer"))}

    def _denoiser_of(self, pipe) -> torch.nn.Module:
        """The module that is trained: the pipeline's transformer (a two-expert pipeline wraps both)."""
        return pipe.transformer

    def _frozen_modules(self) -> list[torch.nn.Module]:
        """Text encoders and the VAE (everything but the denoiser): the pipeline's components named in
        ``frozen_names`` that it has (a component left out at loading is None)."""
        return [m for m in (getattr(self.pipe, name) for name in self.frozen_names) if m is not None]

    def _lora_preset(self, preset: str) -> list[str]:
        return preset_targets(preset, ATTENTION, FEED_FORWARD)

    # ---- devices ------------------------------------------------------------------------------

    def to(self, device):
        self.device = torch.device(device)
        self._on_device = {}  # the constants made for the previous device
        self.denoiser.to(self.device)
        if isinstance(self._reference, torch.nn.Module):
            self._reference.to(self.device)
        # Offloaded encoders stay on the CPU and visit the device in _visiting().
        target = torch.device("cpu") if self._offloading else self.device
        for module in self._frozen_modules():
            module.to(target)
        return self

    def _device_constant(self, key: str, make) -> torch.Tensor:
        """``make()`` (a tensor on the device, the same for every call: ids, a guidance value), made
        once per device rather than on every forward; :meth:`to` forgets it."""
        if key not in self._on_device:
            self._on_device[key] = make()
        return self._on_device[key]

    def _token_timesteps(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, seq]``: each sample's timestep ``t [B]`` on every token, 0 on the tokens a video
        adapter's ``_token_mask`` marks clean (an image-to-video condition frame's)."""
        return t[:, None] * self._device_constant("token_mask", lambda: self._token_mask.to(self.device))[None]

    @property
    def _offloading(self) -> bool:
        return self.config.offload_encoders and self.device.type != "cpu"

    @contextlib.contextmanager
    def _visiting(self, *modules: torch.nn.Module):
        """Bring offloaded modules to the device for a block, then back to the CPU."""
        if not self._offloading:
            yield
            return
        for m in modules:
            m.to(self.device)
        try:
            yield
        finally:
            for m in modules:
                m.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _autocast(self):
        """bf16/fp16 compute over fp32-stored weights (full fine-tuning with fp32 master weights)."""
        if self.denoiser_dtype == self.dtype or self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    # ---- the interface ----------------------------------------------------------------------

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, text) -> torch.Tensor:
        """Velocity ``[B, *L]`` (float32) of the trained denoiser, called as ``self.denoiser``."""
        return self._velocity(self.denoiser, latents, sigma, text)

    def _velocity(self, module, latents, sigma, text) -> torch.Tensor:
        raise NotImplementedError

    def _cfg_combined(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """True CFG over one batch ``[uncond; cond]`` of velocities: ``(v_u + w (v_c - v_u), v_c)``
        with ``w = cfg_scale`` (a pipeline that corrects the combination also needs ``v_c``)."""
        v_u, v_c = out.chunk(2)
        return v_u + self.config.cfg_scale * (v_c - v_u), v_c

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in ``[0, 1]``: ``vae_batch_size`` latents at a time (bounds the
        decode memory), float32, through :meth:`_decoder`, with the VAE on the device meanwhile."""
        vae = self.pipe.vae
        out = []
        with self._visiting(vae):
            to_images = self._decoder(vae)
            for chunk in latents.split(self.config.vae_batch_size):
                img = to_images(chunk.to(self.device, torch.float32))
                out.append((img.float() / 2 + 0.5).clamp(0, 1))
        return torch.cat(out)

    def _decoder(self, vae):
        """``latents -> images in [-1, 1]`` for one chunk of float32 latents on the device, made while
        the VAE visits the device. Here the latents are the VAE's own (SD3, Z-Image), decoded at
        ``z / scaling_factor + shift_factor``; adapters that pack or normalise them otherwise
        override it."""
        cfg = vae.config
        return lambda z: vae.decode((z / cfg.scaling_factor + (cfg.shift_factor or 0.0)).to(vae.dtype),
                                    return_dict=False)[0]

    # ---- images back into latents (offline data) ----------------------------------------------

    @property
    def image_size(self) -> tuple[int, int]:
        """``(height, width)`` in pixels of the images the model generates (and encodes)."""
        return self.config.height, self.config.width

    @torch.no_grad()
    def _encode_with_vae(self, images: torch.Tensor) -> torch.Tensor:
        """Clean latents ``[B, *latent_shape]`` float32 of images ``[B, 3, H, W]`` in ``[0, 1]`` at
        :attr:`image_size`: the VAE's mode (deterministic, as the editing pipelines encode their
        condition images; a sample would make the latents depend on a generator), ``vae_batch_size``
        images at a time, then :meth:`_from_vae`, the inverse of the decoder's scaling and packing.
        An image adapter's ``encode_images`` (:class:`flowrl.interfaces.EncodesImages`) is this."""
        if tuple(images.shape[-2:]) != self.image_size:
            raise FlowrlError(f"images of {tuple(images.shape[-2:])} pixels, the model encodes {self.image_size}",
                              where=self.where, hint="resize them to the model's height and width first")
        vae = self.pipe.vae
        out = []
        with self._visiting(vae):
            for chunk in images.split(self.config.vae_batch_size):
                pixels = (chunk.to(self.device, torch.float32) * 2 - 1).to(vae.dtype)
                out.append(self._from_vae(vae, self._vae_mode(vae, pixels).float()))
        return torch.cat(out)

    def _vae_mode(self, vae, pixels: torch.Tensor) -> torch.Tensor:
        """The mode of the VAE's latent distribution for pixels in ``[-1, 1]``."""
        return vae.encode(pixels, return_dict=False)[0].mode()

    def _from_vae(self, vae, z: torch.Tensor) -> torch.Tensor:
        """The VAE's own latents -> the model's: ``(z - shift_factor) * scaling_factor`` (the inverse
        of :meth:`_decoder`'s scaling); adapters that pack or normalise otherwise override it."""
        cfg = vae.config
        return (z - (cfg.shift_factor or 0.0)) * cfg.scaling_factor

    def trainable_parameters(self) -> Iterable[torch.nn.Parameter]:
        return [p for p in self.denoiser.parameters() if p.requires_grad]

    def prompt_source(self) -> Sequence[str] | None:
        return None

    def _scheduler_sigmas(self, num_steps: int, image_seq_len: int, flux_style: bool,
                          mu: float | None = None) -> torch.Tensor:
        """The pipeline scheduler's own sigmas ``[N + 1]`` (float32, ends at 0), as its pipeline
        would set them: FLUX passes ``linspace(1, 1/N, N)`` and a resolution-dependent ``mu``;
        SD3 asks for N steps (``mu`` only if its scheduler uses dynamic shifting). A pipeline
        with its own rule for ``mu`` (FLUX.2) passes it."""
        import numpy as np

        sched = copy.deepcopy(self.pipe.scheduler)
        cfg = sched.config
        kwargs = {}
        if mu is not None:
            kwargs["mu"] = mu
        elif cfg.get("use_dynamic_shifting", False):
            base_len, max_len = cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096)
            base, top = cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15)
            kwargs["mu"] = base + (top - base) / (max_len - base_len) * (image_seq_len - base_len)
        if flux_style and not cfg.get("use_flow_sigmas", False):
            sched.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps), **kwargs)
        else:
            sched.set_timesteps(num_inference_steps=num_steps, **kwargs)
        sigmas = sched.sigmas.detach().to(torch.float32).cpu()
        if sigmas.numel() != num_steps + 1 or float(sigmas[-1]) != 0.0:
            raise FlowrlError(
                f"the pipeline's scheduler ({type(sched).__name__}) did not give {num_steps + 1} sigmas ending at 0",
                where="[schedule].use",
                hint='use [schedule] use = "shift" or "flux_dynamic" instead of "model"',
            )
        return sigmas

    # ---- reference model (KL regularisation) ------------------------------------------------

    def snapshot_reference(self) -> str:
        """Fix the reference policy for KL terms; call once, after LoRA is attached, before training.

        With LoRA the reference is the same denoiser with the adapter disabled (no copy). For full
        fine-tuning it is a frozen copy of the denoiser as it is now (costs one more set of
        weights, stored in ``dtype``). Returns ``"lora_disabled"`` or ``"frozen_copy"``.
        """
        if has_lora(self.denoiser):
            self._reference, self._reference_mode = None, "lora_disabled"
        else:
            # the reference never trains: the compute dtype suffices, made tensor by tensor (no
            # whole float32 copy first); memory.py's specs declare it (ModelMemory.reference_bytes)
            ref = frozen_copy(self.denoiser, self.dtype if self.denoiser_dtype != self.dtype else None)
            self._reference, self._reference_mode = ref, "frozen_copy"
        return self._reference_mode

    @property
    def reference_module(self) -> torch.nn.Module | None:
        """The frozen copy behind :meth:`reference_velocity` (None with LoRA: no copy). The engine
        lays it out like the denoiser (sharded under FSDP2, in CPU memory with
        ``[train].reference_on_cpu``) and sets the placed module back here."""
        return self._reference

    @reference_module.setter
    def reference_module(self, module: torch.nn.Module) -> None:
        self._reference = module

    @torch.no_grad()
    def reference_velocity(self, latents: torch.Tensor, sigma: torch.Tensor, text) -> torch.Tensor:
        """Velocity of the reference (base) model at the same inputs, without gradient."""
        if self._reference_mode is None:
            if has_lora(self.denoiser):
                self._reference_mode = "lora_disabled"
            else:
                raise FlowrlError(
                    "reference_velocity() needs a reference model: call snapshot_reference() once before "
                    "training (full fine-tuning keeps a frozen copy of the starting weights)",
                )
        if self._reference_mode == "lora_disabled":
            with lora_disabled(self.denoiser):
                return self._velocity(self.denoiser, latents, sigma, text)
        return self._velocity(self._reference, latents, sigma, text)

    # ---- export -------------------------------------------------------------------------------

    def save_lora(self, out_dir, *, weight_name: str = "pytorch_lora_weights.safetensors") -> None:
        """Write the LoRA in diffusers' format (``pipe.load_lora_weights(out_dir)`` reads it)."""
        from peft import get_peft_model_state_dict

        config = self.denoiser.peft_config["default"]
        layers = {k: v.detach().to(torch.float32).cpu().contiguous()
                  for k, v in get_peft_model_state_dict(self.denoiser).items()}
        metadata = config.to_dict()
        self.pipeline_class.save_lora_weights(
            str(out_dir), transformer_lora_layers=layers, transformer_lora_adapter_metadata=metadata,
            weight_name=weight_name,
        )

    def save_pretrained(self, out_dir) -> None:
        """Write the whole pipeline with the current denoiser (merged LoRA, if any, must be fused first)."""
        if is_quantized(self.denoiser):
            raise FlowrlError(
                f"the base is quantised ({self.quantize}): a merged pipeline would bake the quantisation in",
                where=f"{self.where}.quantize",
                hint="export the LoRA (flowrl export without --merge) and load it onto the full-precision base",
            )
        if not self.text_encoders_loaded:
            raise FlowrlError("the pipeline was loaded without its text encoders (prompt embeddings from a store): "
                              "it cannot be saved whole", where=f"{self.where}",
                              hint="load it with its encoders (no [prompts] embeddings), as `flowrl export` does")
        self._denoiser_into_pipeline()
        self.pipe.save_pretrained(str(out_dir))

    def _denoiser_into_pipeline(self) -> None:
        """Put the trained denoiser back where the pipeline keeps it, for ``save_pretrained``."""
        self.pipe.transformer = self.denoiser
