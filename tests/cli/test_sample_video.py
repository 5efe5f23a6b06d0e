"""`flowrl sample` with a video model writes each clip as a filmstrip PNG (what grid.png shows),
a GIF and, with the video extra, an MP4; `flowrl eval` scores the clips with the recipe's rewards."""

from __future__ import annotations

import json

from PIL import Image

from flowrl.video import mp4_available

PROMPT = "a red circle moving left on a blue background"


def test_sample_writes_clips(tmp_path, flowrl_cli):
    out = tmp_path / "clips"
    call = ["sample", "--model", "embedded_video", "--set", "model.random_init=true", "--steps", "3",
            "--prompt", PROMPT, "--seeds", "2", "-o", str(out)]
    (r,) = flowrl_cli.in_process([call], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [rec["seed_index"] for rec in records] == [0, 1]
    for rec in records:
        with Image.open(out / rec["file"]) as png:
            assert png.size == (4 * 16, 16)  # 4 frames of 16 x 16, left to right
        with Image.open(out / rec["video"][0]) as gif:
            assert rec["video"][0].endswith(".gif") and gif.n_frames == 4 and gif.size == (128, 128)
        assert any(v.endswith(".mp4") for v in rec["video"]) == mp4_available()
    assert (out / "grid.png").is_file()


def test_tables_of_clips_are_refused_after_the_clips_are_written(tmp_path, flowrl_cli):
    """--tables writes image rows for offline training; a video model's clips were reloaded as
    filmstrips and failed inside the clip reward ("scores clips [B, F, 3, H, W] ... got shape")."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "tables"
    call = ["sample", str(repo / "recipes" / "quickstart_video.toml"), "--set", "model.random_init=true", "--tables",
            "--num-prompts", "1", "--seeds", "2", "--steps", "3", "-o", str(out)]
    (r,) = flowrl_cli.in_process([call], cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--tables writes tables of images" in " ".join(r.stderr.split())
    assert len(list((out / "images").glob("*.gif"))) == 2  # the clips themselves are kept
