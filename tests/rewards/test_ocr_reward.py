"""The `ocr` reward: its rule (quoted target, normalisation, edit distance, reading order) on
hand-computed cases, and real OCR (RapidOCR, whose models ship in its wheel: offline) on words
rendered with PIL in two fonts at several sizes. The `dev` extra installs `ocr`, so these run in CI;
ONNX Runtime gets one thread (it ignores OMP_NUM_THREADS)."""

from __future__ import annotations

import sys

import matplotlib
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont
from tiny_recipe import tiny_recipe

from flowrl.errors import FlowrlError, MissingDependencyError
from flowrl.plugins import get_registry
from flowrl_plugins.rewards import ocr
from flowrl_plugins.rewards.ocr import (
    edit_distance,
    normalise_text,
    quoted_target,
    reading_order,
    resolve_provider,
    text_reward,
)

# ----------------------------------------------------------------------------- the rule, no OCR


@pytest.mark.parametrize("a, b, distance", [
    ("kitten", "sitting", 3), ("flaw", "lawn", 2), ("", "abc", 3), ("abc", "", 3), ("abc", "abc", 0),
    ("open", "closed", 4), ("hello", "hel1o", 1), ("ab", "ba", 2),
])
def test_edit_distance_by_hand(a, b, distance):
    assert edit_distance(a, b) == distance == edit_distance(b, a)


@pytest.mark.parametrize("recognised, target, match, expected", [
    ("HELLO world", "hello world", "contains", 1.0),       # case and whitespace do not count
    ("H E L L O", "hello", "exact", 1.0),
    ("Hel1o", "hello", "contains", 0.8),                   # one substitution in five: 1 - 1/5
    ("helo", "hello", "contains", 0.8),                    # one deletion
    ("ocen", "OPEN", "exact", 0.75),
    ("", "open", "contains", 0.0),                          # nothing read: distance = len(target)
    ("xyzxyzxyzxyz", "ab", "contains", 0.0),                # clipped: never below 0
    ("GRAND OPENING today", "opening", "contains", 1.0),   # Flow-GRPO: the target inside the text is exact
    ("GRAND OPENING today", "opening", "exact", 0.0),      # 10 insertions, clipped to 7
    ("OPEN!", "open", "exact", 0.75),                       # one insertion in four
    ("STRASSE", "straße", "contains", 1.0),                 # case-folded, not only lower-cased
])
def test_text_reward_by_hand(recognised, target, match, expected):
    assert text_reward(recognised, target, match) == pytest.approx(expected)


def test_normalise_text_folds_case_and_drops_all_whitespace():
    assert normalise_text(" Hello\tWORLD\n ß ") == "helloworldss"
    with pytest.raises(ValueError):
        text_reward("anything", " \n ")


@pytest.mark.parametrize("prompt, target", [
    ('a neon sign that says "Open Late"', "Open Late"),
    ('a sign "OPEN" above a door marked "24 h"', "OPEN 24 h"),        # every span, joined with a space
    ("a poster reading “Sale”", "Sale"),                                # typographic quotes
    ('"START" and “END”', "START END"),
])
def test_quoted_target(prompt, target):
    assert quoted_target(prompt) == target


@pytest.mark.parametrize("prompt", ["a red fox", 'an unbalanced "quote', 'an empty "" one', 'blank "  "'])
def test_a_prompt_without_quoted_text_is_refused(prompt):
    with pytest.raises(ValueError, match="quote"):
        quoted_target(prompt)


def box(x0, y0, x1, y1):
    return [[x0, y0], [x1, y0], [x1, y1], [x0, y1]]


def test_reading_order_is_lines_top_to_bottom_then_left_to_right():
    boxes = [
        box(300, 210, 400, 250),  # 0: line 2, right
        box(10, 10, 100, 50),     # 1: line 1, left
        box(20, 200, 120, 240),   # 2: line 2, left (its top 10 px above 0's)
        box(200, 22, 300, 60),    # 3: line 1, right, a little lower (centre 41 within box 1's 10..50)
        box(50, 400, 150, 440),   # 4: line 3
    ]
    assert reading_order(boxes) == [1, 3, 2, 0, 4]
    assert reading_order([]) == []


def test_resolve_provider():
    cpu_only, gpu = ["CPUExecutionProvider"], ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert resolve_provider("cpu", gpu) is None
    assert resolve_provider("auto", cpu_only) is None
    assert resolve_provider("cuda", gpu) == 0 and resolve_provider("cuda:1", gpu) == 1
    with pytest.raises(FlowrlError, match="needs ONNX Runtime's CUDA provider") as err:
        resolve_provider("cuda:0", cpu_only)
    assert "onnxruntime-gpu" in err.value.format()
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        ocr.OcrConfig(device="gpu")


# ----------------------------------------------------------------------------- the missing extra


@pytest.mark.parametrize("module", ["rapidocr_onnxruntime", "onnxruntime"])
def test_a_missing_extra_is_one_message_naming_it(monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails as if not installed
    comp = get_registry().get("reward", "ocr")
    with pytest.raises(MissingDependencyError) as err:
        comp.build(comp.params())
    text = err.value.format()
    assert "the 'ocr' reward needs the optional package" in text and module in text
    assert 'pip install "flowrl-diffusion[ocr]"' in text


def test_an_installed_extra_that_cannot_load_says_why(monkeypatch):
    def broken(module, *, extra, purpose):
        try:
            raise ImportError("libGL.so.1: cannot open shared object file: No such file or directory")
        except ImportError as exc:
            raise MissingDependencyError(f"{purpose} needs {module}") from exc

    monkeypatch.setattr(ocr, "require", broken)
    with pytest.raises(FlowrlError, match="installed but cannot load: libGL.so.1") as err:
        ocr.Ocr(ocr.OcrConfig())
    assert not isinstance(err.value, MissingDependencyError) and "libgl1" in err.value.format()


# ----------------------------------------------------------------------------- real OCR

SIZE = 512
DEJAVU = f"{matplotlib.get_data_path()}/fonts/ttf/DejaVuSerif.ttf"  # matplotlib is in the dev extra
FONTS = {
    "pil-default-36": lambda: ImageFont.load_default(size=36),
    "pil-default-80": lambda: ImageFont.load_default(size=80),
    "dejavu-serif-28": lambda: ImageFont.truetype(DEJAVU, 28),
    "dejavu-serif-64": lambda: ImageFont.truetype(DEJAVU, 64),
}


def render(text: str, font, size: int = SIZE) -> torch.Tensor:
    """Black ``text`` centred on a white ``size x size`` image, as ``[3, H, W]`` in [0, 1]."""
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = draw.multiline_textbbox((0, 0), text, font=font, align="center")
    draw.multiline_text(((size - right - left) / 2, (size - bottom - top) / 2), text, fill="black", font=font,
                        align="center")
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


@pytest.fixture(scope="module")
def reward():
    comp = get_registry().get("reward", "ocr")
    return comp.build(comp.params(device="cpu", threads=1))


def test_runs_on_the_cpu_provider(reward):
    assert reward.providers[0] == "CPUExecutionProvider"


@pytest.mark.parametrize("font", FONTS, ids=list(FONTS))
def test_the_right_word_scores_high_a_wrong_word_low_and_a_blank_image_zero(reward, font):
    word = render("GARDEN", FONTS[font]())
    blank = torch.ones(3, SIZE, SIZE)
    images = torch.stack([word, word, blank])
    prompts = ['a shop sign that says "Garden"', 'a shop sign that says "Studio"', 'a shop sign that says "Garden"']
    right, wrong, empty = reward(images, prompts).scores.tolist()
    assert right >= 0.9, (font, right)
    assert wrong < 0.6, (font, wrong)
    assert empty == 0.0


def test_two_lines_are_read_in_order_and_scored_as_one_text(reward):
    font = ImageFont.truetype(DEJAVU, 56)
    images = torch.stack([render("HELLO\nWORLD", font), render("WORLD\nHELLO", font)])
    prompts = ['a poster saying "Hello World"'] * 2
    scores = reward(images, prompts).scores
    assert scores[0] == 1.0
    assert scores[1] < 0.6  # the same words, in the other order: "worldhello" vs "helloworld"


def test_a_prompt_without_quotes_is_one_error_before_any_image_is_read(reward, monkeypatch):
    def no_ocr(*args, **kwargs):
        raise AssertionError("OCR ran before the prompts were checked")

    monkeypatch.setattr(reward, "engine", no_ocr)
    images = torch.ones(2, 3, 64, 64)
    with pytest.raises(FlowrlError, match="cannot score the prompt 'a red fox': it quotes no text") as err:
        reward(images, ['a sign "OK"', "a red fox"])
    assert err.value.where == "reward 'ocr'" and 'says "OPEN"' in err.value.hint


def test_scores_do_not_depend_on_the_batch(reward):
    font = FONTS["dejavu-serif-64"]()
    images = torch.stack([render("FLOW", font, 256), render("GRPO", font, 256), render("F1OW", font, 256)])
    prompts = ['"flow"', '"flow"', '"grpo"']
    full = reward(images, prompts).scores
    singles = torch.cat([reward(images[i : i + 1], prompts[i : i + 1]).scores for i in range(3)])
    torch.testing.assert_close(full, singles)


RECIPE = tiny_recipe(run=None, sampler={"steps": 3}, chunker={"use": "step", "size": None}, log=None,
                     train={"iterations": 1, "prompts_per_iteration": 1, "group_size": 2},
                     prompts={"source": "prompts.txt"}, rewards=[{"use": "ocr", "threads": 1}])


def test_flowrl_validate_refuses_a_prompt_file_with_a_prompt_without_quotes(validate, tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(RECIPE)
    (tmp_path / "prompts.txt").write_text('a shop sign that says "OPEN"\na neon sign reading “Late”\n')
    code, err = validate(recipe)
    assert code == 0, err
    (tmp_path / "prompts.txt").write_text('a shop sign that says "OPEN"\na red fox\n')
    code, err = validate(recipe)
    flat = " ".join(err.split())
    assert code == 2 and "Traceback" not in err, err
    assert "[prompts].source: reward 'ocr' cannot score the prompt 'a red fox'" in flat and "quotes no text" in flat
