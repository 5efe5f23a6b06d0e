"""Which scaled-dot-product attention backends run FLUX.1's attention, forward and backward, on
this GPU: each backend in its own process (a kernel that faults poisons its CUDA context), all
started at once and each stopped at its own time limit, so that a backend that hangs or faults
slowly costs its own line, not the others'.

Per backend: ``torch.nn.functional.scaled_dot_product_attention`` at FLUX.1-dev's head shape
(24 heads of 128, bf16) for 32 tokens and for 1536 (512 x 512: 1024 image tokens and 512 text
tokens), batch 1 and 4, forward and backward, synchronised; then one double and one single block
of FLUX.1-dev's width (random weights, gradient checkpointing) forward and backward at batch 4,
1536 tokens, also under ``FlopCounterMode`` (as flowrl's throughput count runs it). Prints one
JSON line per backend as soon as it ends: ``ok`` or the error, so a caller that stops the script
early keeps the lines of the backends that had ended. ``[train].attention_backend`` picks one for
a run.

    python benchmarks/sdpa_backends.py
    python benchmarks/sdpa_backends.py --tiny --device cpu   # a rehearsal of the script: tiny shapes

``--tiny`` shrinks every shape (2 heads of 16, 16 image and 8 text tokens, a FLUX block of that
width) so that the script itself runs anywhere; its lines say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BACKENDS = ["auto", "flash", "efficient", "cudnn", "math"]
#: Seconds one backend's process may take (start-up, imports and every shape).
PER_BACKEND_S = 60

#: --tiny: FluxTransformer2DModel's arguments and token counts for a rehearsal of the script.
TINY_FLUX = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
                 axes_dims_rope=(4, 6, 6))


def check(name: str, device: str, tiny: bool) -> dict:
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    def synchronize() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    heads, head_dim, image_tokens, text_tokens = (2, 16, 16, 8) if tiny else (24, 128, 1024, 512)
    context = contextlib.nullcontext() if name == "auto" else sdpa_kernel(
        [{"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
          "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]])
    done = []
    with context:
        for batch in (1, 4):
            for seq in (32, image_tokens + text_tokens):
                q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))
                torch.nn.functional.scaled_dot_product_attention(q, k, v).float().square().mean().backward()
                synchronize()
                done.append(f"sdpa b{batch} s{seq}")
        from flowrl.compat import ensure_torchvision_importable

        ensure_torchvision_importable()  # a torchvision whose compiled ops do not load breaks diffusers' import
        from diffusers import FluxTransformer2DModel

        if tiny:
            config = TINY_FLUX
        else:
            from memory_plan import FLUX1_DEV  # FLUX.1-dev's transformer/config.json

            config = {**FLUX1_DEV, "num_layers": 1, "num_single_layers": 1}
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        with torch.device(device):
            model = FluxTransformer2DModel(**config)
        torch.set_default_dtype(previous)
        model.enable_gradient_checkpointing()
        model.train()
        b = 4
        inputs = dict(
            hidden_states=torch.randn(b, image_tokens, config["in_channels"], device=device, dtype=torch.bfloat16),
            encoder_hidden_states=torch.randn(b, text_tokens, config["joint_attention_dim"], device=device,
                                              dtype=torch.bfloat16),
            pooled_projections=torch.randn(b, config["pooled_projection_dim"], device=device, dtype=torch.bfloat16),
            timestep=torch.full((b,), 0.5, device=device), guidance=torch.full((b,), 3.5, device=device),
            img_ids=torch.zeros(image_tokens, 3, device=device), txt_ids=torch.zeros(text_tokens, 3, device=device),
        )
        for counted in (False, True):
            with FlopCounterMode(display=False) if counted else contextlib.nullcontext():
                model(**inputs).sample.float().square().mean().backward()
            synchronize()
            done.append("flux blocks" + (" counted" if counted else ""))
    return {"backend": name, "ok": True, "done": done, "torch": torch.__version__}


def run_backends(backends: list[str], extra: list[str], per_backend_s: float) -> list[dict]:
    """Every backend's process started at once; one JSON line printed per backend as it ends, a
    backend past ``per_backend_s`` killed and reported as timed out."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sdpa-backends-") as folder:
        # files, not pipes: a backend that writes much (warnings, a fault's dump) must not block on
        # a full pipe nobody reads until it ends
        outputs = {name: (Path(folder) / f"{name}.out", Path(folder) / f"{name}.err") for name in backends}
        running = {}
        for name in backends:
            with outputs[name][0].open("w") as out, outputs[name][1].open("w") as err:
                running[name] = subprocess.Popen([sys.executable, __file__, "--backend", name, *extra], stdout=out,
                                                 stderr=err)
        results = []
        while running:
            for name, process in list(running.items()):
                if process.poll() is None and time.monotonic() - started < per_backend_s:
                    continue
                if process.poll() is None:
                    process.kill()
                    process.wait()
                    row = {"backend": name, "ok": False, "error": f"timed out after {per_backend_s:.0f} s"}
                else:
                    lines = [ln for ln in outputs[name][0].read_text().splitlines() if ln.startswith("{")]
                    row = json.loads(lines[-1]) if lines else {"backend": name, "ok": False, "exit": process.returncode,
                                                              "stderr": outputs[name][1].read_text()[-300:]}
                print(json.dumps(row), flush=True)
                results.append(row)
                del running[name]
            time.sleep(0.2)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a rehearsal of the script, anywhere")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated, of " + ", ".join(BACKENDS))
    parser.add_argument("--per-backend-s", type=float, default=PER_BACKEND_S)
    parser.add_argument("--backend", help=argparse.SUPPRESS)  # one backend's own process
    args = parser.parse_args()
    if args.backend:
        try:
            print(json.dumps(check(args.backend, args.device, args.tiny)), flush=True)
        except Exception as exc:  # the backend's failure is the result
            print(json.dumps({"backend": args.backend, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}),
                  flush=True)
        return 0
    chosen = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in chosen if b not in BACKENDS]
    if unknown:
        parser.error(f"unknown backend(s) {', '.join(unknown)}: choose from {', '.join(BACKENDS)}")
    extra = ["--device", args.device] + (["--tiny"] if args.tiny else [])
    run_backends(chosen, extra, args.per_backend_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
