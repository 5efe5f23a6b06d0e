"""Plausible mistakes with the newer recipe keys: branch rollouts, pipelining, replay,
prompt tables and splits, offline data, windows, EMA, gradient sync, reward weights, profiles.

Each case is a shipped recipe with ``--set`` overrides, run through ``flowrl validate`` (and, for a
few, ``flowrl train`` for one or two tiny iterations). The outcome is one of: refused with ONE
message naming the key (``where``) and saying what is wrong; accepted (``OK``: the combination is
legitimate, e.g. a documented off switch); or trained (``TRAINS``). Never a traceback, never a
silent no-op that trains on something else than asked.

Cases marked "was:" below were defects before: a traceback in training, a refusal only after the
model had loaded, or a setting that was silently ignored or clipped.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
QUICK = "quickstart.toml"  # EPG on the ELBO, ODE window, prompts from shapes.csv (train / test split)
NFT = "quickstart_nft.toml"  # DiffusionNFT: an objective that owns its update
STEP = "quickstart_step.toml"  # step-level GRPO (clipped), 17 steps, T = 16
HACK = "quickstart_hacking.toml"  # chunks [2, 3, 4, 7]
DYN = "quickstart_dynamics.toml"  # dynamics chunker and weighted selector from profiles/embedded.json
SFT = "offline_sft.toml"  # offline SFT ([data] path is set per case)
DPO = "offline_dpo.toml"
OK, TRAINS = "OK", "TRAINS"
PROFILES = RECIPES / "profiles"
BRANCH = ["window.use=branch", "window.steps=[2]", "window.factors=[2]"]
TREE = [*BRANCH, "advantage.use=tree"]
OLD_BRANCH = ["sampler.branch_steps=[2]", "sampler.branch_factors=[2]"]  # before BranchGRPO was components

#: (id, recipe, overrides, where the message points, what it says) -- where/what are OK or TRAINS
#: for a combination that is legitimate. "{data}" is the folder of the tables made below.
CASES = [
    # --- branch rollouts ([window] use = "branch", [advantage] use = "tree"; the old [sampler].branch_*)
    ("branch lists of different lengths", STEP, ["window.use=branch", "window.steps=[2,5]", "window.factors=[2]"],
     "[window]", "need one entry each per split, got 2 steps and 1 factors"),
    ("branch factors do not divide the group", STEP, ["train.group_size=6", "window.use=branch", "window.steps=[2]",
                                                      "window.factors=[4]"],
     "[window]", "the product of factors (4) must divide group_size (6)"),
    ("branch step beyond the steps", STEP, ["window.use=branch", "window.steps=[20]", "window.factors=[2]"],
     "[window]", "strictly increasing step indices in [0, 17), got [20]"),
    ("branch factor 0", STEP, ["window.use=branch", "window.steps=[2]", "window.factors=[0]"],
     "[window]", "key 'factors' must be >= 1, got 0"),
    ("branch window that never splits", STEP, ["window.use=branch"], "[window]",
     "[window] 'branch' samples trees and this one never splits"),
    # was: refused at the first rollout, after the model had loaded (a tree has no window of its own)
    ("branch with the ODE window", QUICK, OLD_BRANCH, "[sampler].branch_steps",
     "is now [window] use = 'branch' (steps), and this recipe's [window] is 'ode', which plans its own windows"),
    ("branch with a random window", STEP, ["window.use=random", *OLD_BRANCH], "[sampler].branch_steps",
     "this recipe's [window] is 'random', which plans its own windows"),
    # was: trained, the copies of each split one image (no noise after the split)
    ("branch after the SDE window", STEP, ["sampler.sde_window=[0,4]", "window.use=branch", "window.steps=[10]",
                                           "window.factors=[2]"],
     "[window].steps", "branch step 10 splits where no noise is drawn any more"),
    ("branch at the last step of an x0_hat image", STEP, ["window.use=branch", "window.steps=[16]", "window.factors=[2]"],
     "[window].steps", "last stochastic step that reaches the image is step 15"),
    ("tree advantage with chunks", HACK, TREE, "[advantage]", "it needs step units"),
    ("tree advantage without trees", STEP, ["advantage.use=tree"], "[advantage]",
     ("advantage 'tree' gives each transition of a tree rollout its own advantage, and [window] 'fixed' samples no "
      "trees")),
    ("width pruning without the tree advantage", STEP, [*BRANCH, "advantage.keep=1"], "[advantage]",
     "unknown key 'keep'"),
    ("old branch_keep without the tree", STEP, [*OLD_BRANCH, "sampler.branch_keep=1"], "[sampler].branch_keep",
     "[sampler].branch_keep prunes a tree advantage; it is now [advantage].keep of [advantage] use = 'tree'"),
    ("old branch keys, read as the new ones", STEP, [*OLD_BRANCH, "sampler.branch_advantage=tree",
                                                     "sampler.branch_keep=1"], OK, OK),
    # was: silently pruned nothing
    ("width pruning beyond the group", STEP, [*TREE, "advantage.keep=100"], "[advantage]",
     "keep = 100 keeps every leaf of a group of 8"),
    # was: a traceback in training (min() of an empty tensor)
    ("depth pruning of every step", STEP, [*TREE, f"advantage.prune_steps={list(range(17))}"],
     "[advantage]", "prunes every trainable transition"),
    # was: the slide silently never moved
    ("depth pruning that cannot slide", STEP, ["window.use=branch", "window.steps=[8]", "window.factors=[2]",
                                               "advantage.use=tree", "advantage.prune_steps=[2,3]",
                                               "advantage.prune_slide=1"],
     "[advantage]", "so it would never move"),
    ("branch with a sub-batch of half a group", STEP, ["sampler.batch_size=4", *BRANCH], "[sampler].batch_size",
     "must be 0 or a multiple of group_size (8)"),
    ("branch profile of another step count", STEP, ["sampler.steps=9", "window.use=branch",
                                                    f"window.profile={PROFILES / 'embedded.json'}", "window.count=2"],
     "[window].profile", "describes T = 16 trainable transitions (steps = 17"),
    ("branch count too many for the group", STEP, ["train.group_size=4", "window.use=branch",
                                                   f"window.profile={PROFILES / 'embedded.json'}", "window.count=3"],
     "[window]", "the product of factors (8) must divide group_size (4)"),
    ("branch count without a profile", STEP, ["window.use=branch", "window.count=2"], "[window]",
     "profile and count go together"),
    ("branch with pipelining", STEP, [*BRANCH, "pipeline.staleness=1"], OK, OK),
    # --- pipelining ([pipeline])
    ("pipelining an objective with its own update", NFT, ["pipeline.staleness=1"], "[pipeline].staleness",
     "needs a ratio-based policy loss; loss 'nft' owns its update"),
    ("pipelining a loss on the ELBO", QUICK, ["pipeline.staleness=1"], "[pipeline].staleness",
     "needs a ratio-based policy loss; loss 'epg' runs on [likelihood] 'elbo'"),
    ("pipeline staleness 2", STEP, ["pipeline.staleness=2"], "[pipeline]", "key 'staleness' must be <= 1, got 2"),
    ("pipeline device with the thread worker", STEP, ["pipeline.device=cpu"], "[pipeline]",
     "device is the rollout process's: set worker = 'process' too"),
    ("pipeline on a GPU the machine lacks", STEP, ["pipeline.staleness=1", "pipeline.worker=process",
                                                   "pipeline.device=cuda:63"],
     "[pipeline].device", "device = 'cuda:63'"),
    ("pipelining with replay", STEP, ["pipeline.staleness=1", "replay.size=2"], "[pipeline].staleness",
     "cannot be combined yet"),
    ("pipelining GRPO-Guard", STEP, ["pipeline.staleness=1", "loss.use=guard"], "[pipeline].staleness",
     "its step ratio uses the rollout's proposal means"),
    ("pipeline settings with staleness 0 (the documented off switch)", STEP, ["pipeline.sync_every=4",
                                                                             "pipeline.worker=process"], OK, OK),
    # --- replay ([replay])
    ("replay with an objective with its own update", NFT, ["replay.size=2"], "[replay].size",
     "[replay] needs a ratio-based policy loss; loss 'nft'"),
    ("replay weight_steps at the unit level", STEP, ["replay.size=2", "replay.weight_steps=4"], "[replay]",
     "applies to weight_level = 'sequence' only"),
    ("replay weight_steps beyond T", STEP, ["replay.size=2", "replay.weight_level=sequence", "replay.weight_steps=40"],
     "[replay].weight_steps", "exceeds the sampler's T = 16"),
    ("replay of an offline run", SFT, ["data.path={data}/sft.jsonl", "train.prompts_per_iteration=2", "replay.size=2"],
     "[replay].size", "loss 'sft' owns its update"),
    ("replay with max_staleness 0 (the documented off switch)", STEP, ["replay.size=4", "replay.max_staleness=0"],
     OK, OK),
    # --- prompt tables and splits ([prompts])
    ("split column that is not there", QUICK, ["prompts.split_column=splt"], "[prompts].source", "has no column 'splt'"),
    ("evaluation split with no rows", QUICK, ["prompts.eval_split=val"], "[prompts].source",
     "with split = 'val'"),
    ("training split with no rows", QUICK, ["prompts.train_split=training"], "[prompts].source",
     "with split = 'training'"),
    ("text column that is not there", QUICK, ["prompts.text_column=caption"], "[prompts].source",
     "has no column 'caption'"),
    ("balance column that is not there", QUICK, ["prompts.balance_column=tag"], "[prompts].source",
     "has no column 'tag'"),
    ("condition column that is not there", QUICK, ["prompts.condition_column=image"], "[prompts].source",
     "has no column 'image'"),
    # was: the column silently ignored (the evaluation read the training prompts)
    ("split column on a text file", QUICK, ["prompts.source={data}/prompts.txt"], "[prompts].split_column",
     "the text file"),
    ("split column on the model's prompts", QUICK, ["prompts.source=model"], "[prompts].split_column",
     "the model's own prompts, with no columns"),
    # was: "row 0 of shapes.csv has no prompt text in column ''"
    ("empty text column", QUICK, ["prompts.text_column=''"], "[prompts]", "text_column is empty"),
    ("text column on a text file", STEP, ["prompts.source={data}/prompts.txt", "prompts.text_column=caption"],
     "[prompts].text_column", "names a column of a prompt table"),
    # was: silently evaluated 18
    ("more evaluation prompts than the split holds", QUICK, ["prompts.num_eval=100"], "[prompts].num_eval",
     "num_eval = 100, and the evaluation reads 18 prompts"),
    ("evaluation file that does not exist", QUICK, ["prompts.eval_source={data}/nope.csv"], "[prompts].eval_source",
     "prompt file not found"),
    ("evaluation table without the split column", QUICK, ["prompts.eval_source={data}/no_split.csv"],
     "[prompts].eval_source", "has no column 'split'"),
    ("table row without prompt text", QUICK, ["prompts.source={data}/empty_row.csv"], "[prompts].source",
     "has no prompt text in column 'prompt'"),
    ("evaluating on the training split", QUICK, ["prompts.eval_split=train"], OK, OK),
    # --- offline data ([data])
    ("offline table that does not exist", SFT, ["data.path={data}/nope.jsonl"], "[data].path",
     "offline data not found"),
    ("offline table without an image column", SFT, ["data.path={data}/no_image.jsonl"], "[data].path",
     "are neither an image table nor a preference table"),
    ("offline table naming missing images", SFT, ["data.path={data}/missing_images.jsonl"], "[data].path",
     "image image not found"),
    ("offline row without a prompt", SFT, ["data.path={data}/empty_prompt.jsonl", "train.prompts_per_iteration=2"],
     "[data].path", "row 2 has an empty or missing prompt"),
    ("preference pairs for SFT", SFT, ["data.path={data}/pairs.jsonl", "train.prompts_per_iteration=2"], "[data].path",
     "is a table of pairs, but loss 'sft' trains on a table of images"),
    ("kind that is not the loss's", SFT, ["data.path={data}/sft.jsonl", "data.kind=pairs"], "[data].kind",
     "kind = 'pairs', but loss 'sft'"),
    ("fewer rows than an iteration", SFT, ["data.path={data}/sft.jsonl"], "[train].prompts_per_iteration",
     "holds 4 rows, fewer than an iteration trains"),
    ("group size for an offline run", SFT, ["data.path={data}/sft.jsonl", "train.prompts_per_iteration=2",
                                            "train.group_size=4"],
     "[train].group_size", "group_size does not apply to an offline run"),
    ("offline table with an online loss", STEP, ["data.path={data}/sft.jsonl"], "[loss]",
     "loss 'clipped' trains on rollouts"),
    ("offline table as a text file", SFT, ["data.path={data}/prompts.txt", "train.prompts_per_iteration=2"],
     "[data].path", "offline data must be .jsonl, .csv, .tsv or .parquet"),
    ("offline DPO without a table", DPO, ["data.path=''"], "[data].path",
     "trains on an offline table of pairs, and the recipe names none"),
    ("offline run with every reward at weight 0", SFT, ["data.path={data}/sft.jsonl", "train.prompts_per_iteration=2",
                                                        "rewards.0.weight=0"], OK, OK),
    # --- windows ([window], [sampler].sde_window)
    # was: silently clipped to the trainable steps
    ("random window ending beyond the steps", STEP, ["window.use=random", "window.hi=40"], "[window]",
     "hi = 40 is beyond the trainable steps"),
    # was: "only the first -2 steps can be trained"
    ("random window with lo above hi", STEP, ["window.use=random", "window.lo=10", "window.hi=8"], "[window]",
     "lo = 10 must be below hi = 8"),
    ("random window larger than the steps", STEP, ["window.use=random", "window.size=30"], "[window]",
     "a window of 30 steps does not fit in [lo, hi) = [0, 16), which holds 16"),
    ("sliding window larger than the steps", STEP, ["window.use=sliding", "window.size=20"], "[window]",
     "a window of 20 steps does not fit in the trainable steps"),
    # was: a traceback at the first rollout
    ("compression without a time warp", STEP, ["window.use=sliding", "window.size=2", "window.compress=0.4",
                                               "schedule.use=flux_dynamic"],
     "[window]", "window compress < 1 needs a schedule with a time warp"),
    ("ODE window with a log-prob loss", STEP, ["window.use=ode"], "[sampler]",
     "the sampler leaves no trainable transition"),
    ("SDE window beyond the steps", STEP, ["sampler.sde_window=[10,30]"], "[sampler]",
     "sde_window must be [start, end) with 0 <= start < end <= steps (17)"),
    ("random window inside an SDE window", STEP, ["window.use=random", "sampler.sde_window=[0,4]"], OK, OK),
    # --- EMA ([ema])
    ("EMA decay above 1", STEP, ["ema.enabled=true", "ema.decay=1.5"], "[ema]", "key 'decay' must be <= 1.0"),
    ("EMA decay NaN", STEP, ["ema.enabled=true", "ema.decay=nan"], "[ema]", "key 'decay' must be a finite number"),
    ("EMA on the CPU with FSDP2", STEP, ["ema.enabled=true", "ema.on_cpu=true", "distributed.strategy=fsdp2"],
     "[ema].on_cpu", "not supported with strategy = 'fsdp2'"),
    ("EMA decay 1 (keeps the starting weights: the EMA tests' own device)", STEP,
     ["ema.enabled=true", "ema.decay=1.0"], OK, OK),
    ("EMA settings with enabled = false (the documented off switch)", STEP, ["ema.evaluate=true", "ema.on_cpu=true"],
     OK, OK),
    # --- gradient sync ([distributed])
    ("gradient sync without FSDP2", STEP, ["distributed.gradient_sync=micro_batch"], "[distributed]",
     "gradient_sync = 'micro_batch' needs strategy = 'fsdp2'"),
    ("gradient sync of a misspelt mode", STEP, ["distributed.strategy=fsdp2", "distributed.gradient_sync=every_step"],
     "[distributed]", "key 'gradient_sync' must be 'auto' | 'step' | 'micro_batch', got 'every_step'"),
    ("8-bit AdamW with FSDP2", STEP, ["distributed.strategy=fsdp2", "train.optimizer=adamw_8bit"],
     "[train].optimizer", "cannot hold sharded (DTensor) parameters"),
    # --- reward weights ([[rewards]])
    # was: trained on all-zero advantages
    ("every reward at weight 0", STEP, ["rewards.0.weight=0"], "[[rewards]]",
     "every [[rewards]] entry has weight 0 (area, verifier)"),
    ("every reward at weight 0, the quickstart", QUICK, ["rewards.0.weight=0"], "[[rewards]]",
     "every [[rewards]] entry has weight 0"),
    ("every chunk weight 0", HACK, ["rewards.0.chunk_weights=[0,0,0,0]"], "[[rewards]]",
     "every [[rewards]] entry has weight 0"),
    ("reward weight NaN", STEP, ["rewards.0.weight=nan"], "[[rewards]] #1 (reward 'area')",
     "key 'weight' must be a finite number, got nan"),
    ("reward weight as a word", STEP, ['rewards.0.weight="high"'], "[[rewards]] #1 (reward 'area')",
     "key 'weight' must be float, got 'high'"),
    ("chunk weights for fewer chunks", HACK, ["rewards.0.chunk_weights=[1,1]"], "[[rewards]] #1 (area).chunk_weights",
     "chunk_weights has 2 entries but the chunker makes 4 chunks"),
    ("a negative reward weight (a penalty)", STEP, ["rewards.0.weight=-1.0", "rewards.1.weight=1.0"], OK, OK),
    # --- profiles (chunker, selector, branch profile)
    ("chunker profile of another step count", DYN, ["sampler.steps=9"], "[chunker].profile",
     "describes T = 16 trainable transitions (steps = 17, image_from = x0_hat), but this run has T = 8"),
    # was: accepted (the same T, other steps: the chunks of another sampler)
    ("chunker profile of another sampler with the same T", DYN,
     [f"chunker.profile={PROFILES / 'embedded_window16.json'}", f"selector.profile={PROFILES / 'embedded_window16.json'}"],
     "[chunker].profile", "profiles a sampler of 33 steps with T = 16"),
    # was: accepted by validate, refused at the first update
    ("selector profile of another step count", STEP, ["selector.use=weighted", "sampler.steps=9",
                                                      f"selector.profile={PROFILES / 'embedded.json'}"],
     "[selector].profile", "profiles a sampler of 17 steps with T = 16"),
    ("profile that does not exist", DYN, ["chunker.profile={data}/nope.json"], "[chunker].profile",
     "profile file not found"),
    ("profile that is another JSON file", DYN, ["chunker.profile={data}/not_a_profile.json"], "[chunker].profile",
     "is not a flowrl profile"),
    ("profile that is the plot", DYN, [f"chunker.profile={PROFILES / 'embedded_window16.png'}"], "[chunker].profile",
     "is not a JSON file"),
    ("profile of the other image_from", DYN, ["sampler.image_from=final"], "[chunker].profile", "this run has T = 17"),
    ("branch count beyond the transitions", STEP, ["window.use=branch", f"window.profile={PROFILES / 'embedded.json'}",
                                                   "window.count=20"],
     "[window].count", "count = 20 exceeds the sampler's 16 trainable transitions"),
]

#: Cases that train: (id, recipe, overrides), one or two tiny iterations each.
TINY = ["train.iterations=1", "train.prompts_per_iteration=2", "train.group_size=2", "train.micro_batch_size=2",
        "sampler.steps=6", "prompts.num_eval=0", "log.progress=false", "log.image_every=0"]
TRAINING = [
    ("branch with pipelining", STEP, [*TINY, "train.iterations=2", "train.group_size=4", *BRANCH,
                                      "pipeline.staleness=1"]),
    ("more replays per iteration than kept", STEP, [*TINY, "train.iterations=2", "replay.size=1",
                                                    "replay.per_iteration=3"]),
    ("FSDP2 with gradient sync per micro-batch, one CPU process", STEP,
     [*TINY, "distributed.strategy=fsdp2", "distributed.gradient_sync=micro_batch"]),
    ("offline SFT from a CSV table", SFT, ["train.iterations=1", "train.prompts_per_iteration=2",
                                          "train.micro_batch_size=2", "prompts.num_eval=0", "log.progress=false",
                                          "log.image_every=0", "data.path={data}/sft.csv"]),
]

#: The defects this file was written for: `flowrl train` refuses them too, before writing anything.
WERE_DEFECTS = ["branch with the ODE window", "depth pruning of every step", "compression without a time warp",
                "selector profile of another step count", "every reward at weight 0", "split column on a text file"]

PROMPTS = ["a red circle on a green background", "a blue square on a yellow background",
           "a green triangle on a white background", "a white circle on a black background"]


def _png(path: Path, rgb: tuple[int, int, int]) -> None:
    """A 32 x 32 RGB PNG of one colour (the embedded model's image size)."""
    raw = b"".join(b"\x00" + bytes(rgb) * 32 for _ in range(32))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 32, 32, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The tables and files the cases name: four images, offline tables (good and broken), prompt
    files, and a JSON file that is not a profile."""
    d = tmp_path_factory.mktemp("data")
    for i in range(4):
        _png(d / f"img{i}.png", (60 * i, 100, 30))
    _jsonl(d / "sft.jsonl", [{"prompt": p, "image": f"img{i}.png"} for i, p in enumerate(PROMPTS)])
    _jsonl(d / "no_image.jsonl", [{"prompt": p, "picture": f"img{i}.png"} for i, p in enumerate(PROMPTS)])
    _jsonl(d / "missing_images.jsonl", [{"prompt": p, "image": f"nope{i}.png"} for i, p in enumerate(PROMPTS)])
    _jsonl(d / "empty_prompt.jsonl", [{"prompt": "" if i == 1 else p, "image": f"img{i}.png"}
                                      for i, p in enumerate(PROMPTS)])
    _jsonl(d / "pairs.jsonl", [{"prompt": p, "chosen": f"img{i}.png", "rejected": f"img{(i + 1) % 4}.png"}
                               for i, p in enumerate(PROMPTS)])
    (d / "sft.csv").write_text("prompt,image\n" + "".join(f"{p},img{i}.png\n" for i, p in enumerate(PROMPTS)))
    (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    (d / "no_split.csv").write_text("prompt\n" + "".join(f"{p}\n" for p in PROMPTS))
    (d / "empty_row.csv").write_text("prompt,split\n" + "".join(f"{'' if i == 1 else p},train\n"
                                                                for i, p in enumerate(PROMPTS)) + f"{PROMPTS[0]},test\n")
    (d / "not_a_profile.json").write_text(json.dumps({"hello": 1}))
    return d


def _argv(command: str, recipe: str, overrides: list[str], data: Path) -> list[str]:
    argv = [command, str(RECIPES / recipe)]
    for o in overrides:
        argv += ["--set", o.replace("{data}", str(data))]
    return argv


def _one_message(result) -> str:
    """stderr holds exactly one error message and no traceback; returns it, unwrapped."""
    err = result.stderr
    assert "Traceback" not in err and "Traceback" not in result.stdout, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("warning:", "Loading"))]
    assert lines and lines[0].startswith("error:") and err.count("error:") == 1, err
    return result.flat_err


def test_the_set_is_large_and_covers_every_newer_key_family():
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)
    text = " ".join(" ".join(c[2]) for c in CASES)
    for family in ("branch_", "window.steps", "advantage.prune_steps", "pipeline.", "replay.", "prompts.split_column", "prompts.eval_split", "data.path",
                   "window.", "ema.", "gradient_sync", "rewards.0.weight", "profile"):
        assert family in text, family


@pytest.mark.parametrize("name, recipe, overrides, where, message", CASES, ids=[c[0] for c in CASES])
def test_validate_refuses_with_one_message_or_accepts(name, recipe, overrides, where, message, data, flowrl_cli):
    (result,) = flowrl_cli.in_process([_argv("validate", recipe, overrides, data)])
    if where == OK:
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        assert "error:" not in result.stderr, result.stderr
        return
    flat = _one_message(result)
    assert result.returncode == 2, flat
    assert f"{recipe}: {where}" in flat, (where, flat)  # names the recipe file and the key
    assert message in flat, (message, flat)


@pytest.mark.parametrize("name, recipe, overrides", TRAINING, ids=[c[0] for c in TRAINING])
def test_legitimate_combinations_train(name, recipe, overrides, data, tmp_path, flowrl_cli):
    out = tmp_path / "run"
    (result,) = flowrl_cli.in_process([[*_argv("train", recipe, overrides, data), "-o", str(out)]])
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "error:" not in result.stderr, result.stderr
    assert "done:" in result.flat_out and (out / "metrics.jsonl").is_file()


def test_train_refuses_the_former_defects_before_writing_anything(data, tmp_path, flowrl_cli):
    cases = {c[0]: c for c in CASES}
    calls = [[*_argv("train", cases[n][1], cases[n][2], data), "-o", str(tmp_path / str(i))]
             for i, n in enumerate(WERE_DEFECTS)]
    for i, (name, result) in enumerate(zip(WERE_DEFECTS, flowrl_cli.in_process(calls))):
        flat = _one_message(result)
        assert result.returncode == 2 and cases[name][4] in flat, (name, flat)
        assert "Loading weights" not in result.stderr, name  # refused before the model loads
        assert not (tmp_path / str(i)).exists(), name
