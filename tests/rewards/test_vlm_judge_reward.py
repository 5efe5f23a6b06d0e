"""The `vlm_judge` reward: a tiny Qwen2.5-VL judge built offline (transformers backend), the same
judge behind a local OpenAI-compatible server (openai backend), scripted servers for the score
mode, malformed answers and dying servers, and the configuration's errors.

Servers bind to 127.0.0.1 on a free port; every wait is bounded (timeouts of a few seconds,
retries without waiting).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from reward_helpers import fixed_images

from flowrl.compat import ensure_torchvision_importable
from flowrl.config import from_dict
from flowrl.errors import FlowrlError
from flowrl.plugins import get_registry
from flowrl.testing.tiny_models import QWEN_CHAT_TEMPLATE, QWEN_SPECIAL, _qwen_image_processor, byte_unicode
from flowrl_plugins.rewards.vlm_judge import (
    SCORE_PATTERN,
    VlmJudge,
    VlmJudgeConfig,
    parse_score,
    yes_probability,
)

PROMPTS = ["a red circle", "a blue square on a wide white background, seen from above", "two cats"]
#: The tokens of the answer words' variants in the tiny judge's vocabulary (byte-level: "Ġ" is a space).
YES_TOKENS = ["Yes", "ĠYes", "yes", "Ġyes", "YES", "ĠYES"]
NO_TOKENS = ["No", "ĠNo", "no", "Ġno", "NO", "ĠNO"]


# ----------------------------------------------------------------------------- the tiny judge


def build_tiny_judge(directory: Path) -> Path:
    """A random Qwen2.5-VL (text width 32, 2 layers; vision width 16, 1 block) with a byte-level BPE
    tokenizer whose merges make each answer word, with and without a leading space, one token;
    saved as a checkpoint directory (model, tokenizer with chat template, image processor)."""
    ensure_torchvision_importable()  # as the reward does: a broken CUDA torchvision breaks transformers' imports
    import transformers

    vocab = {s: i for i, s in enumerate(byte_unicode().values())}
    merges: list[tuple[str, str]] = []
    for word in ("Yes", "yes", "YES", "No", "no", "NO"):
        for a, b in [(word[:i], word[i]) for i in range(1, len(word))] + [("Ġ", word)]:
            merges.append((a, b))
            vocab.setdefault(a + b, len(vocab))
    specials = dict(unk_token=None, bos_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer = transformers.Qwen2Tokenizer(vocab=dict(vocab), merges=merges, **specials)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL[1:]})
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, rms_norm_eps=1e-6, tie_word_embeddings=False,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                initializer_range=0.5)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=56, fullatt_block_indexes=[0],
                  initializer_range=0.5)
    special = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                   vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special)
    torch.manual_seed(0)
    transformers.Qwen2_5_VLForConditionalGeneration(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    _qwen_image_processor(min_pixels=28 * 28, max_pixels=56 * 56).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return build_tiny_judge(tmp_path_factory.mktemp("tiny_judge"))


def build(**params) -> VlmJudge:
    """The reward as a recipe builds it: through the registry, its params validated like a recipe's."""
    comp = get_registry().get("reward", "vlm_judge")
    return comp.build(from_dict(comp.params, params, where="test: [[rewards]]"))


@pytest.fixture(scope="module")
def judge(judge_dir):
    return build(model=str(judge_dir), device="cpu")


@pytest.fixture(scope="module")
def reference(judge_dir):
    """The judge's model and processor, loaded by hand: what the scores are checked against."""
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(judge_dir, local_files_only=True).eval()
    return model, transformers.AutoProcessor.from_pretrained(judge_dir, local_files_only=True)


def next_token_logprobs(reference, image, question: str) -> torch.Tensor:
    """log P(next token) after the chat turn asking ``question`` about the PIL ``image``, one at a time."""
    model, processor = reference
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    with torch.no_grad():
        return torch.log_softmax(model(**inputs).logits[0, -1].float(), dim=-1)


def hand_yes_prob(reference, image, question: str) -> tuple[float, float]:
    logp = next_token_logprobs(reference, image, question)
    tokenizer = reference[1].tokenizer
    yes = logp[tokenizer.convert_tokens_to_ids(YES_TOKENS)].exp().sum().item()
    no = logp[tokenizer.convert_tokens_to_ids(NO_TOKENS)].exp().sum().item()
    return yes / (yes + no), yes + no


def pil(image: torch.Tensor):
    from PIL import Image

    return Image.fromarray((image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())


def question(prompt: str) -> str:
    return f"Does this image match the description: '{prompt}'? Answer Yes or No."


# ----------------------------------------------------------------------------- backend: transformers


def test_yes_prob_is_the_hand_computation_from_the_judges_logits_and_batch_invariant(judge, reference):
    images = fixed_images(3, (40, 56))
    out = judge(images, PROMPTS)
    assert out.scores.dtype == torch.float32 and out.scores.shape == (3,)
    assert bool(((out.scores >= 0) & (out.scores <= 1)).all())
    singles = torch.cat([judge(images[i : i + 1], PROMPTS[i : i + 1]).scores for i in range(3)])
    torch.testing.assert_close(singles, out.scores, atol=1e-5, rtol=1e-5)
    hand = [hand_yes_prob(reference, pil(image), question(p)) for image, p in zip(images, PROMPTS)]
    torch.testing.assert_close(out.scores, torch.tensor([p for p, _ in hand]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.extras["yes_no_mass"], torch.tensor([m for _, m in hand]), atol=1e-6, rtol=1e-4)
    assert out.extras["malformed"].tolist() == [0.0, 0.0, 0.0]
    same_prompt = judge(images, PROMPTS[:1] * 3).scores
    assert float(same_prompt.max() - same_prompt.min()) > 1e-3  # the image matters (one text layer would hide it)


def test_the_judge_conforms_to_the_reward_contract(judge):
    from flowrl.testing.components import check_component

    assert check_component("reward", judge, prompts=PROMPTS) == ["Reward"]


def test_score_mode_generates_greedily_and_counts_what_it_cannot_read(judge_dir, caplog):
    reward = build(model=str(judge_dir), device="cpu", mode="score", max_tokens=4, batch_size=2)
    images = fixed_images(3, (28, 28), seed=3)
    answers = reward.backend.judge(images.mul(255).round().to(torch.uint8), reward.questions(PROMPTS))
    singles = [reward.backend.judge(images[i : i + 1].mul(255).round().to(torch.uint8), reward.questions(PROMPTS[i : i + 1]))[0]
               for i in range(3)]
    assert [a.text for a in answers] == [a.text for a in singles]  # batches of 2 and 1 write the same answers
    with caplog.at_level(logging.WARNING, logger="flowrl.rewards.vlm_judge"):
        out = reward(images, PROMPTS)
    expected = [parse_score(a.text, re.compile(SCORE_PATTERN), 10.0) for a in answers]
    assert out.scores.tolist() == pytest.approx([0.0 if v is None else v for v in expected])
    assert out.extras["malformed"].tolist() == [float(v is None) for v in expected]
    assert set(out.extras) == {"malformed"}
    if any(v is None for v in expected):  # the random judge rarely writes a number
        assert "malformed" in caplog.text and "scored 0" in caplog.text


# ----------------------------------------------------------------------------- an OpenAI-compatible server


class JudgeServer:
    """A local OpenAI-compatible server: GET /v1/models and POST /v1/chat/completions, answered by
    ``respond(request) -> (status, reply dict)``, or with the connection closed unanswered when it
    returns None. Records every request."""

    def __init__(self, respond, models=("judge",)):
        self.respond, self.models, self.requests = respond, list(models), []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path != "/v1/models":
                    return self.reply(404, {"error": {"message": f"no route {self.path}"}})
                self.reply(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in server.models]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "body": body, "headers": dict(self.headers)})
                answer = server.respond(body)
                if answer is None:
                    self.close_connection = True  # closed without a reply: the server died mid-request
                    return
                self.reply(*answer)

            def reply(self, status, data):
                raw = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.fixture
def serve():
    servers = []

    def start(respond, **kwargs):
        servers.append(JudgeServer(respond, **kwargs))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def completion(content: str | None, logprobs: list[tuple[str, float]] | None = None) -> tuple[int, dict]:
    """An OpenAI chat completion answering ``content``; with ``logprobs``, its first token's top log-probabilities."""
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    if logprobs is not None:
        top = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in logprobs]
        choice["logprobs"] = {"content": [{**top[0], "top_logprobs": top}] if top else []}
    return 200, {"id": "cmpl-1", "object": "chat.completion", "model": "judge", "choices": [choice]}


def request_parts(body: dict) -> tuple:
    """(PIL image, question) of a chat request's one user message."""
    from PIL import Image

    content = body["messages"][0]["content"]
    url = next(c["image_url"]["url"] for c in content if c["type"] == "image_url")
    assert url.startswith("data:image/png;base64,")
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    image.load()
    return image.convert("RGB"), next(c["text"] for c in content if c["type"] == "text")


def openai(url, **params) -> VlmJudge:
    return build(backend="openai", base_url=url, timeout=5.0, retry_wait=0.0, **params)


def test_openai_yes_prob_through_a_server_running_the_judge_equals_the_transformers_backend(judge, reference, serve):
    tokenizer = reference[1].tokenizer

    def respond(body):
        image, text = request_parts(body)
        logp = next_token_logprobs(reference, image, text)
        top = logp.topk(body["top_logprobs"])
        return completion("", [(tokenizer.decode([int(i)]), float(v)) for v, i in zip(top.values, top.indices)])

    server = serve(respond)
    reward = openai(server.url, top_logprobs=len(tokenizer), concurrency=2)  # every token: yes and no are there
    assert reward.backend.model == "judge"  # the one model /v1/models lists
    images = fixed_images(3, (40, 56))
    out = reward(images, PROMPTS)
    torch.testing.assert_close(out.scores, judge(images, PROMPTS).scores, atol=1e-5, rtol=1e-5)
    assert out.extras["malformed"].tolist() == [0.0, 0.0, 0.0]
    body = server.requests[0]["body"]
    assert (body["model"], body["max_tokens"], body["logprobs"], body["temperature"]) == ("judge", 1, True, 0.0)
    assert sorted(request_parts(r["body"])[1] for r in server.requests) == sorted(question(p) for p in PROMPTS)


SCRIPT = {"a red circle": "Score: 7/10", "two cats": "8", "a blue square": "I cannot tell."}


def scripted(body):
    _, text = request_parts(body)
    return completion(next(answer for prompt, answer in SCRIPT.items() if prompt in text))


def test_openai_score_mode_parses_the_answers_and_counts_a_malformed_one(serve, caplog):
    server = serve(scripted)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLOWRL_TEST_JUDGE_KEY", "sk-test")
        reward = openai(server.url, mode="score", served_model="judge", api_key_env="FLOWRL_TEST_JUDGE_KEY", max_tokens=16)
    prompts = list(SCRIPT)
    with caplog.at_level(logging.WARNING, logger="flowrl.rewards.vlm_judge"):
        out = reward(fixed_images(3), prompts)
    assert out.scores.tolist() == pytest.approx([0.7, 0.8, 0.0])
    assert out.extras["malformed"].tolist() == [0.0, 0.0, 1.0]
    assert "1 of 3 judge answer(s) malformed" in caplog.text and "'I cannot tell.'" in caplog.text
    request = server.requests[0]
    assert request["headers"]["Authorization"] == "Bearer sk-test"
    assert request["body"]["max_tokens"] == 16 and "logprobs" not in request["body"]
    assert "from 0 to 10" in request_parts(request["body"])[1]  # the score mode's default question

    strict = openai(server.url, mode="score", on_malformed="error")
    with pytest.raises(FlowrlError, match=r"1 of 3 judge answer\(s\) malformed") as info:
        strict(fixed_images(3), prompts)
    assert "a blue square" in str(info.value) and info.value.hint


def test_openai_yes_prob_without_either_word_is_malformed(serve):
    answers = {"a red circle": [("Yes", -0.1), ("No", -2.5)], "two cats": [(" no", -0.05), ("maybe", -3.0)],
               "a blue square": [("The", -0.2), ("An", -1.7)]}
    server = serve(lambda body: completion("", next(a for p, a in answers.items() if p in request_parts(body)[1])))
    out = openai(server.url, top_logprobs=2)(fixed_images(3), list(answers))
    yes, no = torch.tensor(-0.1).exp(), torch.tensor(-2.5).exp()
    torch.testing.assert_close(out.scores, torch.tensor([float(yes / (yes + no)), 0.0, 0.0]))
    assert out.extras["malformed"].tolist() == [0.0, 0.0, 1.0]
    torch.testing.assert_close(out.extras["yes_no_mass"][:2], torch.tensor([float(yes + no), float(torch.tensor(-0.05).exp())]))
    with pytest.raises(FlowrlError, match="neither Yes nor No"):
        openai(server.url, top_logprobs=2, on_malformed="error")(fixed_images(3), list(answers))


def test_a_server_that_dies_between_two_calls_is_one_error_naming_it(serve):
    server = serve(scripted)
    reward = openai(server.url, mode="score", retries=1)
    assert reward(fixed_images(1), ["two cats"]).scores.tolist() == pytest.approx([0.8])
    server.stop()
    with pytest.raises(FlowrlError) as info:
        reward(fixed_images(2), ["two cats", "a red circle"])
    message = str(info.value)
    assert f"judge server {server.url}/chat/completions failed after 2 attempt(s): cannot connect" in message
    assert "Connection refused" in message and info.value.hint
    assert not re.search(r"Error\b|Traceback|urllib", message), message


def test_a_connection_closed_without_a_reply_is_retried_then_one_error(serve):
    server = serve(lambda body: None)
    with pytest.raises(FlowrlError, match=r"failed after 3 attempt\(s\): connection lost") as info:
        openai(server.url, mode="score", retries=2)(fixed_images(1), ["two cats"])
    assert len(server.requests) == 3 and server.url in str(info.value)


def test_a_slow_server_is_a_timeout_after_the_retries(serve):
    release = threading.Event()
    server = serve(lambda body: release.wait(5) and None)
    try:
        with pytest.raises(FlowrlError, match=r"failed after 2 attempt\(s\): no reply within timeout = 0.2 s"):
            build(backend="openai", base_url=server.url, mode="score", timeout=0.2, retries=1, retry_wait=0.0)(
                fixed_images(1), ["two cats"])
    finally:
        release.set()


def test_a_rejected_request_is_not_retried_and_quotes_the_servers_message(serve):
    server = serve(lambda body: (400, {"object": "error", "message": "top_logprobs 50 exceeds max_logprobs 20"}))
    with pytest.raises(FlowrlError, match="HTTP 400: top_logprobs 50 exceeds max_logprobs 20"):
        openai(server.url, top_logprobs=50)(fixed_images(1), ["two cats"])
    assert len(server.requests) == 1


def test_several_servers_share_the_requests_and_a_dead_one_is_retried_on_the_next(serve):
    first, second = serve(scripted), serve(scripted)
    reward = openai([first.url, second.url], mode="score", concurrency=1)
    assert reward(fixed_images(4), ["two cats"] * 4).scores.tolist() == pytest.approx([0.8] * 4)
    assert len(first.requests) == len(second.requests) == 2
    second.stop()
    assert reward(fixed_images(2), ["two cats"] * 2).scores.tolist() == pytest.approx([0.8] * 2)
    assert len(first.requests) == 4


# ----------------------------------------------------------------------------- configuration errors


def test_a_bad_mode_is_a_recipe_error_with_the_keys_help():
    with pytest.raises(FlowrlError, match="key 'mode' must be 'yes_prob' | 'score'") as info:
        build(mode="probability")
    assert "P(Yes)" in info.value.hint
    with pytest.raises(FlowrlError, match="unknown mode 'probability'") as info:
        VlmJudge(VlmJudgeConfig(mode="probability", model="x"))
    assert "yes_prob" in info.value.hint


@pytest.mark.parametrize("params, message, hint", [
    ({}, "backend 'transformers' needs model", "hf download"),
    ({"model": "/nonexistent/judge"}, "model directory not found: /nonexistent/judge", "hf download"),
    ({"backend": "openai"}, "backend 'openai' needs base_url", "vllm serve"),
    ({"backend": "openai", "base_url": "localhost:8000"}, "is not an http(s) URL", "http://127.0.0.1:8000/v1"),
    ({"backend": "openai", "base_url": "http://127.0.0.1:9/v1", "api_key_env": "FLOWRL_TEST_UNSET_KEY"},
     "names an environment variable that is not set", "export FLOWRL_TEST_UNSET_KEY"),
    ({"backend": "openai", "base_url": "http://127.0.0.1:9/v1", "check_on_start": False}, "served_model is empty",
     "--served-model-name"),
    ({"question": "Is this good?"}, "does not hold '{prompt}'", "{prompt}"),
    ({"mode": "score", "score_pattern": "Score: (\\d+"}, "score_pattern is not a regular expression", "default"),
    ({"mode": "score", "score_pattern": "Score: \\d+"}, "has no group to read the number from", "parentheses"),
])
def test_settings_no_backend_can_run_are_one_error_with_a_hint(params, message, hint, monkeypatch):
    monkeypatch.delenv("FLOWRL_TEST_UNSET_KEY", raising=False)
    with pytest.raises(FlowrlError) as info:
        build(**params)
    assert message in info.value.message and hint in info.value.hint


def test_a_served_model_the_server_does_not_serve_is_refused_at_start(serve):
    server = serve(scripted, models=("unified-reward", "other"))
    with pytest.raises(FlowrlError, match=r"does not serve 'judge'; it serves \['unified-reward', 'other'\]"):
        openai(server.url, served_model="judge")
    with pytest.raises(FlowrlError, match="serves 2 models"):
        openai(server.url)
    assert openai(server.url, served_model="other").backend.model == "other"


# ----------------------------------------------------------------------------- the rules


@pytest.mark.parametrize("text, expected", [
    ("Score: 7/10", 0.7), ("8", 0.8), ("**8**", 0.8), ("7/10.", 0.7), ("Final Score (1-10): **9**", 0.9),
    ("The score is 6.5", 0.65), ("3 cats. Score: 9", 0.9), ("Alignment score: 3\nFinal score: 5", 0.5),
    ("score=4", 0.4), ("3 cats in it", None), ("Score: 12", None), ("", None), ("Yes", None),
])
def test_parse_score_by_hand(text, expected):
    value = parse_score(text, re.compile(SCORE_PATTERN), 10.0)
    assert value == (pytest.approx(expected) if expected is not None else None)


def test_parse_score_reads_a_unified_reward_style_answer_on_its_own_scale():
    answer = "Alignment Score (1-5): 3.5\nCoherence Score (1-5): 2\nFinal Score: 4"
    assert parse_score(answer, re.compile(SCORE_PATTERN), 5.0) == pytest.approx(0.8)  # the last match
    assert parse_score(answer, re.compile(r"Alignment Score \(1-5\):\s*([\d.]+)"), 5.0) == pytest.approx(0.7)


def test_yes_probability_sums_the_words_variants_once_each():
    p, mass = yes_probability([("Yes", -1.0), (" yes", -2.0), ("YES", -9.0), ("Yes", -1.0), (" No", -1.5), ("x", -0.1)])
    e = torch.tensor([-1.0, -2.0, -9.0, -1.5]).exp().tolist()
    assert mass == pytest.approx(sum(e)) and p == pytest.approx(sum(e[:3]) / sum(e))
    assert yes_probability([("The", -0.1)]) == (None, 0.0)


def test_the_plan_counts_a_local_judge_from_its_safetensors_and_a_served_one_as_nothing(judge_dir):
    """``flowrl plan``'s bytes for the judge (PlansRewardMemory): the checkpoint's parameters, read
    from its safetensors headers without loading them, in the reward's dtype; 0 for a judge
    another process serves."""
    from flowrl.interfaces import PlansRewardMemory
    from flowrl_plugins.rewards.vlm_judge import VlmJudgeConfig

    from safetensors.torch import load_file

    # the second route: load every tensor the checkpoint stores and count it
    parameters = sum(t.numel() for f in judge_dir.glob("*.safetensors") for t in load_file(str(f)).values())
    assert parameters > 0
    local = VlmJudgeConfig(model=str(judge_dir), dtype="float32")
    assert isinstance(local, PlansRewardMemory) and local.memory_bytes() == 4 * parameters
    assert VlmJudgeConfig(model=str(judge_dir)).memory_bytes() == 2 * parameters  # 'auto': bf16 on a GPU
    assert f"{parameters / 1e9:.2f}e9 params" in local.memory_note
    served = VlmJudgeConfig(backend="openai", base_url="http://127.0.0.1:8000/v1")
    assert served.memory_bytes() == 0 and "served by another process" in served.memory_note
    assert VlmJudgeConfig(model="/no/such/judge").memory_bytes() is None
