"""Make a torchvision whose compiled ops cannot load importable anyway (for open_clip); and keep
diffusers' and transformers' messages that ask nothing of a flowrl user off the screen.

Why: the registry's torchvision wheels are CUDA builds. Installed beside CPU torch, torchvision's
compiled library ``_C`` fails to load; torchvision swallows that, but then registers fake
(meta) kernels for ``torchvision::nms`` and ``torchvision::qnms`` at import, and because those
operators were never defined the import dies with ``RuntimeError: operator torchvision::nms
does not exist``. That breaks ``import open_clip`` (and, in the same environment, transformers'
fast image processors and diffusers pipelines).

The fix: before torchvision is imported, check whether its compiled library loads. If it does,
do nothing more (loading it is the first thing torchvision's import would do anyway). If it
does not, define just the two operator *schemas* torchvision's import needs, in a
``torch.library.Library("torchvision", "DEF")`` kept alive in this module. Transforms,
open_clip, the image processors and diffusers then work; only the compiled ops themselves
(nms, roi_align, video decoding) stay unavailable, and flowrl uses none of them.

:func:`ensure_torchvision_importable` is idempotent and cheap after the first call.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import re
import sys

import torch

# bitsandbytes (flowrl-diffusion[quant]) warns at import, on CPUs with AVX512-bf16, that the optional package
# of faster CPU kernels ("kernels") is missing; flowrl's quantised path runs without it.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

#: The schemas torchvision registers fake kernels for at import (torchvision/_meta_registrations.py).
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)

_library: torch.library.Library | None = None  # the definitions live as long as this reference
_status: str | None = None


def _compiled_library_path() -> str | None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = list(spec.submodule_search_locations)[0]
    finder = importlib.machinery.FileFinder(
        directory, (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES)
    )
    found = finder.find_spec("_C")
    return found.origin if found is not None else None


def _op_defined(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
        return True
    except RuntimeError:
        return False


class NotActionable(logging.Filter):
    """Drops exactly these library log messages, which fire on every run and ask nothing of a
    flowrl user (every other message, including near variants that do, passes):

    - transformers, without torchvision: "`CLIPImageProcessor` requires torchvision (not
      installed); falling back to `CLIPImageProcessorPil`": the pipelines' image processors,
      which flowrl never calls, work with the PIL fallback;
    - diffusers, on ``model.to(dtype)`` (flowrl stores a denoiser in one dtype and computes in
      another by design): "There are modules in X that should be kept in float32: []": with an
      empty list there is nothing to keep;
    - diffusers' prompt encoders: "The following part of your input was truncated ...: ['']":
      when every removed part is empty, nothing of the prompt was lost;
    - diffusers, when importing, where torchao (the ``fp8`` extra) cannot load its compiled
      kernels (a CPU machine): "Unable to import `torchao` Tensor objects. This may affect
      loading checkpoints serialized with `torchao`": flowrl loads no torchao-serialized
      checkpoint (its FP8 rollouts quantise at run time);
    - torch (2.13 on), when torchao is imported (with diffusers, wherever the ``fp8`` extra is
      installed): "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by
      torch.compile as an opaque value type. Calling register_constant() on Enum subclasses is
      deprecated ...": torchao's registration of its own enums, nothing a user calls or can change;
    - torchao, when imported, for each of its compiled extensions that cannot load here (built for
      another Python, or for CUDA kernels this machine lacks): "Failed to load .../torchao/_C_mxfp8...so:
      Could not load this library: ...": flowrl's FP8 rollouts run on torch's own scaled matmul
      (per-row float8 through ``quantize_``), none of torchao's extensions, and a machine that cannot
      run them is refused by ``[sampler].rollout_precision``'s own check with one message.
    """

    PATTERNS = (
        re.compile(r"^`\w+` requires torchvision \(not installed\); falling back to `\w+Pil`"),
        re.compile(r"^There are modules in \w+ that should be kept in float32: \[\]\."),
        re.compile(r"^The following part of your input was truncated because .*: \[(?:'', )*''\]$", re.S),
        re.compile(r"^Unable to import `torchao` Tensor objects\. This may affect loading checkpoints serialized "
                   r"with `torchao`$"),
        re.compile(r"^<enum '\w+'> is an Enum subclass and is now natively supported by torch\.compile as an opaque "
                   r"value type\. Calling register_constant\(\) on Enum subclasses is deprecated"),
        re.compile(r"^Failed to load \S*[/\\]torchao[/\\]_C\w*(?:\.[\w-]+)*\.so: Could not load this library"),
    )

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in self.PATTERNS)


_quiet = NotActionable()
#: the loggers that emit the messages above (diffusers' pipelines log through their own loggers,
#: so the library's handlers are filtered too, once diffusers has created them)
#: these log while diffusers (and so torchao) is being imported, before diffusers' handlers exist:
#: filtered on the loggers themselves, from the import of this module on
_LOGGING_AT_IMPORT = ("diffusers.quantizers.torchao.torchao_quantizer", "torch.utils._pytree", "torchao")
_LOGGERS = ("transformers.utils.import_utils", "diffusers.models.modeling_utils", *_LOGGING_AT_IMPORT)
for _name in _LOGGING_AT_IMPORT:
    logging.getLogger(_name).addFilter(_quiet)


def quiet_library_messages() -> None:
    """Install :class:`NotActionable` on the loggers and library handlers that need it.
    Idempotent; call it before importing transformers and after importing diffusers."""
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if _quiet not in logger.filters:
            logger.addFilter(_quiet)
    for name in ("diffusers", "transformers"):
        for handler in logging.getLogger(name).handlers:
            if _quiet not in handler.filters:
                handler.addFilter(_quiet)


def _no_loading_bar(factory, args, kwargs):
    """transformers' tqdm hook: no bar for "Loading weights" (a tensor count that a shipped or local
    model's load prints in every command, in 0.0 s), every other bar as transformers makes it."""
    if kwargs.get("desc") == "Loading weights":
        return _empty_tqdm(*args, **kwargs)
    return factory(*args, **kwargs) if _previous_tqdm_hook is None else _previous_tqdm_hook(factory, args, kwargs)


_previous_tqdm_hook = None
_empty_tqdm = None
_TRANSFORMERS_LOGGING = "transformers.utils.logging"


def _hook_tqdm(module) -> None:
    """Install :func:`_no_loading_bar` in transformers' logging module (once)."""
    global _previous_tqdm_hook, _empty_tqdm
    if _empty_tqdm is not None or not hasattr(module, "set_tqdm_hook") or not hasattr(module, "EmptyTqdm"):
        return  # done already, or a transformers (4.x) without the hook, which draws no such bar
    _empty_tqdm = module.EmptyTqdm
    _previous_tqdm_hook = module.set_tqdm_hook(_no_loading_bar)


class _HookWhenImported(importlib.abc.MetaPathFinder):
    """Runs :func:`_hook_tqdm` right after transformers' logging module is imported, so that
    making the hook costs no import of transformers here (1.3 s); then leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TRANSFORMERS_LOGGING:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                _hook_tqdm(module)

            spec.loader.exec_module = exec_module
        return spec


_hook_finder = _HookWhenImported()


def quiet_loading_bars() -> None:
    """Hide transformers' "Loading weights" progress bar (transformers 5 draws it for every
    ``from_pretrained``, the embedded CLIP judge's included); its other bars, the hub's download
    bars and flowrl's own progress bar stay. Idempotent; imports nothing: where transformers is
    not imported yet, the hook is made when it is."""
    if _empty_tqdm is not None:
        return
    if _TRANSFORMERS_LOGGING in sys.modules:
        _hook_tqdm(sys.modules[_TRANSFORMERS_LOGGING])
    elif _hook_finder not in sys.meta_path:
        sys.meta_path.insert(0, _hook_finder)


def ensure_torchvision_importable() -> str:
    """Apply the shim if (and only if) torchvision is installed and its compiled ops cannot load;
    then hide transformers' weight-loading bar (:func:`quiet_loading_bars`).

    Returns what it found: ``"absent"`` (no torchvision), ``"imported"`` (already imported:
    too late to help, nothing to do), ``"healthy"`` (the compiled library loads), or ``"shimmed"``
    (the schemas were defined here).
    """
    status = _ensure_torchvision_importable()
    quiet_loading_bars()
    return status


def _ensure_torchvision_importable() -> str:
    global _library, _status
    quiet_library_messages()  # every caller is about to import transformers or diffusers
    if _status is not None:
        return _status
    if "torchvision" in sys.modules:
        _status = "imported"
        return _status
    if importlib.util.find_spec("torchvision") is None:
        _status = "absent"
        return _status
    path = _compiled_library_path()
    if path is not None:
        try:
            torch.ops.load_library(path)
            _status = "healthy"
            return _status
        except (OSError, RuntimeError, ImportError):
            pass  # a CUDA build beside CPU torch: undefined symbols
    missing = [s for s in SCHEMAS if not _op_defined(s.split("(", 1)[0])]
    if missing:
        _library = torch.library.Library("torchvision", "DEF")
        for schema in missing:
            _library.define(schema)
    _status = "shimmed"
    if os.environ.get("FLOWRL_DEBUG_TORCHVISION"):
        print(f"flowrl: torchvision's compiled ops cannot load here; defined {len(missing)} op schemas", file=sys.stderr)
    return _status
