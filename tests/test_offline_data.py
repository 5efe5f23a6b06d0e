"""Offline data tables (flowrl.offline): the schema, its errors, image loading and encoding."""

import json

import pytest
import torch

from flowrl.errors import FlowrlError
from flowrl.offline import best_rows, iteration_rows, load_image, offline_batch, read_offline_rows


def png(path, colour):
    from PIL import Image

    Image.new("RGB", (32, 32), colour).save(path)
    return path.name


def test_a_jsonl_pair_table_and_a_csv_image_table_are_read_with_paths_beside_them(tmp_path):
    a, b = png(tmp_path / "a.png", (255, 0, 0)), png(tmp_path / "b.png", (0, 0, 255))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "x", "chosen": a, "rejected": b, "score": 1}) + "\n")
    rows = read_offline_rows(tmp_path / "p.jsonl")
    assert rows.kind == "pairs" and rows.prompts == ["x"] and rows.images["chosen"] == [tmp_path / a]
    (tmp_path / "s.csv").write_text(f"prompt,image\ny,{b}\n")
    rows = read_offline_rows(tmp_path / "s.csv")
    assert rows.kind == "images" and rows.images["image"] == [tmp_path / b]


@pytest.mark.parametrize("row, says", [
    ({"prompt": "x"}, "neither an image table nor a preference table"),
    ({"prompt": "x", "chosen": "a.png"}, "neither an image table nor a preference table"),
    ({"prompt": "x", "image": "a.png", "chosen": "a.png", "rejected": "b.png"}, "neither"),
    ({"prompt": "", "image": "a.png"}, "row 1 has an empty or missing prompt"),
])
def test_a_table_of_no_kind_or_with_an_empty_cell_is_one_message(tmp_path, row, says):
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(FlowrlError, match=says):
        read_offline_rows(tmp_path / "t.jsonl")


def test_a_missing_or_unknown_file_is_refused(tmp_path):
    with pytest.raises(FlowrlError, match="not found"):
        read_offline_rows(tmp_path / "none.jsonl")
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(FlowrlError, match="must be .jsonl"):
        read_offline_rows(tmp_path / "t.txt")


def test_the_embedded_model_encodes_images_exactly_and_batches_are_seeded(tmp_path):
    from plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel

    model = EmbeddedModel(EmbeddedConfig(random_init=True))
    lines = [{"prompt": f"p{i}", "image": png(tmp_path / f"{i}.png", (40 * i, 255 - 30 * i, 7))} for i in range(5)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows = read_offline_rows(tmp_path / "t.jsonl")
    b = offline_batch(rows, model, seed=0, iteration=3, count=2)
    again = offline_batch(rows, model, seed=0, iteration=3, count=2)
    assert b.rows == again.rows and len(set(b.rows)) == 2
    assert b.latents["image"].shape == (2, *model.latent_shape)
    images = torch.stack([load_image(rows.images["image"][r]) for r in b.rows])
    assert torch.allclose(model.decode(b.latents["image"]), images, atol=1e-6, rtol=0)  # the pixel "VAE" is exact


def test_a_model_that_cannot_encode_images_is_refused(tmp_path):
    (tmp_path / "t.jsonl").write_text(json.dumps({"prompt": "p", "image": png(tmp_path / "a.png", (1, 2, 3))}) + "\n")
    with pytest.raises(FlowrlError, match="cannot encode images"):
        offline_batch(read_offline_rows(tmp_path / "t.jsonl"), object(), seed=0, iteration=0, count=1)


def test_best_worst_rows_pair_each_prompts_extremes_and_skip_ties():
    from flowrl.offline import best_worst_rows

    recs = [{"prompt": p, "file": f"{p}{k}"} for p in "ab" for k in range(3)]
    rows = best_worst_rows(recs, [0.2, 0.9, 0.1, 0.5, 0.5, 0.5])
    assert rows == [{"prompt": "a", "chosen": "a1", "rejected": "a2", "chosen_score": 0.9, "rejected_score": 0.1}]


def test_the_embedded_model_passes_the_encode_images_conformance_check():
    from flowrl.testing.conformance import check_adapter
    from plugins.embedded.plugin import EmbeddedConfig, EmbeddedModel

    report = check_adapter(EmbeddedModel(EmbeddedConfig(random_init=True)), checks=["encode_images"])
    assert report.results[0].message.startswith("decode(encode(images)) differs from the images by at most")


def test_best_rows_keep_each_prompts_best_image_and_its_score():
    records = [{"prompt": p, "file": f} for p, f in (("a", "1"), ("a", "2"), ("b", "3"), ("a", "4"))]
    assert best_rows(records, [0.1, 0.7, 0.2, 0.7]) == [{"prompt": "a", "image": "2", "score": 0.7},
                                                        {"prompt": "b", "image": "3", "score": 0.2}]
    with pytest.raises(ValueError, match="one score per record"):
        best_rows(records, [1.0])


def test_iteration_rows_are_a_seeded_draw_without_replacement():
    rows = iteration_rows(10, seed=3, iteration=5, count=4)
    assert rows == iteration_rows(10, seed=3, iteration=5, count=4) and len(set(rows)) == 4
    assert rows != iteration_rows(10, seed=3, iteration=6, count=4)
    assert sorted(iteration_rows(3, seed=3, iteration=5, count=8)) == [0, 1, 2]  # a smaller table: all of it


def test_sample_tables_need_a_source_with_a_reward(flowrl_cli, tmp_path):
    argv = ["sample", "--model", "embedded", "--prompt", "a red circle on a blue background", "--tables",
            "--no-grid", "-o", str(tmp_path / "out")]
    (r,) = flowrl_cli.in_process([argv], cwd=tmp_path)
    assert r.returncode == 2 and "--tables scores the images with the recipe's [[rewards]]" in r.stderr, r.stderr


def test_each_table_image_is_encoded_once_alone_and_its_latent_kept(tmp_path):
    """A row drawn again reads its latent from the cache; every image goes through the encoder
    alone (a batch of one), so a latent does not depend on its batch mates; a full cache drops
    the least recently used and encodes it again to the same latent."""
    from flowrl.offline import LatentCache, encode_rows

    from PIL import Image

    rows_json = []
    for i in range(3):
        Image.new("RGB", (8, 8), (40 * i, 10, 200)).save(tmp_path / f"{i}.png")
        rows_json.append(json.dumps({"prompt": f"p{i}", "image": f"{i}.png"}))
    (tmp_path / "t.jsonl").write_text("\n".join(rows_json) + "\n")
    table = read_offline_rows(tmp_path / "t.jsonl")

    class Model:
        image_size = (8, 8)
        calls: list[int] = []

        def encode_images(self, images):
            self.calls.append(images.shape[0])
            return images.flatten(1) * 2

    model, cache = Model(), LatentCache(max_items=2)
    first = encode_rows(table, model, [0, 1], cache=cache).latents["image"]
    again = encode_rows(table, model, [1, 0], cache=cache).latents["image"]
    assert Model.calls == [1, 1] and torch.equal(again, first.flip(0))  # both read back
    encode_rows(table, model, [2], cache=cache)  # evicts row 1's (the least recently used)
    assert Model.calls == [1, 1, 1] and set(cache.items) == {(0, "image"), (2, "image")}
    assert torch.equal(encode_rows(table, model, [1], cache=cache).latents["image"][0], first[1])
    assert Model.calls == [1, 1, 1, 1]


def test_a_photo_is_read_upright_and_resized_to_cover_then_centre_cropped(tmp_path):
    from PIL import Image

    im = Image.new("RGB", (40, 20), (255, 0, 0))
    im.paste((0, 0, 255), (0, 0, 20, 20))  # left half blue, right half red
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: displayed turned 90 degrees clockwise
    im.save(tmp_path / "photo.jpg", exif=exif, quality=100)
    upright = load_image(tmp_path / "photo.jpg")
    assert upright.shape == (3, 40, 20)  # portrait, as a viewer shows it
    assert upright[2, 5, 10] > 0.9 and upright[0, 35, 10] > 0.9  # blue on top, red below
    square = load_image(tmp_path / "photo.jpg", (16, 16))  # cover 16 x 16 (scale 0.8 -> 16 x 32), crop the centre
    assert square.shape == (3, 16, 16)
