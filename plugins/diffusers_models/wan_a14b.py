"""Wan 2.2 A14B text-to-video (model ``wan22_a14b``) and image-to-video (``wan22_a14b_i2v``): two
WanTransformer3DModel experts in one pipeline, ``transformer`` for the high-noise steps and
``transformer_2`` for the low-noise ones, switched at ``boundary_ratio`` (the pipeline's
``model_index.json``: 0.875 for T2V, 0.9 for I2V).

Routing, as ``WanPipeline.__call__`` does it: a step at timestep ``t = 1000 sigma`` runs
``transformer`` when ``t >= 1000 * boundary_ratio`` and ``transformer_2`` otherwise, with the
guidance weight of that expert (``cfg_scale`` for the high-noise expert, ``cfg_scale_2`` for the
low-noise one: the pipeline's ``guidance_scale`` and ``guidance_scale_2``). flowrl's denoiser is
:class:`TwoExperts`, one module holding both, so LoRA, FSDP2, checkpoints, EMA and the rollout
process see one set of named parameters (``transformer.*`` and ``transformer_2.*``); it routes
each row of a batch by its own timestep, so an update that trains transitions on both sides of
the boundary in one forward (a grouped update, random timesteps per sample) is still exact.

``train_experts`` chooses what trains: ``both``, ``high`` or ``low``; the other expert keeps its
weights (no LoRA is attached to it, and full fine-tuning leaves it frozen). The rest (latents,
text, schedule, decode) is the ``wan`` adapter's (plugins/diffusers_models/wan.py): the A14B
models use Wan 2.1's VAE and one timestep per sample.

Image-to-video follows ``WanImageToVideoPipeline`` without ``expand_timesteps``: the clip
``[image, black frames]`` is encoded by the VAE (its mode) and normalised, a mask marks the first
latent frame (4 channels, one per frame the VAE folds into it), and every transformer call reads
``[latents, mask, image latents]`` along the channels (16 + 4 + 16 = 36). Every frame is
generated, the first included (the model draws it towards the image); nothing is overwritten.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from torch import nn

from flowrl.config import param
from flowrl.errors import FlowrlError

from .editing import condition_pictures
from .memory.wan import wan_a14b_memory_spec
from .wan import WanConfig, WanModel, latent_statistics, wan_lora_targets

#: the experts' attribute names, high-noise first (WanPipeline's components)
EXPERTS = ("transformer", "transformer_2")
#: ``train_experts`` -> the experts it trains
TRAINED = {"both": EXPERTS, "high": ("transformer",), "low": ("transformer_2",)}
#: the exported LoRA of each expert: the high-noise one under diffusers' default name (so that
#: ``pipe.load_lora_weights(out)`` loads it into ``transformer``), the low-noise one beside it
#: (``pipe.load_lora_weights(out, weight_name=..., load_into_transformer_2=True)``)
LORA_FILES = {"transformer": "pytorch_lora_weights.safetensors",
              "transformer_2": "pytorch_lora_weights_transformer_2.safetensors"}


def _in_lockstep(module: nn.Module) -> bool:
    """Whether every forward of ``module`` is a collective over all processes: it is sharded with
    FSDP2 (``fully_shard`` turns its class into an ``FSDPModule``) and more than one process runs."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule) and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class TwoExperts(nn.Module):
    """Two Wan transformers behind one forward: each row of the batch goes to the expert of its
    timestep (``>= boundary_timestep``: ``transformer``, the high-noise expert).

    Under FSDP2 every process must run the same blocks in the same order, or a weight gather
    waits forever. The processes agree first (one all-reduce of two flags) on which experts any
    of them needs; a process with no row for such an expert runs it on one of its rows and adds
    the result times zero, so that its forward and backward gather and reduce like the others'
    and its output is unchanged."""

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary_timestep: float,
                 trained: tuple[str, ...] = EXPERTS):
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.boundary_timestep = float(boundary_timestep)
        self.trained = tuple(trained)

    # ---- what the adapter and the engine read off a denoiser --------------------------------

    @property
    def config(self):
        """The high-noise expert's configuration (both experts share the architecture)."""
        return self.transformer.config

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def experts(self) -> list[nn.Module]:
        return [getattr(self, name) for name in EXPERTS]

    def requires_grad_(self, requires_grad: bool = True) -> TwoExperts:
        """``requires_grad_(True)`` (full fine-tuning) reaches only the trained experts; the other
        stays frozen. ``requires_grad_(False)`` freezes both."""
        for name in EXPERTS:
            getattr(self, name).requires_grad_(requires_grad and name in self.trained)
        return self

    def enable_gradient_checkpointing(self) -> None:
        for expert in self.experts():
            expert.enable_gradient_checkpointing()

    # ---- LoRA (flowrl.interfaces.DiffusersLoraModule), on the trained experts only ----------

    def add_adapter(self, adapter_config) -> None:
        for name in self.trained:
            getattr(self, name).add_adapter(adapter_config)

    def _with_lora(self) -> list[tuple[str, nn.Module]]:
        return [(name, getattr(self, name)) for name in EXPERTS if getattr(getattr(self, name), "peft_config", None)]

    def save_lora_adapter(self, save_directory: str) -> None:
        """Each expert's LoRA in diffusers' model format, in ``save_directory/<expert>``."""
        for name, expert in self._with_lora():
            expert.save_lora_adapter(f"{save_directory}/{name}")

    def fuse_lora(self) -> None:
        for _, expert in self._with_lora():
            expert.fuse_lora()

    def unload_lora(self) -> None:
        for _, expert in self._with_lora():
            expert.unload_lora()

    # ---- the forward ------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                return_dict: bool = False, **kwargs):
        rows = timestep.reshape(timestep.shape[0], -1).amax(dim=1)  # [B] (a per-token timestep: its largest)
        high = rows >= self.boundary_timestep
        picks = (high.nonzero().flatten(), (~high).nonzero().flatten())
        needed = torch.tensor([int(p.numel() > 0) for p in picks], dtype=torch.int32)
        if _in_lockstep(self):
            import torch.distributed as dist

            needed = needed.to(hidden_states.device)
            dist.all_reduce(needed, op=dist.ReduceOp.MAX)
        outputs, order, zero = [], [], None
        for name, idx, wanted in zip(EXPERTS, picks, needed.tolist()):
            if not wanted:
                continue
            expert = getattr(self, name)
            own = idx.numel() > 0
            take = idx if own else torch.zeros(1, dtype=torch.long, device=idx.device)
            out = expert(hidden_states=hidden_states[take], timestep=timestep[take],
                         encoder_hidden_states=encoder_hidden_states[take], return_dict=False, **kwargs)[0]
            if own:
                outputs.append(out)
                order.append(idx)
            else:  # this process's share of a collective forward: no effect on its output
                term = out.sum() * 0.0
                zero = term if zero is None else zero + term
        out = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        if len(order) > 1:
            out = out[torch.argsort(torch.cat(order))]
        if zero is not None:
            out = out + zero.to(out.dtype)
        return (out,) if not return_dict else {"sample": out}


@dataclasses.dataclass(frozen=True)
class Wan22A14BConfig(WanConfig):
    """Wan 2.2 T2V A14B: the ``wan`` adapter's keys with that model's defaults, plus the second
    expert's guidance and the choice of experts to train."""

    path: str = param(
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        "Hub id or local pipeline directory (model_index.json) of a two-expert Wan 2.2 pipeline "
        "(transformer, transformer_2 and boundary_ratio): Wan-AI/Wan2.2-T2V-A14B-Diffusers. Apache-2.0, not gated.",
        path="hub",
    )
    cfg_scale: float = param(
        4.0, "True CFG weight of the high-noise expert (the pipeline's guidance_scale; Wan 2.2 T2V A14B: 4.0). "
        "1 with cfg_scale_2 = 1: no CFG, one forward per step.", min=0.0,
    )
    cfg_scale_2: float = param(
        3.0, "True CFG weight of the low-noise expert (the pipeline's guidance_scale_2; Wan 2.2 T2V A14B: 3.0).",
        min=0.0,
    )
    flow_shift: float = param(
        12.0, "Time shift s of the sigma schedule, sigma = s u / (1 + (s - 1) u) (Wan 2.2 T2V A14B samples with 12.0).",
        min=0.01,
    )
    train_experts: Literal["both", "high", "low"] = param(
        "both", "Which experts train: 'both', 'high' (transformer, the steps with 1000 sigma >= 1000 x "
        "boundary_ratio) or 'low' (transformer_2); the other keeps its weights and gets no LoRA.",
    )

    def memory_spec(self):
        """What ``flowrl plan`` needs: both experts held, the trained ones' LoRA or weights."""
        return wan_a14b_memory_spec(self, wan_lora_targets(self.lora_preset), TRAINED[self.train_experts])


@dataclasses.dataclass(frozen=True)
class Wan22A14BI2VConfig(Wan22A14BConfig):
    """Wan 2.2 I2V A14B: the ``wan22_a14b`` keys with that model's defaults (the Wan 2.2 repository's
    i2v_A14B config: shift 5.0, CFG 3.5 on both experts; boundary 0.9 from the pipeline)."""

    path: str = param(
        "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
        "Hub id or local pipeline directory (model_index.json) of a two-expert Wan 2.2 image-to-video pipeline "
        "(WanImageToVideoPipeline with transformer_2 and boundary_ratio): Wan-AI/Wan2.2-I2V-A14B-Diffusers. "
        "Apache-2.0, not gated.", path="hub",
    )
    cfg_scale: float = param(
        3.5, "True CFG weight of the high-noise expert (the pipeline's guidance_scale; Wan 2.2 I2V A14B: 3.5).", min=0.0,
    )
    cfg_scale_2: float = param(
        3.5, "True CFG weight of the low-noise expert (the pipeline's guidance_scale_2; Wan 2.2 I2V A14B: 3.5).",
        min=0.0,
    )
    flow_shift: float = param(
        5.0, "Time shift s of the sigma schedule, sigma = s u / (1 + (s - 1) u) (Wan 2.2 I2V A14B samples with 5.0).",
        min=0.01,
    )


class Wan22A14BModel(WanModel):
    """Wan 2.2 T2V A14B: the Wan adapter over :class:`TwoExperts`, with each expert's CFG weight."""

    Config = Wan22A14BConfig
    empty_components = EXPERTS

    def __init__(self, config: Wan22A14BConfig, where: str = "[model] (model 'wan22_a14b')"):
        super().__init__(config, where)
        self.uses_cfg = config.cfg_scale != 1.0 or config.cfg_scale_2 != 1.0

    def _denoiser_of(self, pipe) -> nn.Module:
        ratio = pipe.config.get("boundary_ratio")
        if pipe.transformer_2 is None or ratio is None or pipe.transformer is None:
            raise FlowrlError(
                "the pipeline is not a two-expert Wan 2.2 pipeline (it needs transformer, transformer_2 and "
                "boundary_ratio in model_index.json)", where=f"{self.where}.path",
                hint="use model 'wan' (Wan 2.1) or 'wan22' (TI2V-5B) for a one-transformer pipeline",
            )
        def architecture(module):  # the config's keys without bookkeeping (_name_or_path, _diffusers_version)
            return {k: v for k, v in module.config.items() if not k.startswith("_")}

        if architecture(pipe.transformer) != architecture(pipe.transformer_2):
            raise FlowrlError("transformer and transformer_2 have different configurations", where=f"{self.where}.path",
                              hint="the two experts of a Wan 2.2 A14B pipeline share one architecture")
        boundary = float(ratio) * pipe.scheduler.config.num_train_timesteps  # as WanPipeline computes it
        return TwoExperts(pipe.transformer, pipe.transformer_2, boundary, TRAINED[self.config.train_experts])

    def _cfg_weight(self, sigma: torch.Tensor):
        """Each row's guidance weight: ``cfg_scale`` on the high-noise expert's steps, ``cfg_scale_2``
        on the low-noise expert's (``[B, 1, 1, 1, 1]``)."""
        t = sigma.to(self.device, torch.float32) * 1000.0
        high = t >= self.denoiser_module().boundary_timestep
        return torch.where(high, self.config.cfg_scale, self.config.cfg_scale_2).view(-1, 1, 1, 1, 1)

    def denoiser_module(self) -> TwoExperts:
        """The :class:`TwoExperts` under whatever wraps the denoiser (torch.compile keeps it as ``_orig_mod``)."""
        module = self.denoiser
        return getattr(module, "_orig_mod", module)

    def save_lora(self, out_dir, *, weight_name: str | None = None) -> None:
        """Each trained expert's LoRA in diffusers' pipeline format (:data:`LORA_FILES`)."""
        from peft import get_peft_model_state_dict

        for name, expert in self.denoiser_module()._with_lora():
            layers = {k: v.detach().to(torch.float32).cpu().contiguous()
                      for k, v in get_peft_model_state_dict(expert).items()}
            self.pipeline_class.save_lora_weights(
                str(out_dir), transformer_lora_layers=layers,
                transformer_lora_adapter_metadata=expert.peft_config["default"].to_dict(), weight_name=LORA_FILES[name],
            )

    def _denoiser_into_pipeline(self) -> None:
        module = self.denoiser_module()
        self.pipe.transformer, self.pipe.transformer_2 = module.transformer, module.transformer_2


class Wan22A14BI2VModel(Wan22A14BModel):
    """Wan 2.2 I2V A14B: the two-expert adapter with each prompt's condition image read as extra
    input channels (module docstring); prompts carry images ([prompts].condition_column)."""

    task = "image-to-video"  # the model card's pipeline tag (flowrl.hub)

    Config = Wan22A14BI2VConfig
    pipeline_class_name = "WanImageToVideoPipeline"
    _in_channels_rule = "the latents, the VAE's temporal factor of mask channels and the image latents"

    def __init__(self, config: Wan22A14BI2VConfig, where: str = "[model] (model 'wan22_a14b_i2v')"):
        super().__init__(config, where)
        if self.expand_timesteps:
            raise FlowrlError("the pipeline sets expand_timesteps (Wan 2.2 TI2V-5B): it is not a two-expert A14B",
                              where=f"{where}.path", hint="use model 'wan22' with image_to_video = true")
        self.condition_size = (config.height, config.width)  # flowrl.interfaces.TakesConditionImage

    def _transformer_in_channels(self, z_dim: int) -> int:
        return z_dim + self.vae_scale_temporal + z_dim

    @torch.no_grad()
    def encode_prompts(self, prompts):
        prompts = list(prompts)
        out = super().encode_prompts(prompts)
        out["condition_latents"] = self.encode_conditions(prompts).to(self.device)
        return out

    @torch.no_grad()
    def encode_conditions(self, prompts) -> torch.Tensor:
        """``[B, 4 + C, F_lat, H/8, W/8]`` float32: the first-frame mask and each prompt's image as
        the first frame of an otherwise black clip, encoded and normalised as WanImageToVideoPipeline
        does (``(z - mean) * (1 / std)``)."""
        vae, (h, w), frames = self.pipe.vae, self.condition_size, self.config.num_frames
        processor = self.pipe.video_processor
        image = processor.preprocess(condition_pictures(self, prompts, processor), height=h, width=w)
        clip = torch.cat([image.unsqueeze(2), image.new_zeros(image.shape[0], 3, frames - 1, h, w)], dim=2)
        with self._visiting(vae):
            z = vae.encode(clip.to(self.device, vae.dtype), return_dict=False)[0].mode().float()
        mean, std = latent_statistics(vae, z.device)
        z = (z - mean) * (1.0 / std)
        mask = torch.zeros(z.shape[0], self.vae_scale_temporal, *z.shape[2:], device=z.device)
        mask[:, :, 0] = 1.0  # the first latent frame holds the image (all the frames the VAE folds into it)
        return torch.cat([mask, z], dim=1)

    def _inputs(self, latents, t, text):
        cond = text["condition_latents"].to(self.device, torch.float32)
        return torch.cat([latents, cond], dim=1), t
