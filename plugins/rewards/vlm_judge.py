"""``vlm_judge``: a vision-language model asked about each image, UnifiedReward-style.

Each image is shown to a VLM judge with a question built from its prompt (``question``, a template
holding ``{prompt}``; the mode's default when empty), and the judge's answer becomes the score:

- ``mode = "yes_prob"``: the probability that the judge's first answer token is "Yes" rather than
  "No", ``P(yes) / (P(yes) + P(no))``, each side summed over the usual case and space variants of
  the word (``Yes``, ``yes``, ``YES``, with or without a leading space). In [0, 1].
- ``mode = "score"``: the judge writes an answer (greedy, at most ``max_tokens`` tokens); the last
  match of ``score_pattern`` in it (``Score: 7/10``, ``Final score: 4``, or an answer that is a
  bare number) divided by ``max_score``. In [0, 1].

Two backends:

- ``backend = "transformers"``: a local checkpoint (``model``, a directory) loaded with
  ``AutoModelForImageTextToText`` and ``AutoProcessor`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and other
  chat VLMs whose processor takes ``{"type": "image"}`` content), scored in batches of
  ``batch_size``, left-padded, on ``device`` in ``dtype`` (extra ``rewards``).
- ``backend = "openai"``: an OpenAI-compatible chat-completions server (vLLM and SGLang serve
  UnifiedReward this way): one request per image, at most ``concurrency`` at a time, the image as
  a base64 PNG data URL in an ``image_url`` content part. ``yes_prob`` asks for one token with
  ``logprobs`` and ``top_logprobs`` and reads the first token's top log-probabilities; ``score``
  parses the answer's text. ``base_url`` may list several servers: requests go to them in turn,
  and a retry goes to the next one. Connection failures, timeouts and HTTP 429/502/503/504 are
  retried ``retries`` times (``retry_wait`` seconds, doubling), then the run stops with one error
  naming the URL and the cause, as the ``http`` reward does. Standard library only.

Both backends see the same 8-bit image (quantised with ``round(255 x)``; shrunk first to at most
``max_pixels`` pixels when that is set), so a checkpoint scores the same through either.

A malformed answer (``score``: no number, or one outside ``[0, max_score]``; ``yes_prob``: neither
word among the first token's top log-probabilities) is never a silent number: by default it scores
0, is counted in the extra ``malformed`` (1 for that image, logged as ``reward/<label>/malformed/mean``,
the fraction of malformed answers) and logged as a warning with an example; ``on_malformed =
"error"`` stops the call with a :class:`FlowrlError` instead. In ``yes_prob`` mode the extra
``yes_no_mass`` is ``P(yes) + P(no)``: a judge whose answers rarely start with either word has a
small mass, and its scores mean little. Docs: docs/rewards.md, "vlm_judge".
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import functools
import http.client
import io
import json
import logging
import math
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Literal

import torch

from flowrl.compat import ensure_torchvision_importable
from flowrl.config import param
from flowrl.errors import FlowrlError, require
from flowrl.interfaces import RewardOutput

from .common import (ModelReward, PlacementConfig, check_images, checkpoint_parameters, resize_to, resolve_device,
                     resolve_dtype)

WHO = "vlm_judge"
log = logging.getLogger("flowrl.rewards.vlm_judge")

#: The question of each mode when ``question`` is empty.
QUESTIONS = {
    "yes_prob": "Does this image match the description: '{prompt}'? Answer Yes or No.",
    "score": "How well does this image match the description: '{prompt}'? Rate it from 0 to {max_score} and "
             "answer in the form 'Score: N'.",
}
#: ``Score: 7/10``, ``Final score (1-10): **8**``, ``the score is 7``, or an answer that is a bare number (``7``, ``7/10``).
SCORE_PATTERN = (r"(?i)\bscore\b[^:=\n]{0,20}[:=]\s*\**\s*(\d+(?:\.\d+)?)|\bscore\s+(?:is|of)\s+\**(\d+(?:\.\d+)?)"
                 r"|^[\s*]*(\d+(?:\.\d+)?)(?:\s*/\s*\d+(?:\.\d+)?)?[\s*.]*$")
YES, NO = "yes", "no"
#: HTTP statuses worth another attempt: rate limited, or a proxy / server that is restarting.
RETRY_STATUSES = {429, 502, 503, 504}
MODEL_HINT = ("download a judge yourself, e.g. `hf download CodeGoat24/UnifiedReward-qwen-7b --local-dir models/judge`, "
              "and set model = \"models/judge\"; or serve it and use backend = \"openai\"")
SERVER_HINT = ("is the judge server (vllm serve / sglang) running at that address? raise 'timeout' for slow judges, "
               "'retries' for flaky networks")


@dataclasses.dataclass(frozen=True)
class VlmJudgeConfig(PlacementConfig):
    backend: Literal["transformers", "openai"] = param(
        "transformers", "'transformers': a local checkpoint in this process (model); 'openai': an OpenAI-compatible "
                        "chat-completions server (base_url), e.g. vLLM or SGLang.")
    mode: Literal["yes_prob", "score"] = param(
        "yes_prob", "'yes_prob': P(Yes) / (P(Yes) + P(No)) of the answer's first token; 'score': the number the "
                    "answer gives (score_pattern) / max_score.")
    question: str = param("", "The question asked per image; '{prompt}' is replaced by the image's prompt and "
                              "'{max_score}' by max_score. Empty: the mode's default (docs/rewards.md).")
    max_score: float = param(10.0, "mode 'score': the largest score the judge gives; the reward is the number / this.",
                             min=0, exclusive_min=True)
    score_pattern: str = param("", "mode 'score': a regular expression; its last match's first non-empty group is the "
                                   "number. Empty: 'Score: N', 'score is N' or an answer that is a bare number "
                                   "(flowrl_plugins.rewards.vlm_judge.SCORE_PATTERN).")
    max_tokens: int = param(64, "mode 'score': the most tokens the judge writes (greedy); yes_prob reads one token.",
                            min=1, max=4096)
    on_malformed: Literal["zero", "error"] = param(
        "zero", "An answer with no number (score) or neither Yes nor No among the top tokens (yes_prob): 'zero' "
                "scores it 0, counts it in the extra 'malformed' and logs a warning; 'error' stops with an error.")
    max_pixels: int = param(0, "Shrink an image larger than this many pixels (aspect kept) before the judge sees it; "
                               "0: as generated (the judge's processor applies its own limits).", min=0)
    model: str = param("", "backend 'transformers': local directory of the judge (AutoModelForImageTextToText + "
                           "AutoProcessor: Qwen2.5-VL, Qwen3-VL, e.g. UnifiedReward-qwen-7b).", path=True)
    batch_size: int = param(8, "backend 'transformers': images per forward pass (scores do not depend on it).", min=1)
    base_url: str | list[str] = param("", "backend 'openai': the server's OpenAI base URL, e.g. "
                                          "'http://127.0.0.1:8000/v1' ('/v1' is added to a URL without a path), "
                                          "or a list of such servers, used in turn.")
    served_model: str = param("", "backend 'openai': the model name the server serves; empty: the one model its "
                                  "/v1/models lists (needs check_on_start).")
    api_key_env: str = param("", "backend 'openai': the environment variable holding the API key (sent as a Bearer "
                                 "token); empty: no key.")
    top_logprobs: int = param(20, "backend 'openai', mode 'yes_prob': the first token's top log-probabilities asked "
                                  "for (OpenAI allows 20; vLLM up to its --max-logprobs, 20 by default).", min=1, max=1000)
    concurrency: int = param(8, "backend 'openai': requests in flight at once (one image each).", min=1, max=256)
    timeout: float = param(120.0, "backend 'openai': seconds to wait for one request before it counts as failed.",
                           min=0, exclusive_min=True)
    retries: int = param(2, "backend 'openai': extra attempts after a connection failure, timeout or HTTP "
                            "429/502/503/504; then the run stops with an error.", min=0, max=100)
    retry_wait: float = param(1.0, "backend 'openai': seconds before the first retry; doubles each retry.", min=0)
    check_on_start: bool = param(True, "backend 'openai': ask the servers' /v1/models when the reward is built, so a "
                                       "wrong URL or model name fails before training.")

    @functools.cached_property
    def parameters(self) -> int | None:
        """The local checkpoint's parameters, read once from its safetensors headers (None: none to read)."""
        return checkpoint_parameters(self.model) if self.backend == "transformers" else None

    @property
    def memory_note(self) -> str:
        if self.backend == "openai":
            return "served by another process (base_url): nothing on this device"
        return f"{self.parameters / 1e9:.2f}e9 params in its safetensors" if self.parameters else "no safetensors to count"

    def memory_bytes(self) -> int | None:
        """``flowrl plan``'s bytes: the local checkpoint's parameters in this dtype; 0 for a judge
        served elsewhere."""
        if self.backend == "openai":
            return 0
        return None if self.parameters is None else self.weight_bytes(self.parameters)


@dataclasses.dataclass(frozen=True)
class Answer:
    """What the judge said about one image: ``p_yes`` and ``mass`` (yes_prob; ``p_yes`` None when
    neither word is among the top tokens), or ``text`` (score); ``detail`` describes it for messages."""

    text: str | None = None
    p_yes: float | None = None
    mass: float = 0.0
    detail: str = ""


# ----------------------------------------------------------------------------- the rules (pure)


def parse_score(text: str, pattern: re.Pattern, max_score: float) -> float | None:
    """``number / max_score`` for the last match of ``pattern`` in ``text`` (its first non-empty
    group), or None when nothing matches or the number lies outside ``[0, max_score]``."""
    last = None
    for last in pattern.finditer(text or ""):
        pass
    if last is None:
        return None
    group = next((g for g in last.groups() if g), None)
    try:
        number = float(group)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(number) or not 0 <= number <= max_score:
        return None
    return number / max_score


def answer_word(token: str) -> str | None:
    """``"yes"`` or ``"no"`` for a token that is the word (any case, surrounding whitespace), else None."""
    word = token.strip().casefold()
    return word if word in (YES, NO) else None


def yes_probability(top: list[tuple[str, float]]) -> tuple[float | None, float]:
    """``(P(yes) / (P(yes) + P(no)), P(yes) + P(no))`` from a first token's ``(token, logprob)``
    alternatives (each distinct token counted once); ``(None, 0)`` when neither word is there."""
    mass = {YES: 0.0, NO: 0.0}
    seen = set()
    for token, logprob in top:
        word = answer_word(token)
        if word is None or token in seen:
            continue
        seen.add(token)
        mass[word] += math.exp(logprob) if logprob is not None and math.isfinite(logprob) else 0.0
    total = mass[YES] + mass[NO]
    if total <= 0:
        return None, 0.0
    return mass[YES] / total, total


def to_uint8(images: torch.Tensor, max_pixels: int) -> torch.Tensor:
    """Images ``[B, 3, H, W]`` in [0, 1] as 8-bit on the CPU, shrunk to at most ``max_pixels`` pixels."""
    images = images.detach().float().clamp(0, 1)
    h, w = images.shape[-2:]
    if max_pixels and h * w > max_pixels:
        shrink = math.sqrt(max_pixels / (h * w))
        images = resize_to(images, max(1, math.floor(h * shrink)), max(1, math.floor(w * shrink)))
    return images.mul(255).round().to(torch.uint8).cpu()


def to_pil(image: torch.Tensor):
    from PIL import Image

    return Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())


def png_data_url(image: torch.Tensor) -> str:
    """An 8-bit image ``[3, H, W]`` as a ``data:image/png;base64,...`` URL (lossless)."""
    buffer = io.BytesIO()
    to_pil(image).save(buffer, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


# ----------------------------------------------------------------------------- the reward


class VlmJudge:
    """A VLM judge's answer about each image: P(Yes) or a parsed score, in [0, 1]."""

    Config = VlmJudgeConfig

    def __init__(self, config: VlmJudgeConfig):
        self.name = WHO
        self.config = config
        self.question = check_config(config)
        self.pattern = re.compile(config.score_pattern or SCORE_PATTERN)
        self.backend = TransformersJudge(config) if config.backend == "transformers" else OpenAIJudge(config)

    def questions(self, prompts: list[str]) -> list[str]:
        max_score = f"{self.config.max_score:g}"
        return [self.question.replace("{max_score}", max_score).replace("{prompt}", str(p)) for p in prompts]

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        prompts = list(prompts)
        check_images(images, prompts, WHO)
        answers = self.backend.judge(to_uint8(images, self.config.max_pixels), self.questions(prompts))
        if self.config.mode == "yes_prob":
            values = [a.p_yes for a in answers]
        else:
            values = [parse_score(a.text or "", self.pattern, self.config.max_score) for a in answers]
        self.report_malformed(values, answers, prompts)
        extras = {"malformed": torch.tensor([float(v is None) for v in values])}
        if self.config.mode == "yes_prob":
            extras["yes_no_mass"] = torch.tensor([a.mass for a in answers], dtype=torch.float32)
        scores = torch.tensor([0.0 if v is None else v for v in values], dtype=torch.float32)
        return RewardOutput(scores=scores, extras=extras)

    def report_malformed(self, values: list[float | None], answers: list[Answer], prompts: list[str]) -> None:
        bad = [i for i, v in enumerate(values) if v is None]
        if not bad:
            return
        what = ("neither Yes nor No among the first token's top tokens" if self.config.mode == "yes_prob"
                else f"no number in [0, {self.config.max_score:g}] matched score_pattern")
        example = f"prompt {prompts[bad[0]]!r}: {answers[bad[0]].detail}"
        message = f"{len(bad)} of {len(values)} judge answer(s) malformed ({what}); e.g. {example}"
        if self.config.on_malformed == "error":
            raise FlowrlError(message, where=f"reward '{WHO}'",
                              hint="check the question and the judge's answers; a judge that reasons first needs "
                                   "mode 'score' with a larger max_tokens; on_malformed = 'zero' scores them 0")
        log.warning("reward '%s': %s; scored 0 (extra 'malformed'; on_malformed = 'error' stops instead)", WHO, message)


def check_config(config: VlmJudgeConfig) -> str:
    """The question template; a FlowrlError for settings no backend can run with."""
    where = f"reward '{WHO}'"
    if config.backend not in ("transformers", "openai"):
        raise FlowrlError(f"unknown backend {config.backend!r}", where=f"{where}: backend",
                          hint="use backend = 'transformers' (a local checkpoint) or 'openai' (a server)")
    if config.mode not in QUESTIONS:
        raise FlowrlError(f"unknown mode {config.mode!r}", where=f"{where}: mode",
                          hint="use mode = 'yes_prob' (P(Yes) of the first token) or 'score' (a number in the answer)")
    if config.on_malformed not in ("zero", "error"):
        raise FlowrlError(f"unknown on_malformed {config.on_malformed!r}", where=f"{where}: on_malformed",
                          hint="use 'zero' (score 0, counted and logged) or 'error'")
    question = config.question or QUESTIONS[config.mode]
    if "{prompt}" not in question:
        raise FlowrlError(f"the question {question!r} does not hold '{{prompt}}'", where=f"{where}: question",
                          hint="write where the image's prompt goes, e.g. \"Does this image show '{prompt}'? "
                               "Answer Yes or No.\"")
    try:
        pattern = re.compile(config.score_pattern or SCORE_PATTERN)
    except re.error as exc:
        raise FlowrlError(f"score_pattern is not a regular expression: {exc}", where=f"{where}: score_pattern",
                          hint="e.g. r'Final Score:\\s*(\\d+)', or leave it empty for the default "
                               "('Score: N' or a bare number)") from exc
    if config.mode == "score" and not pattern.groups:
        raise FlowrlError(f"score_pattern {config.score_pattern!r} has no group to read the number from",
                          where=f"{where}: score_pattern", hint="put the number in parentheses, e.g. r'Final Score:\\s*(\\d+)'")
    return question


# ----------------------------------------------------------------------------- backend: transformers


def answer_token_ids(tokenizer) -> dict[str, list[int]]:
    """The single-token ids of the case and space variants of "Yes" and "No"; a FlowrlError when a
    word has none (the judge's tokenizer cannot answer with it in one token)."""
    ids: dict[str, list[int]] = {}
    for word in (YES, NO):
        found = []
        for variant in (word.capitalize(), word, word.upper()):
            for text in (variant, " " + variant):
                encoded = tokenizer.encode(text, add_special_tokens=False)
                if len(encoded) == 1 and encoded[0] not in found:
                    found.append(encoded[0])
        if not found:
            raise FlowrlError(f"the judge's tokenizer has no single token for {word.capitalize()!r}",
                              where=f"reward '{WHO}': model", hint="use mode = 'score', or a judge whose vocabulary "
                                                                    "holds the answer words (Qwen's does)")
        ids[word] = found
    return ids


class TransformersJudge(ModelReward):
    """The judge as a transformers model in this process."""

    name = WHO

    def __init__(self, config: VlmJudgeConfig):
        self.config = config
        directory = local_model_dir(config.model)
        ensure_torchvision_importable()  # a broken CUDA torchvision breaks transformers' imports
        transformers = require("transformers", extra="rewards", purpose=f"the '{WHO}' reward (backend 'transformers')")
        if not hasattr(transformers, "AutoModelForImageTextToText"):
            raise FlowrlError(f"the '{WHO}' reward needs transformers' AutoModelForImageTextToText (found "
                              f"{transformers.__version__})", where=f"reward '{WHO}'",
                              hint='pip install -U "flowrl-diffusion[rewards]" (Qwen3-VL needs transformers >= 4.57)')
        dtype = resolve_dtype(config.dtype, resolve_device(config.device))
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        dtype_key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
        try:
            model = transformers.AutoModelForImageTextToText.from_pretrained(
                str(directory), local_files_only=True, **{dtype_key: dtype})
            processor = transformers.AutoProcessor.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
            raise FlowrlError(f"cannot load a vision-language judge from {directory}: {exc}",
                              where=f"reward '{WHO}': model", hint=MODEL_HINT) from exc
        tokenizer = getattr(processor, "tokenizer", None)
        if tokenizer is None or not hasattr(processor, "apply_chat_template") or getattr(processor, "image_processor",
                                                                                          None) is None:
            raise FlowrlError(f"{directory} holds no processor with a tokenizer, an image processor and a chat template",
                              where=f"reward '{WHO}': model", hint=MODEL_HINT)
        tokenizer.padding_side = "left"  # the answer's first token follows the last position of every row
        self.processor, self.tokenizer = processor, tokenizer
        self.answer_ids = answer_token_ids(tokenizer) if config.mode == "yes_prob" else {}
        self.module = model
        self._keep_last = "logits_to_keep" in _forward_parameters(model)
        self._setup_placement(config)

    def chat(self, question: str) -> str:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text[0] if isinstance(text, list) else text

    def inputs(self, pixels: torch.Tensor, questions: list[str]) -> dict:
        batch = self.processor(text=[self.chat(q) for q in questions], images=[to_pil(p) for p in pixels],
                               padding=True, return_tensors="pt")
        out = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                value = value.to(self.device, dtype=self.dtype) if value.is_floating_point() else value.to(self.device)
            out[key] = value
        return out

    def judge(self, pixels: torch.Tensor, questions: list[str]) -> list[Answer]:
        answers: list[Answer] = []
        with torch.no_grad(), self._placed():
            for start in range(0, len(questions), self.batch_size):
                batch = self.inputs(pixels[start : start + self.batch_size], questions[start : start + self.batch_size])
                answers += self.yes_prob(batch) if self.config.mode == "yes_prob" else self.generate(batch)
        return answers

    def yes_prob(self, batch: dict) -> list[Answer]:
        kwargs = {"logits_to_keep": 1} if self._keep_last else {}
        logits = self.module(**batch, **kwargs).logits[:, -1].float()  # left padding: every row's last token
        logp = torch.log_softmax(logits, dim=-1)
        yes = torch.logsumexp(logp[:, self.answer_ids[YES]], dim=-1)
        no = torch.logsumexp(logp[:, self.answer_ids[NO]], dim=-1)
        p_yes, mass = torch.sigmoid(yes - no), yes.exp() + no.exp()
        return [Answer(p_yes=float(p), mass=float(m), detail=f"P(yes) + P(no) = {float(m):.3g}")
                for p, m in zip(p_yes, mass)]

    def generate(self, batch: dict) -> list[Answer]:
        out = self.module.generate(**batch, max_new_tokens=self.config.max_tokens, do_sample=False,
                                   pad_token_id=self.tokenizer.pad_token_id)
        texts = self.tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        return [Answer(text=t, detail=f"answer {t[:200]!r}") for t in texts]


def local_model_dir(path: str) -> Path:
    where = f"reward '{WHO}': model"
    if not path:
        raise FlowrlError("backend 'transformers' needs model, the judge's local directory", where=where, hint=MODEL_HINT)
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise FlowrlError(f"model directory not found: {path}", where=where, hint=MODEL_HINT)
    if not (directory / "config.json").is_file():
        raise FlowrlError(f"no config.json in {path}: not a transformers checkpoint", where=where, hint=MODEL_HINT)
    return directory


def _forward_parameters(model) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


# ----------------------------------------------------------------------------- backend: openai


def base_urls(value: str | list[str]) -> list[str]:
    """The servers' OpenAI base URLs (``/v1`` added to a URL without a path); a FlowrlError for none or a bad one."""
    where = f"reward '{WHO}': base_url"
    urls = [value] if isinstance(value, str) else list(value)
    if not urls or not all(urls):
        raise FlowrlError("backend 'openai' needs base_url, the judge server's OpenAI base URL", where=where,
                          hint="e.g. base_url = \"http://127.0.0.1:8000/v1\" for `vllm serve MODEL --port 8000`")
    out = []
    for url in urls:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise FlowrlError(f"base_url {url!r} is not an http(s) URL", where=where,
                              hint="e.g. base_url = \"http://127.0.0.1:8000/v1\"")
        url = url.rstrip("/")
        out.append(url if parsed.path.strip("/") else url + "/v1")
    return out


class OpenAIJudge:
    """The judge behind one or more OpenAI-compatible chat-completions servers."""

    def __init__(self, config: VlmJudgeConfig):
        self.config = config
        self.bases = base_urls(config.base_url)
        self.headers = {"Content-Type": "application/json"}
        if config.api_key_env:
            key = os.environ.get(config.api_key_env, "")
            if not key:
                raise FlowrlError(f"api_key_env = {config.api_key_env!r} names an environment variable that is not set",
                                  where=f"reward '{WHO}': api_key_env",
                                  hint=f"export {config.api_key_env}=..., or api_key_env = \"\" for a server without a key")
            self.headers["Authorization"] = f"Bearer {key}"
        # No proxies: an http_proxy set for downloads would otherwise capture requests to a judge
        # served on this machine or the cluster network (as the http reward).
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self.model = config.served_model
        if config.check_on_start:
            self.model = self.check_models()
        elif not self.model:
            raise FlowrlError("served_model is empty and check_on_start = false: the model name is unknown",
                              where=f"reward '{WHO}': served_model",
                              hint="set served_model to the name the server serves (vllm serve --served-model-name)")

    def check_models(self) -> str:
        """The model name to ask for: ``served_model``, checked against every server's /v1/models,
        or the one model they all serve."""
        where = f"reward '{WHO}': served_model"
        name = self.config.served_model
        for base in self.bases:
            url, reply = self.request(base, "/models", None)
            try:
                served = [str(m["id"]) for m in json.loads(reply)["data"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise FlowrlError(f"{url} did not list models as an OpenAI server does: {reply[:120]!r}",
                                  where=f"reward '{WHO}': base_url",
                                  hint="is base_url an OpenAI-compatible server's /v1 URL?") from exc
            if name and name not in served:
                raise FlowrlError(f"{url} does not serve {name!r}; it serves {served}", where=where,
                                  hint="set served_model to one of those names")
            if not name:
                if len(served) != 1:
                    raise FlowrlError(f"{url} serves {len(served)} models ({served}): which one judges is ambiguous",
                                      where=where, hint="set served_model to one of them")
                name = served[0]
        return name

    def body(self, pixels: torch.Tensor, question: str) -> bytes:
        content = [{"type": "image_url", "image_url": {"url": png_data_url(pixels)}}, {"type": "text", "text": question}]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "temperature": 0.0, "n": 1}
        if self.config.mode == "yes_prob":
            body.update(max_tokens=1, logprobs=True, top_logprobs=self.config.top_logprobs)
        else:
            body.update(max_tokens=self.config.max_tokens)
        return json.dumps(body).encode("utf-8")

    def judge(self, pixels: torch.Tensor, questions: list[str]) -> list[Answer]:
        workers = max(1, min(self.config.concurrency, len(questions)))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="vlm-judge") as pool:
            futures = [pool.submit(self.ask, i, pixels[i], q) for i, q in enumerate(questions)]
            try:
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise

    def ask(self, index: int, pixels: torch.Tensor, question: str) -> Answer:
        url, reply = self.request(self.bases[index % len(self.bases)], "/chat/completions", self.body(pixels, question))
        return self.read_answer(url, reply)

    def read_answer(self, url: str, reply: bytes) -> Answer:
        where = f"reward '{WHO}': {url}"
        try:
            choice = json.loads(reply)["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise FlowrlError(f"{url} answered without a chat completion: {reply[:200]!r}", where=where,
                              hint="is base_url an OpenAI-compatible server's /v1 URL?") from exc
        if self.config.mode == "score":
            text = (choice.get("message") or {}).get("content") if isinstance(choice, dict) else None
            return Answer(text=text or "", detail=f"answer {(text or '')[:200]!r}")
        logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
        if not isinstance(logprobs, dict) or not isinstance(logprobs.get("content"), list):
            raise FlowrlError(f"{url} returned no logprobs, which mode 'yes_prob' reads", where=where,
                              hint="use a server that returns logprobs for chat completions (vLLM, SGLang), or "
                                   "mode = 'score'")
        if not logprobs["content"]:
            return Answer(p_yes=None, detail="an empty answer")
        first = logprobs["content"][0]
        try:
            top = [(str(t["token"]), float(t["logprob"])) for t in [first, *(first.get("top_logprobs") or [])]]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FlowrlError(f"{url} returned malformed logprobs: {json.dumps(first)[:200]}", where=where) from exc
        p_yes, mass = yes_probability(top)
        shown = ", ".join(repr(t) for t, _ in top[:6])
        return Answer(p_yes=p_yes, mass=mass, detail=f"first token's top tokens {shown}")

    def request(self, base: str, path: str, body: bytes | None) -> tuple[str, bytes]:
        """``(url, reply body)`` of a GET (no body) or POST to ``base + path``; failures are retried on
        the next server, then raised as one FlowrlError naming the URL and the cause."""
        cfg = self.config
        start = self.bases.index(base)
        failures: list[str] = []
        for attempt in range(cfg.retries + 1):
            if attempt:
                time.sleep(cfg.retry_wait * 2 ** (attempt - 1))
            url = self.bases[(start + attempt) % len(self.bases)] + path
            request = urllib.request.Request(url, data=body, method="GET" if body is None else "POST",
                                             headers=self.headers)
            try:
                with self._opener.open(request, timeout=cfg.timeout) as response:
                    return url, response.read()
            except urllib.error.HTTPError as exc:
                detail = _error_detail(exc)
                if exc.code not in RETRY_STATUSES:
                    raise FlowrlError(f"judge server {url} failed with HTTP {exc.code}: {detail}",
                                      where=f"reward '{WHO}'",
                                      hint="the server rejected the request: check served_model, top_logprobs (the "
                                           "server's --max-logprobs) and the server's log") from None
                cause = f"HTTP {exc.code}: {detail}"
            except TimeoutError as exc:
                cause = f"no reply within timeout = {cfg.timeout:g} s ({exc})"
            except urllib.error.URLError as exc:
                reason = exc.reason
                cause = (f"no reply within timeout = {cfg.timeout:g} s" if isinstance(reason, TimeoutError)
                         else f"cannot connect ({_reason(reason)})")
            except (http.client.HTTPException, ConnectionError, OSError) as exc:
                cause = f"connection lost ({_reason(exc)})"  # the server died or closed the connection mid-reply
            failures.append(f"{url}: {cause}")
        tried = sorted({f.split(": ", 1)[0] for f in failures})
        raise FlowrlError(f"judge server {tried[0] if len(tried) == 1 else ', '.join(tried)} failed after "
                          f"{cfg.retries + 1} attempt(s): {failures[-1].split(': ', 1)[1]}",
                          where=f"reward '{WHO}'", hint=SERVER_HINT)


def _reason(exc) -> str:
    """An OS or connection error in words (``Connection refused``), without its Python type."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc)
    return text or {http.client.RemoteDisconnected: "the server closed the connection without a reply",
                    http.client.IncompleteRead: "the reply was cut off"}.get(type(exc), "the connection was closed")


def _error_detail(exc: urllib.error.HTTPError) -> str:
    """The message of an OpenAI-style error body (``{"error": {"message": ...}}``, or vLLM's ``{"message": ...}``)."""
    try:
        raw = exc.read()
    except Exception:  # the body itself may be cut off
        return str(exc.reason or "(no detail)")
    try:
        data = json.loads(raw)
        error = data.get("error", data)
        return str(error.get("message", error) if isinstance(error, dict) else error)[:300]
    except (ValueError, AttributeError):
        return raw[:200].decode("utf-8", "replace") or str(exc.reason)
