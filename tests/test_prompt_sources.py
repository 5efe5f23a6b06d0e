"""Prompt datasets: JSONL / CSV / TSV / Parquet tables with named columns, Hugging Face datasets
(offline), train / eval splits, rows that carry a condition image, bounded memory, and the
metadata rewards receive."""

from __future__ import annotations

import csv
import json
import pickle
import tracemalloc

import pytest
import torch

from flowrl.errors import FlowrlError
from flowrl.prompts import (
    PromptRow,
    condition_of,
    evaluation_prompts,
    prompts_for_iteration,
    read_prompts,
    reward_metadata,
)
from flowrl.recipe import PromptsConfig

ROWS = [
    {"prompt": "a red cat", "image": "img/0.png", "split": "train"},
    {"prompt": "the blue dog", "image": "img/1.png", "split": "train"},
    {"prompt": "a dog on the red mat", "image": "img/2.png", "split": "test"},
    {"prompt": "a cat", "image": "", "split": "train"},
]


def _config(**kw):
    return PromptsConfig(**{"condition_column": "image", "split_column": "split", **kw})


def _write_images(root):
    from PIL import Image

    (root / "img").mkdir(exist_ok=True)
    for i in range(3):
        Image.new("RGB", (8, 6), (40 * i, 100, 200)).save(root / "img" / f"{i}.png")


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "edits.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n", encoding="utf-8")
    _write_images(tmp_path)
    return path


def test_jsonl_rows_carry_their_condition_and_follow_the_split(jsonl, tmp_path):
    train = read_prompts(str(jsonl), None, "w", _config())
    assert len(train) == 3 and list(map(str, train)) == ["a red cat", "the blue dog", "a cat"]
    assert condition_of(train[0]) == str(tmp_path / "img" / "0.png")  # relative to the table's directory
    assert condition_of(train[2]) is None  # an empty cell: no condition
    evals = read_prompts(str(jsonl), None, "w", _config(), role="eval")
    assert list(map(str, evals)) == ["a dog on the red mat"] and condition_of(evals[0]).endswith("2.png")
    # without a split column every row is read, without a condition column plain strings
    everything = read_prompts(str(jsonl), None, "w", PromptsConfig())
    assert len(everything) == 4 and all(type(p) is str for p in everything)
    assert train[-1] == "a cat" and list(map(str, train[0:2])) == ["a red cat", "the blue dog"]


def test_csv_and_tsv_with_quoted_newlines(tmp_path):
    rows = [{"text": 'a "quoted"\nprompt', "split": "train"}, {"text": "second, with a comma", "split": "train"},
            {"text": "held out", "split": "test"}]
    for name, delim in (("p.csv", ","), ("p.tsv", "\t")):
        path = tmp_path / name
        with path.open("w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, ["text", "split"], delimiter=delim)
            w.writeheader()
            w.writerows(rows)
        cfg = PromptsConfig(text_column="text", split_column="split")
        assert list(read_prompts(str(path), None, "w", cfg)) == ['a "quoted"\nprompt', "second, with a comma"]
        assert list(read_prompts(str(path), None, "w", cfg, role="eval")) == ["held out"]


def test_parquet_reads_row_groups_of_the_needed_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    _write_images(tmp_path)
    n = 50
    table = pa.table({
        "prompt": [f"prompt {i}" for i in range(n)],
        "image": [f"img/{i % 3}.png" for i in range(n)],
        "split": ["test" if i % 5 == 0 else "train" for i in range(n)],
        "blob": [b"x" * 1000 for _ in range(n)],  # a column that is never read
    })
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=8)
    train = read_prompts(str(tmp_path / "p.parquet"), None, "w", _config())
    evals = read_prompts(str(tmp_path / "p.parquet"), None, "w", _config(), role="eval")
    assert len(train) == 40 and len(evals) == 10
    assert [str(p) for p in evals] == [f"prompt {i}" for i in range(0, n, 5)]
    assert condition_of(train[6]) == str(tmp_path / "img" / f"{8 % 3}.png")  # train row 6 is table row 8
    assert len(train.cache) <= 2 and all(set(g) == {"prompt", "image"} for g in train.cache.values())


def test_huggingface_datasets_from_disk_and_data_files_offline(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    _write_images(tmp_path)
    train = datasets.Dataset.from_list([{k: v for k, v in r.items() if k != "split"} for r in ROWS if r["split"] == "train"])
    test = datasets.Dataset.from_list([{k: v for k, v in r.items() if k != "split"} for r in ROWS if r["split"] == "test"])
    saved = tmp_path / "saved"
    datasets.DatasetDict(train=train, test=test).save_to_disk(str(saved))
    cfg = PromptsConfig(condition_column="image")
    rows = read_prompts(str(saved), None, "w", cfg)
    assert list(map(str, rows)) == ["a red cat", "the blue dog", "a cat"]
    assert condition_of(rows[1]) == str(saved / "img" / "1.png")  # relative to the dataset directory
    assert list(map(str, read_prompts(str(saved), None, "w", cfg, role="eval"))) == ["a dog on the red mat"]
    with pytest.raises(FlowrlError, match="no split 'validation'"):
        read_prompts(str(saved), None, "w", PromptsConfig(eval_split="validation"), role="eval")
    # a directory of data files: datasets names the splits after the files
    files = tmp_path / "files"
    files.mkdir()
    for split, ds in (("train", train), ("test", test)):
        ds.to_json(str(files / f"{split}.jsonl"))
    assert list(read_prompts(str(files), None, "w", PromptsConfig(), role="eval")) == ["a dog on the red mat"]
    # an Image feature with the images embedded (as `datasets` stores them): read from the bytes
    embedded = datasets.Dataset.from_dict({"prompt": ["a red cat"], "image": [str(tmp_path / "img" / "2.png")]})
    embedded = embedded.cast_column("image", datasets.Image())
    embedded.save_to_disk(str(tmp_path / "embedded"))
    (tmp_path / "img" / "2.png").unlink()  # only the embedded copy is left
    row = read_prompts(str(tmp_path / "embedded"), None, "w", PromptsConfig(condition_column="image"))[0]
    meta = reward_metadata([row], torch.zeros(1, 3, 6, 8))
    torch.testing.assert_close(meta["condition_images"][0, :, 0, 0], torch.tensor([80, 100, 200]) / 255.0)
    # a hub name that is not in the local cache: one clear error, no traceback
    with pytest.raises(FlowrlError, match="cannot load dataset") as err:
        read_prompts("hf:nobody/not-a-dataset", None, "[prompts].source", PromptsConfig())
    assert "local cache" in err.value.hint


def test_bad_tables_say_what_and_where(jsonl, tmp_path):
    with pytest.raises(FlowrlError, match="no column 'caption'") as err:
        read_prompts(str(jsonl), None, "recipe.toml: [prompts].source", PromptsConfig(text_column="caption"))
    assert err.value.where == "recipe.toml: [prompts].source"
    with pytest.raises(FlowrlError, match="no prompts in .* with split = 'dev'"):
        read_prompts(str(jsonl), None, "w", _config(train_split="dev"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(FlowrlError, match="line 2: not JSON"):
        read_prompts(str(bad), None, "w", PromptsConfig())


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError("simulated: no pyarrow")
        return real_import(name, *args, **kwargs)

    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    monkeypatch.delitem(__import__("sys").modules, "pyarrow.parquet", raising=False)
    monkeypatch.delitem(__import__("sys").modules, "pyarrow", raising=False)
    with pytest.raises(FlowrlError, match="needs the optional package 'pyarrow.parquet'") as err:
        read_prompts(str(tmp_path / "p.parquet"), None, "w", PromptsConfig())
    assert "flowrl-diffusion[datasets]" in err.value.hint and err.value.where == "w"


def test_a_large_jsonl_is_indexed_in_bounded_memory(tmp_path):
    # 100k rows with a 300-byte column that is never read: the index is 8 bytes a row, and
    # scanning never holds the file.
    path = tmp_path / "big.jsonl"
    pad = "x" * 300
    with path.open("w", encoding="utf-8") as f:
        for i in range(100_000):
            f.write(json.dumps({"prompt": f"prompt number {i}", "extra": pad}) + "\n")
    size = path.stat().st_size
    tracemalloc.start()
    rows = read_prompts(str(path), None, "w", PromptsConfig())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(rows) == 100_000 and rows[12345] == "prompt number 12345"
    assert rows.offsets.itemsize * len(rows.offsets) == 800_000
    assert peak < 2_000_000 < size / 10, f"peak {peak} bytes while indexing a {size}-byte file"
    # the order of iteration is the text file's: seeded epoch-wise shuffles over the rows
    picked = prompts_for_iteration(rows, 3, 0, 4)
    assert picked == [rows[int(i)] for i in torch.randperm(100_000, generator=_gen(3, 0))[:4]]
    assert len(evaluation_prompts(rows, 0, 5)) == 5


def _gen(seed, epoch):
    from flowrl.seeding import generator

    return generator(seed, "data", epoch)


def test_prompt_rows_are_strings_keyed_by_text_and_condition():
    a, b, plain = PromptRow("a cat", "/x/1.png"), PromptRow("a cat", "/x/2.png"), "a cat"
    assert isinstance(a, str) and a.upper() == "A CAT" and json.dumps([a]) == '["a cat"]'
    assert a != b and a != plain and PromptRow("a cat") == plain and hash(PromptRow("a cat")) == hash(plain)
    assert len({a, b, plain, PromptRow("a cat", "/x/1.png")}) == 3
    back = pickle.loads(pickle.dumps(a))
    assert back == a and back.condition == "/x/1.png" and back.text == "a cat" and type(back.text) is str

    from flowrl.train.session import PromptCache

    class Model:
        calls = []

        def encode_prompts(self, prompts):
            self.calls.append(condition_of(prompts[0]))
            return {"e": torch.tensor([[float(len(condition_of(prompts[0]) or ""))]])}

    cache = PromptCache(Model())
    out = cache.get([a, b, a])
    assert out["e"].flatten().tolist() == [8.0, 8.0, 8.0] and Model.calls == ["/x/1.png", "/x/2.png"]


def test_reward_metadata_carries_the_condition_images(jsonl, tmp_path):
    rows = read_prompts(str(jsonl), None, "w", _config())
    images = torch.zeros(3, 3, 4, 5)
    assert reward_metadata(["a", "b"], images[:2]) is None
    meta = reward_metadata(rows[:2], images[:2])
    assert meta["conditions"] == [str(tmp_path / "img" / "0.png"), str(tmp_path / "img" / "1.png")]
    cond = meta["condition_images"]
    assert cond.shape == (2, 3, 4, 5) and cond.dtype == torch.float32
    # image 1 is the solid colour (40, 100, 200): resizing keeps it
    torch.testing.assert_close(cond[1, :, 0, 0], torch.tensor([40, 100, 200]) / 255.0)
    mixed = reward_metadata(list(rows), images)  # the last row has none: paths only
    assert mixed["conditions"][2] is None and "condition_images" not in mixed
    missing = PromptRow("x", str(tmp_path / "nope.png"))
    with pytest.raises(FlowrlError, match="condition image not found"):
        reward_metadata([missing], images[:1])


def test_the_docs_example_reads_the_shipped_edit_table(monkeypatch):
    """docs/recipes.md's [prompts] example, as written, validates and reads the example table."""
    import re
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")

    from flowrl.recipe import validate

    repo = Path(__file__).resolve().parents[1]
    text = (repo / "docs" / "recipes.md").read_text()
    block = re.search(r"```toml\n(\[prompts\]\n.*?)```", text, re.S).group(1)
    monkeypatch.chdir(repo / "recipes")  # its path is relative to a recipe file in recipes/, as the page says
    recipe = validate({**tomllib.loads(block), "rewards": [{"use": "brightness"}]}, source="docs/recipes.md")
    train = read_prompts(recipe.prompts.source, None, "docs", recipe.prompts)
    evals = read_prompts(recipe.prompts.source, None, "docs", recipe.prompts, role="eval")
    assert len(train) == 3 and len(evals) == 1
    assert all(Path(condition_of(p)).is_file() for p in [*train, *evals])


def test_condition_fidelity_reward_reads_the_metadata():
    from flowrl_plugins.rewards.condition import ConditionFidelity, ConditionFidelityConfig

    reward = ConditionFidelity(ConditionFidelityConfig(size=4))
    cond = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 0.5
    shifted = cond + torch.tensor([0.0, 0.25]).view(2, 1, 1, 1)  # image 1 is 0.25 brighter everywhere
    out = reward(shifted, ["a", "b"], {"condition_images": cond})
    torch.testing.assert_close(out.scores, torch.tensor([1.0, 0.75]))
    with pytest.raises(FlowrlError, match="needs every prompt to carry a condition image"):
        reward(cond, ["a", "b"], None)


# ----------------------------------------------------------------------------- balance_column

#: 1 row of category "a", 2 of "b", 6 of "c" in the train split; 2 "c" and 1 "a" held out.
BALANCE_ROWS = ([{"prompt": "a0", "tag": "a", "split": "train"}]
                + [{"prompt": f"b{i}", "tag": "b", "split": "train"} for i in range(2)]
                + [{"prompt": f"c{i}", "tag": "c", "split": "train"} for i in range(6)]
                + [{"prompt": "ct0", "tag": "c", "split": "test"}, {"prompt": "at0", "tag": "a", "split": "test"},
                   {"prompt": "ct1", "tag": "c", "split": "test"}])


def _balance_sources(tmp_path):
    """The same table as JSONL, CSV, Parquet and a saved dataset (where the extras are present)."""
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in BALANCE_ROWS))
    with open(tmp_path / "t.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["prompt", "tag", "split"])
        w.writeheader()
        w.writerows(BALANCE_ROWS)
    sources = [tmp_path / "t.jsonl", tmp_path / "t.csv"]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(BALANCE_ROWS), tmp_path / "t.parquet", row_group_size=4)
        sources.append(tmp_path / "t.parquet")
    except ImportError:
        pass
    try:
        import datasets

        datasets.Dataset.from_list(BALANCE_ROWS).save_to_disk(str(tmp_path / "saved"))
        sources.append(tmp_path / "saved")
    except ImportError:
        pass
    return sources


def test_balance_column_visits_every_category_equally_often_in_training(tmp_path):
    cfg = PromptsConfig(split_column="split", balance_column="tag")
    for source in _balance_sources(tmp_path):
        view = read_prompts(str(source), None, "w", cfg)
        assert len(view) == 3 * 6, source  # three categories, each as often as the largest
        assert list(map(str, view[:6])) == ["a0", "b0", "c0", "a0", "b1", "c1"], source
        assert sorted(map(str, view.rows)) == sorted(r["prompt"] for r in BALANCE_ROWS if r["split"] == "train")
        # an epoch of training (18 prompts) draws each category exactly 6 times, each "c" row once
        epoch = prompts_for_iteration(view, 3, 0, 18)
        assert [p[0] for p in epoch].count("a") == [p[0] for p in epoch].count("b") == 6, source
        assert sorted(p for p in epoch if p[0] == "c") == [f"c{i}" for i in range(6)], source
        assert prompts_for_iteration(view, 3, 2, 5) == prompts_for_iteration(view, 3, 2, 5)  # (seed, iteration) only


def test_balanced_evaluation_is_round_robin_over_categories_and_seeded(tmp_path):
    cfg = PromptsConfig(split_column="split", balance_column="tag")
    source = _balance_sources(tmp_path)[0]
    pool = read_prompts(str(source), None, "w", cfg, role="eval")
    chosen = evaluation_prompts(pool, 0, 6)
    assert [p[0] for p in chosen] == ["c", "a", "c", "a", "c", "a"]  # categories in order of appearance
    assert sorted(chosen[0::2][:2]) == ["ct0", "ct1"] and chosen[4] == chosen[0]  # each row once, then repeats
    assert evaluation_prompts(pool, 0, 6) == chosen
    assert {tuple(evaluation_prompts(pool, s, 2)) for s in range(8)} == {("ct0", "at0"), ("ct1", "at0")}


def test_balance_column_needs_a_table_with_that_column(tmp_path):
    (tmp_path / "p.txt").write_text("a cat\na dog\n")
    cfg = PromptsConfig(balance_column="tag")
    with pytest.raises(FlowrlError, match="text file, with no column 'tag'"):
        read_prompts(str(tmp_path / "p.txt"), None, "[prompts].source", cfg)
    (tmp_path / "p.csv").write_text("prompt\na cat\n")
    with pytest.raises(FlowrlError, match="no column 'tag'"):
        read_prompts(str(tmp_path / "p.csv"), None, "[prompts].source", cfg)
    with pytest.raises(FlowrlError, match="no columns to balance"):
        read_prompts("model", None, "[prompts].source", cfg)


def test_the_docs_balance_example_reads_the_compose_table_category_by_category(monkeypatch):
    """docs/recipes.md's balance_column example, as written: training visits the six categories
    equally often, the 96 evaluation prompts are 16 of each."""
    import collections
    import re
    import tomllib
    from pathlib import Path

    from flowrl.recipe import validate
    from flowrl_plugins.embedded.compose.grammar import metadata

    repo = Path(__file__).resolve().parents[1]
    text = (repo / "docs" / "recipes.md").read_text()
    block = re.search(r"```toml\n(\[prompts\]\nsource = \"prompts/compose.csv\".*?)```", text, re.S).group(1)
    monkeypatch.chdir(repo / "recipes")  # its path is relative to a recipe file in recipes/, as the page says
    recipe = validate({**tomllib.loads(block), "model": {"use": "embedded_compose"},
                       "rewards": [{"use": "compose_geneval_exact"}]}, source="docs/recipes.md")
    train = read_prompts(recipe.prompts.source, None, "docs", recipe.prompts)
    assert len(train) == 6 * 288
    epoch = collections.Counter(metadata(p)["tag"] for p in prompts_for_iteration(train, 42, 0, len(train)))
    assert set(epoch.values()) == {288}
    pool = read_prompts(recipe.prompts.source, None, "docs", recipe.prompts, role="eval")
    chosen = collections.Counter(metadata(p)["tag"] for p in evaluation_prompts(pool, 42, recipe.prompts.num_eval))
    assert len(chosen) == 6 and set(chosen.values()) == {16}


def test_a_balanced_evaluation_may_ask_for_more_prompts_than_the_table_holds(monkeypatch):
    """Round-robin over the categories repeats the rows of small ones, so num_eval is not capped by
    the pool as it is without balance_column (where it is refused)."""
    from pathlib import Path

    from flowrl.errors import FlowrlError
    from flowrl.recipe import check_startable, load_recipe

    repo = Path(__file__).resolve().parents[1]
    sets = ["prompts.num_eval=600"]
    check_startable(load_recipe(repo / "recipes" / "compose_nft.toml", sets), devices=False)
    unbalanced = load_recipe(repo / "recipes" / "compose_nft.toml", [*sets, 'prompts.balance_column=""'])
    with pytest.raises(FlowrlError, match="num_eval = 600"):
        check_startable(unbalanced, devices=False)


def test_a_datasets_folder_passes_validation_and_is_checked_as_training_reads_it(tmp_path, monkeypatch, validate):
    """`flowrl validate` (and so `flowrl train`) refused every Hugging Face dataset as "prompt file
    not found"; a datasets folder is now read as training reads it (its splits, the evaluation's
    prompt count), and hf:NAME is left to training (loading it may download)."""
    datasets = pytest.importorskip("datasets")
    from tiny_recipe import tiny_recipe, write_recipe

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    saved = tmp_path / "saved"
    grammar = [f"a red {shape} on a green background" for shape in ("circle", "square", "triangle")]  # area scores these
    datasets.DatasetDict(train=datasets.Dataset.from_list([{"prompt": p} for p in grammar[:2]]),
                         test=datasets.Dataset.from_list([{"prompt": grammar[2]}])).save_to_disk(str(saved))
    recipe = write_recipe(tmp_path, tiny_recipe())
    assert validate(recipe, f'prompts.source="{saved}"', "prompts.num_eval=1") == (0, "")
    code, err = validate(recipe, f'prompts.source="{saved}"', "prompts.num_eval=5")
    assert code == 2 and "num_eval = 5, and the evaluation reads 1 prompts" in " ".join(err.split())
    assert validate(recipe, 'prompts.source="hf:someone/prompts"')[0] == 0
    code, err = validate(recipe, f'prompts.source="{tmp_path / "empty"}"', "prompts.num_eval=1")
    assert code == 2 and "prompt file not found" in err
    (tmp_path / "empty").mkdir()
    code, err = validate(recipe, f'prompts.source="{tmp_path / "empty"}"', "prompts.num_eval=1")
    assert code == 2 and "doesn't contain any data files" in err and "Traceback" not in err
