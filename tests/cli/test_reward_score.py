"""`flowrl reward score NAME --images ... --prompts FILE | --prompt TEXT`: images on disk scored by
any registered reward, the reward built as a recipe's [[rewards]] entry; bad input is one message.

The embedded model's offline rewards (`brightness`, `area`) run in this process; the `ocr` reward
runs in one subprocess with HF_HUB_OFFLINE=1 (its models ship in its wheel), as do the commands
of docs/rewards.md, as written."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

REPO = Path(__file__).resolve().parents[2]
ONE_THREAD = ["--set", "threads=1"]  # ONNX Runtime ignores OMP_NUM_THREADS


def solid(path: Path, rgb, size=(32, 32)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, tuple(rgb)).save(path)
    return path


def word(path: Path, text: str, size: int = 512) -> Path:
    """Black ``text`` on a white ``size x size`` image (PIL's built-in font, 64 px)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=64)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((size - right - left) / 2, (size - bottom - top) / 2), text, fill="black", font=font)
    image.save(path)
    return path


def rows_of(stdout: str) -> list[tuple[str, str]]:
    """``(image, score)`` of each table row."""
    return re.findall(r"│ (\S+)\s+│.*│\s+([\d.]+|nan) │", stdout)


def one_message(result, *needles: str) -> None:
    """Exit status 2, one `error:` message holding every needle, no traceback."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    err = result.flat_err
    assert err.startswith("error:") and err.count("error:") == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.fixture
def shots(tmp_path) -> Path:
    """A folder of three images, named out of order: sorted, they are white, grey, black; and a
    file that is not an image (skipped in a folder)."""
    folder = tmp_path / "shots"
    solid(folder / "b.png", (128, 128, 128))
    solid(folder / "a.png", (255, 255, 255))
    solid(folder / "c.jpg", (0, 0, 0))
    (folder / "notes.txt").write_text("not an image")
    return folder


def test_a_folder_is_scored_in_sorted_order_with_a_table_the_mean_and_json(flowrl_cli, tmp_path, shots):
    out = tmp_path / "deeper" / "scores.json"
    r, = flowrl_cli.in_process([["reward", "score", "brightness", "--images", shots, "--prompt", "any [b]prompt[/b]",
                                 "--json", out]], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [Path(p).name for p, _ in rows_of(r.stdout)] == ["a.png", "b.png", "c.jpg"]
    assert [float(s) for _, s in rows_of(r.stdout)] == pytest.approx([1.0, 128 / 255, 0.0], abs=1e-4)
    assert "any [b]prompt[/b]" in r.stdout  # the prompt as given, not read as markup
    assert "mean 0.5007 (n = 3)" in r.flat_out
    rows = json.loads(out.read_text())
    assert [Path(row["image"]).name for row in rows] == ["a.png", "b.png", "c.jpg"]
    assert all(row["prompt"] == "any [b]prompt[/b]" for row in rows)
    assert [row["score"] for row in rows] == pytest.approx([1.0, 128 / 255, 0.0], abs=1e-6)


def test_a_prompt_file_gives_each_image_its_prompt_and_files_keep_their_order(flowrl_cli, tmp_path):
    # `area`: the share of pixels not of the prompt's background colour (the embedded grammar)
    blue = solid(tmp_path / "blue.png", (0, 0, 255))
    half = tmp_path / "half.png"
    image = np.zeros((32, 32, 3), np.uint8)
    image[:, :, 2] = 255
    image[:16] = (255, 255, 255)  # top half white, bottom half blue
    Image.fromarray(image).save(half)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle on a blue background\n\na red circle on a white background\n"
                       "a red circle on a blue background\n")
    r, = flowrl_cli.in_process([["reward", "score", "area", "--images", blue, half, "--prompts", prompts, "-i", blue]],
                               cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [(Path(p).name, float(s)) for p, s in rows_of(r.stdout)] == [
        ("blue.png", 0.0), ("half.png", 0.5), ("blue.png", 0.0)]  # the order of the command line


def test_images_takes_every_path_up_to_the_next_option():
    from flowrl.commands.reward_score import spread_values

    names = ("--images", "-i")
    assert spread_values(["ocr", "--images", "a", "b", "--prompt", "p", "-i", "c", "d"], names) == [
        "ocr", "--images", "a", "--images", "b", "--prompt", "p", "-i", "c", "-i", "d"]
    assert spread_values(["ocr", "--prompt", "p", "q", "--images", "a", "--", "-b"], names) == [
        "ocr", "--prompt", "p", "q", "--images", "a", "--", "-b"]  # other options unchanged; `--` ends it
    assert spread_values(["ocr", "--images=a", "b"], names) == ["ocr", "--images=a", "b"]


def test_images_of_different_sizes_are_scored_apart_but_reported_in_order(flowrl_cli, tmp_path):
    paths = [solid(tmp_path / "x" / "1.png", (255, 255, 255), (16, 16)), solid(tmp_path / "x" / "2.png", (0, 0, 0)),
             solid(tmp_path / "x" / "3.png", (255, 255, 255), (16, 24))]
    r, = flowrl_cli.in_process([["reward", "score", "brightness", "--images", *paths, "--prompt", "p",
                                 "--batch-size", "1"]], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [(Path(p).name, float(s)) for p, s in rows_of(r.stdout)] == [("1.png", 1.0), ("2.png", 0.0), ("3.png", 1.0)]


def test_bad_input_is_one_message(flowrl_cli, tmp_path, shots):
    (tmp_path / "empty").mkdir()
    (tmp_path / "two.txt").write_text("one\ntwo\n")
    cases = {
        "unknown reward": (["nosuch", "-i", shots, "--prompt", "p"],
                           ["flowrl reward score NAME: unknown reward 'nosuch'"]),
        "unknown reward, said before the images": (["nosuch", "--prompt", "p"],
                                                    ["flowrl reward score NAME: unknown reward 'nosuch'"]),
        "unknown key": (["ocr", "-i", shots, "--prompt", '"p"', "--set", "nope=1"],
                        ["flowrl reward score (reward 'ocr'): unknown key 'nope'", "threads"]),
        "key of a reward without keys": (["brightness", "-i", shots, "--prompt", "p", "--set", "gamma=2"],
                                         ["unknown key 'gamma': reward 'brightness' takes no parameters"]),
        "bad value": (["ocr", "-i", shots, "--prompt", '"p"', "--set", "device=gpu"], ["unknown device 'gpu'"]),
        "setting without =": (["brightness", "-i", shots, "--prompt", "p", "--set", "gamma"],
                              ["setting 'gamma' must look like key=value"]),
        "missing image": (["brightness", "-i", tmp_path / "gone.png", "--prompt", "p"], ["image not found", "gone.png"]),
        "no images": (["brightness", "--prompt", "p"], ["no images given"]),
        "empty folder": (["brightness", "-i", tmp_path / "empty", "--prompt", "p"], ["no images in the folder"]),
        "not an image": (["brightness", "-i", shots / "notes.txt", "--prompt", "p"],
                         ["cannot read the image", "notes.txt"]),
        "missing prompt file": (["brightness", "-i", shots, "--prompts", tmp_path / "gone.txt"],
                                ["prompt file not found"]),
        "count mismatch": (["brightness", "-i", shots, "--prompts", tmp_path / "two.txt"],
                           ["the number of prompts in", "two.txt (2) is not the number of images (3)"]),
        "no prompts": (["brightness", "-i", shots], ["exactly one of --prompts FILE and --prompt TEXT"]),
        "both prompts": (["brightness", "-i", shots, "--prompt", "p", "--prompts", tmp_path / "two.txt"],
                         ["exactly one of --prompts FILE and --prompt TEXT"]),
        "a prompt the reward refuses": (["area", "-i", shots, "--prompt", "a red fox"],
                                        ["reward 'area' cannot score", "not a prompt of the grammar"]),
        "a clip reward": (["temporal_consistency", "-i", shots, "--prompt", "p"], ["scores a video model's clips"]),
        "a latent reward": (["latent_verifier", "-i", shots, "--prompt", "p"], ["scores a model's latents"]),
    }
    results = flowrl_cli.in_process([["reward", "score", *argv] for argv, _ in cases.values()], cwd=tmp_path)
    for (name, (_, needles)), result in zip(cases.items(), results):
        try:
            one_message(result, *needles)
        except AssertionError as exc:
            raise AssertionError(f"case '{name}': {exc}") from exc


def test_a_non_finite_score_is_null_in_json_and_left_out_of_the_mean(tmp_path, capsys):
    from flowrl.commands.reward_score import print_table, write_json

    rows = [{"image": "a.png", "prompt": "p", "score": 0.25}, {"image": "b.png", "prompt": "p", "score": None},
            {"image": "c.png", "prompt": "p", "score": 0.75}]
    print_table("r", rows)
    write_json(tmp_path / "s.json", rows)
    out = " ".join(capsys.readouterr().out.split())
    assert "nan" in out and "mean 0.5000 (n = 2, non-finite scores left out: 1)" in out
    assert [row["score"] for row in json.loads((tmp_path / "s.json").read_text())] == [0.25, None, 0.75]


def test_the_ocr_extra_missing_is_one_message(flowrl_cli, tmp_path, shots, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)  # as if not installed
    r, = flowrl_cli.in_process([["reward", "score", "ocr", "-i", shots, "--prompt", '"p"']], cwd=tmp_path)
    one_message(r, "the 'ocr' reward needs the optional package 'rapidocr_onnxruntime'",
                'pip install "flowrl-diffusion[ocr]"')


# ----------------------------------------------------------------------------- ocr, offline, in a subprocess


def doc_commands() -> list[list[str]]:
    """The `flowrl reward score` command lines of docs/rewards.md's code blocks."""
    text = (REPO / "docs" / "rewards.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    return [shlex.split(line)[1:] for block in blocks for line in block.splitlines()
            if line.startswith("flowrl reward score ")]


def test_ocr_through_the_cli_offline_and_the_documented_commands(flowrl_cli, tmp_path):
    samples = tmp_path / "samples"
    word(samples / "00.png", "OPEN")
    word(samples / "01.png", "CLOSED")
    (tmp_path / "prompts.txt").write_text('a shop sign that says "Open"\na shop sign that says "Open"\n')
    documented = doc_commands()
    assert len(documented) >= 2 and all(argv[:3] == ["reward", "score", argv[2]] for argv in documented)
    calls = [["reward", "score", "ocr", "--images", samples, "--prompt", 'a neon sign that says "open"', *ONE_THREAD,
              "--json", tmp_path / "right.json"],
             ["reward", "score", "ocr", "-i", samples / "00.png", "--prompt", 'a neon sign that says "Bakery"',
              *ONE_THREAD]]
    calls += [argv + (ONE_THREAD if argv[2] == "ocr" else []) for argv in documented]
    results = flowrl_cli.batch([{"argv": [str(a) for a in argv], "env": {"HF_HUB_OFFLINE": "1"}} for argv in calls],
                               cwd=tmp_path, timeout=300)
    right, wrong, *docs = results
    assert right.returncode == 0, right.stderr
    scores = {Path(row["image"]).name: row["score"] for row in json.loads((tmp_path / "right.json").read_text())}
    assert scores["00.png"] >= 0.9, scores          # the right word
    assert scores["01.png"] < 0.6, scores           # another word: "closed" vs "open"
    assert wrong.returncode == 0, wrong.stderr
    assert float(rows_of(wrong.stdout)[0][1]) < 0.6  # the prompt asks for another word
    for argv, result in zip(documented, docs):
        assert result.returncode == 0, (argv, result.stderr)
        assert "Traceback" not in result.stderr and rows_of(result.stdout), (argv, result.stdout)
    assert (tmp_path / "scores.json").is_file()  # the first documented command's --json
