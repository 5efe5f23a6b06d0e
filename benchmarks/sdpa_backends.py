"""Which scaled-dot-product attention backends run FLUX.1's attention, forward and backward, on
this GPU: each backend in its own process (a kernel that faults poisons its CUDA context).

Per backend: ``torch.nn.functional.scaled_dot_product_attention`` at FLUX.1-dev's head shape
(24 heads of 128, bf16) for 32 tokens and for 1536 (512 x 512: 1024 image tokens and 512 text
tokens), batch 1 and 4, forward and backward, synchronised; then one double and one single block
of FLUX.1-dev's width (random weights, gradient checkpointing) forward and backward at batch 4,
1536 tokens, also under ``FlopCounterMode`` (as flowrl's throughput count runs it). Prints one
JSON line per backend: ``ok`` or the error. ``[train].attention_backend`` picks one for a run.

    python benchmarks/sdpa_backends.py
"""

from __future__ import annotations

import json
import subprocess
import sys

BACKENDS = ["auto", "flash", "efficient", "cudnn", "math"]


def check(name: str) -> dict:
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    context = contextlib.nullcontext() if name == "auto" else sdpa_kernel(
        [{"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
          "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]])
    done = []
    with context:
        for batch in (1, 4):
            for seq in (32, 1536):
                q, k, v = (torch.randn(batch, 24, seq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                torch.nn.functional.scaled_dot_product_attention(q, k, v).float().square().mean().backward()
                torch.cuda.synchronize()
                done.append(f"sdpa b{batch} s{seq}")
        from diffusers import FluxTransformer2DModel
        from memory_plan import FLUX1_DEV  # FLUX.1-dev's transformer/config.json

        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = FluxTransformer2DModel(**{**FLUX1_DEV, "num_layers": 1, "num_single_layers": 1})
        torch.set_default_dtype(previous)
        model.enable_gradient_checkpointing()
        model.train()
        b = 4
        inputs = dict(
            hidden_states=torch.randn(b, 1024, 64, device="cuda", dtype=torch.bfloat16),
            encoder_hidden_states=torch.randn(b, 512, 4096, device="cuda", dtype=torch.bfloat16),
            pooled_projections=torch.randn(b, 768, device="cuda", dtype=torch.bfloat16),
            timestep=torch.full((b,), 0.5, device="cuda"), guidance=torch.full((b,), 3.5, device="cuda"),
            img_ids=torch.zeros(1024, 3, device="cuda"), txt_ids=torch.zeros(512, 3, device="cuda"),
        )
        for counted in (False, True):
            with FlopCounterMode(display=False) if counted else contextlib.nullcontext():
                model(**inputs).sample.float().square().mean().backward()
            torch.cuda.synchronize()
            done.append("flux blocks" + (" counted" if counted else ""))
    return {"backend": name, "ok": True, "done": done, "torch": torch.__version__}


def main() -> int:
    if len(sys.argv) > 1:
        try:
            print(json.dumps(check(sys.argv[1])), flush=True)
        except Exception as exc:  # the backend's failure is the result
            print(json.dumps({"backend": sys.argv[1], "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}),
                  flush=True)
        return 0
    for name in BACKENDS:
        out = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, timeout=300)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        print(lines[-1] if lines else json.dumps({"backend": name, "ok": False, "exit": out.returncode,
                                                  "stderr": out.stderr[-300:]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
