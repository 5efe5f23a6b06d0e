"""Full fine-tuning or LoRA (peft) on a model adapter's denoiser: one recipe field."""

from __future__ import annotations

import torch

from ..compat import ensure_torchvision_importable
from ..errors import FlowrlError
from ..interfaces import DiffusersLoraModule, HasLoraTargets
from ..seeding import derive_seed

# Cheap, and whatever imports transformers or peft after flowrl.train (a plugin, a worker) needs it
# first (flowrl.compat); peft itself is imported only where LoRA is attached.
ensure_torchvision_importable()


def prepare_trainable(model, train, seed: int = 0) -> list[torch.nn.Parameter]:
    """Set requires_grad for ``train.finetune`` and return the trainable parameters.

    LoRA: the base is frozen first (``add_adapter`` alone does not freeze it), then peft injects
    rank-``r`` adapters into ``train.lora_targets`` (or the adapter's ``lora_targets``). B starts
    at zero, so the LoRA model starts exactly equal to the base model. A is random: peft draws it
    from torch's global generator, which the engine otherwise never seeds, so it is drawn here
    from one derived from ``seed`` (the run's) and the global generator is left as it was: two
    runs of one recipe start from the same LoRA.
    """
    denoiser = model.denoiser
    if train.finetune == "full":
        quantised = sorted({str(p.dtype) for p in denoiser.parameters() if not p.is_floating_point()})
        if quantised:
            raise FlowrlError(f"full fine-tuning needs floating-point weights; the denoiser holds {', '.join(quantised)} "
                              "(a quantised base)", where="[train].finetune",
                              hint='train a LoRA over the quantised base (finetune = "lora")')
        denoiser.requires_grad_(True)
    else:
        targets = list(train.lora_targets) or (list(model.lora_targets) if isinstance(model, HasLoraTargets) else [])
        if not targets:
            raise FlowrlError(
                "finetune = 'lora' needs target modules",
                where="[train].lora_targets",
                hint='list module names, e.g. ["to_q", "to_k", "to_v", "to_out.0"]',
            )
        denoiser.requires_grad_(False)
        # peft (and the transformers it imports) costs seconds at start-up: only LoRA pays for it
        from peft import LoraConfig, inject_adapter_in_model

        config = LoraConfig(
            r=train.lora_rank,
            lora_alpha=train.lora_alpha,
            target_modules=targets,
            init_lora_weights=True if train.lora_init == "default" else "gaussian",
        )
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(seed, "lora"))
                if isinstance(denoiser, DiffusersLoraModule):  # keeps diffusers' save_lora_weights working
                    denoiser.add_adapter(config)
                else:
                    inject_adapter_in_model(config, denoiser)
        except ValueError as exc:
            raise FlowrlError(f"LoRA could not be attached: {exc}", where="[train].lora_targets") from exc
        # peft gives new LoRA matrices the base layer's dtype; AdamW on bf16/fp16 weights drops
        # updates below their resolution, so the LoRA trains in float32 (the base keeps its dtype).
        for p in denoiser.parameters():
            if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16):
                p.data = p.data.float()
    params = [p for p in denoiser.parameters() if p.requires_grad]
    if not params:
        raise FlowrlError("the model has no trainable parameters", where="[train].finetune")
    low = sorted({str(p.dtype) for p in params if p.dtype in (torch.float16, torch.bfloat16)})
    if low:
        # AdamW steps of ~lr * 1 on weights of magnitude ~1 round away in 16-bit: training
        # would silently do almost nothing.
        raise FlowrlError(
            f"full fine-tuning of {', '.join(low)} weights would lose most updates to rounding",
            where="[train].finetune",
            hint='keep trainable weights in float32 (e.g. model.denoiser_dtype = "fp32", compute can stay bf16) '
            'or use finetune = "lora"',
        )
    return params


def trainable_state_dict(denoiser: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable weights by name (all weights, or only the LoRA matrices)."""
    return {n: p.detach() for n, p in denoiser.named_parameters() if p.requires_grad}


def load_trainable_state_dict(denoiser: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(denoiser.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in state]
    unknown = [n for n in state if n not in params]
    if missing or unknown:
        raise FlowrlError(
            f"checkpoint does not match the model: {len(missing)} missing and {len(unknown)} unknown tensors "
            f"(e.g. {(missing or unknown)[0]})",
            hint="resume with the same recipe (model and finetune settings) that wrote the checkpoint",
        )
    reshaped = [(n, tuple(t.shape), tuple(params[n].shape)) for n, t in state.items() if t.shape != params[n].shape]
    if reshaped:  # e.g. another LoRA rank: copy_ would fail, or broadcast a smaller tensor silently
        name, saved, wanted = reshaped[0]
        raise FlowrlError(
            f"checkpoint does not match the model: {len(reshaped)} tensors of another shape (e.g. {name}: "
            f"{list(saved)} in the checkpoint, {list(wanted)} in the model)",
            hint="use the recipe (model and finetune settings, e.g. train.lora_rank) that wrote the checkpoint",
        )
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t)
