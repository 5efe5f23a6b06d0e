"""GenEval's rules (flowrl.geneval) on hand-built detections; every expected value is worked out
by hand in the comment next to it."""

from __future__ import annotations

import math

import pytest

from flowrl import geneval
from flowrl.geneval import Detection, PromptScore, flow_grpo_score, load_metadata, relative_position, score_prompt
from flowrl.geneval import select_objects, summarise


def at(label, x, y, *, w=10.0, h=10.0, score=0.95, colour=None):
    """A detection whose box is w x h, centred on (x, y)."""
    return Detection(label, (x - w / 2, y - h / 2, x + w / 2, y + h / 2), score, colour)


def meta(tag, *include, exclude=None):
    m = {"tag": tag, "include": list(include), "prompt": "p"}
    if exclude is not None:
        m["exclude"] = exclude
    return m


ONE_CAR = meta("single_object", {"class": "car", "count": 1})
TWO_CLOCKS = meta("counting", {"class": "clock", "count": 2}, exclude=[{"class": "clock", "count": 3}])
RED_CAR = meta("colors", {"class": "car", "count": 1, "color": "red"})
DOG_RIGHT_OF_BEAR = meta("position", {"class": "teddy bear", "count": 1},
                         {"class": "dog", "count": 1, "position": ["right of", 0]})


# ----------------------------------------------------------------------------- constants


def test_constants_are_genevals():
    assert (geneval.THRESHOLD, geneval.COUNTING_THRESHOLD, geneval.MAX_OBJECTS) == (0.3, 0.9, 16)
    assert (geneval.NMS_THRESHOLD, geneval.POSITION_THRESHOLD) == (1.0, 0.1)
    assert geneval.TAGS == ("single_object", "two_object", "counting", "colors", "position", "color_attr")
    assert geneval.RELATIONS == ("left of", "right of", "above", "below")


# ----------------------------------------------------------------------------- selection


def test_threshold_keeps_scores_strictly_above_0_3():
    dets = [at("car", 10, 10, score=0.3), at("car", 30, 10, score=0.31)]
    assert [d.score for d in select_objects(dets, "colors")["car"]] == [0.31]


def test_counting_threshold_is_0_9_and_applies_only_to_counting():
    dets = [at("car", 10, 10, score=0.5), at("car", 30, 10, score=0.9), at("car", 50, 10, score=0.91)]
    assert [d.score for d in select_objects(dets, "colors")["car"]] == [0.91, 0.9, 0.5]
    assert [d.score for d in select_objects(dets, "counting")["car"]] == [0.91]


def test_half_confident_object_counts_for_a_colour_prompt_but_not_for_counting():
    red = at("car", 10, 10, score=0.5, colour="red")
    assert score_prompt([red], RED_CAR) == PromptScore(True, 1.0, 1.0, ())
    # counting: only the 0.95 clock is kept, 1 of 2 -> fails; Flow-GRPO term 1 - |2 - 1|/2 = 0.5
    result = score_prompt([at("clock", 10, 10), at("clock", 30, 10, score=0.5)], TWO_CLOCKS)
    assert not result.strict and result.soft == 0.5
    assert result.reasons == ("expected at least 2 'clock', found 1",)


def test_classes_with_nothing_kept_are_absent():
    assert select_objects([at("car", 10, 10, score=0.1)], "single_object") == {}


def test_objects_are_sorted_by_score_descending_and_ties_keep_input_order():
    a, b, c, d = (at("car", 10 * i, 10, score=s) for i, s in enumerate([0.4, 0.8, 0.6, 0.8]))
    assert select_objects([a, b, c, d], "two_object")["car"] == [b, d, c, a]


def test_at_most_16_objects_per_class_the_most_confident():
    dets = [at("car", 20 * i, 10, score=0.35 + 0.03 * i) for i in range(20)]
    kept = select_objects(dets, "single_object")["car"]
    assert kept == sorted(dets, key=lambda d: -d.score)[:16]
    # so 20 detected cars never reach an exclude of 17
    assert score_prompt(dets, meta("single_object", {"class": "car", "count": 1},
                                   exclude=[{"class": "car", "count": 17}])).strict
    assert not score_prompt(dets, meta("single_object", {"class": "car", "count": 1},
                                       exclude=[{"class": "car", "count": 16}])).strict


def test_nms_threshold_1_suppresses_nothing_even_identical_boxes():
    dets = [Detection("car", (0, 0, 9, 9), 0.9), Detection("car", (0, 0, 9, 9), 0.8)]
    assert len(select_objects(dets, "single_object")["car"]) == 2


def test_nms_below_1_drops_boxes_overlapping_the_best_at_or_above_the_threshold():
    best = Detection("car", (0, 0, 9, 9), 0.9)
    same = Detection("car", (0, 0, 9, 9), 0.8)  # IoU 1
    half = Detection("car", (5, 0, 14, 9), 0.7)  # inclusive pixels: 5*10 / (100 + 100 - 50) = 1/3
    assert select_objects([best, same, half], "single_object", nms_threshold=0.5)["car"] == [best, half]
    assert select_objects([best, same, half], "single_object", nms_threshold=1 / 3)["car"] == [best]


# ----------------------------------------------------------------------------- position

B = at("b", 50, 50)  # the reference: centre (50, 50), 10 x 10; margin with another 10 x 10 box = 0.1 * 20 = 2


@pytest.mark.parametrize("x, y, relation", [
    (20, 50, "left of"),    # offset (-30, 0) -> revised (-28, 0) / 30 = -0.93
    (80, 50, "right of"),
    (50, 20, "above"),      # y grows downwards: smaller y is above
    (50, 80, "below"),
])
def test_each_relation_holds_and_its_opposites_do_not(x, y, relation):
    assert relative_position(at("a", x, y), B) == {relation}


def test_relations_are_of_a_relative_to_b():
    assert relative_position(B, at("a", 20, 50)) == {"right of"}


def test_offset_within_the_margin_gives_no_relation():
    assert relative_position(at("a", 51.9, 50), B) == set()  # 1.9 < 0.1 * (10 + 10)
    assert relative_position(at("a", 50, 50), B) == set()     # same centre


def test_margin_uses_the_sum_of_both_boxes_sizes_on_each_axis():
    # a is 30 wide: x margin 0.1 * (30 + 10) = 4; offset 5 -> revised 1, 1/5 = 0.2 -> nothing
    assert relative_position(at("a", 55, 50, w=30), B) == set()
    # the same offset with a 10-wide box: revised 3, 3/5 = 0.6 -> right of
    assert relative_position(at("a", 55, 50), B) == {"right of"}


def test_revised_offset_must_exceed_half_the_offset():
    assert relative_position(at("a", 53, 50), B) == set()  # (3 - 2)/3 = 0.33
    assert relative_position(at("a", 54, 50), B) == set()  # (4 - 2)/4 = 0.5, not > 0.5


def test_diagonal_offset_gives_two_relations_a_shallow_one_gives_one():
    # (-30, -30) -> (-28, -28) / 42.43 = -0.66 on both axes
    assert relative_position(at("a", 20, 20), B) == {"left of", "above"}
    # (-30, -10) -> (-28, -8) / 31.62 = (-0.89, -0.25)
    assert relative_position(at("a", 20, 40), B) == {"left of"}


def test_position_prompt_passes_when_the_relation_holds():
    dets = [at("teddy bear", 20, 50), at("dog", 80, 50)]
    assert score_prompt(dets, DOG_RIGHT_OF_BEAR) == PromptScore(True, 1.0, 1.0, ())


def test_wrong_position_fails_and_scores_flow_grpos_extra_term():
    dets = [at("teddy bear", 80, 50), at("dog", 20, 50)]
    result = score_prompt(dets, DOG_RIGHT_OF_BEAR)
    assert not result.strict
    assert result.reasons == ("'dog' should be right of 'teddy bear', but is left of it",)
    # terms: bear count 1, dog count 1, position 0.0 and Flow-GRPO's trailing 1.0 -> 3/4
    assert result.soft == 0.75 == flow_grpo_score(dets, DOG_RIGHT_OF_BEAR)


def test_no_clear_relation_fails_a_position():
    result = score_prompt([at("teddy bear", 50, 50), at("dog", 51, 50)], DOG_RIGHT_OF_BEAR)
    assert result.reasons == ("'dog' should be right of 'teddy bear', but is in no clear relation to it",)


def test_every_object_must_stand_in_the_relation_to_every_target():
    two_dogs = meta("position", {"class": "teddy bear", "count": 1},
                    {"class": "dog", "count": 2, "position": ["right of", 0]})
    assert score_prompt([at("teddy bear", 20, 50), at("dog", 80, 50), at("dog", 80, 90)], two_dogs).strict
    assert not score_prompt([at("teddy bear", 20, 50), at("dog", 80, 50), at("dog", 5, 50)], two_dogs).strict


def test_position_referring_to_a_failed_group_fails():
    result = score_prompt([at("dog", 80, 50)], DOG_RIGHT_OF_BEAR)
    assert result.reasons == ("expected at least 1 'teddy bear', found 0",
                              "'dog' should be right of include 0, which failed")
    # terms: bear count 1 - 1/1 = 0, dog count 1, position (no target) 0 -> 1/3
    assert result.soft == pytest.approx(1 / 3)


def test_position_is_not_checked_after_a_failed_colour():
    red_dog = meta("position", {"class": "teddy bear", "count": 1},
                   {"class": "dog", "count": 1, "color": "red", "position": ["right of", 0]})
    result = score_prompt([at("teddy bear", 20, 50), at("dog", 80, 50, colour="blue")], red_dog)
    assert len(result.reasons) == 1 and "red" in result.reasons[0]
    # terms: bear 1, dog count 1, colour 0, no position term -> 2/3
    assert result.soft == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------- counts, colours, excludes


def test_exact_count_passes_too_few_fails_count_plus_one_hits_the_exclude():
    clocks = [at("clock", 20 * i, 10) for i in range(4)]
    assert score_prompt(clocks[:2], TWO_CLOCKS) == PromptScore(True, 1.0, 1.0, ())
    few = score_prompt(clocks[:1], TWO_CLOCKS)
    assert few.reasons == ("expected at least 2 'clock', found 1",) and few.soft == 0.5
    many = score_prompt(clocks[:3], TWO_CLOCKS)
    # the exclude (count 3) fails; it is implied by the exact-count include, so no extra term: 1 - 1/2
    assert many.reasons == ("expected fewer than 3 'clock', found 3",) and many.soft == 0.5
    assert score_prompt(clocks[:4], TWO_CLOCKS).soft == 0.0  # 1 - 2/2
    assert score_prompt([], TWO_CLOCKS).soft == 0.0          # 1 - 2/2


def test_extra_objects_are_fine_for_geneval_but_not_for_flow_grpo():
    cars = [at("car", 10, 10), at("car", 40, 10)]
    assert score_prompt(cars, ONE_CAR) == PromptScore(True, 1.0, 0.0, ())
    assert flow_grpo_score(cars, ONE_CAR) == 0.0  # 1 - |1 - 2|/1


def test_exact_is_flow_grpos_score_so_an_extra_object_costs_like_a_missing_one():
    one, two, three = ([at("car", 20 * i, 10) for i in range(n)] for n in (1, 2, 3))
    assert [score_prompt(d, ONE_CAR).strict for d in (one, two, three)] == [True, True, True]
    assert [score_prompt(d, ONE_CAR).exact for d in (one, two, three)] == [1.0, 0.0, -1.0]  # 1 - |1 - n|/1
    assert score_prompt([], ONE_CAR).exact == 0.0
    clocks = [at("clock", 20 * i, 10) for i in range(4)]
    assert [score_prompt(clocks[:n], TWO_CLOCKS).exact for n in range(5)] == [0.0, 0.5, 1.0, 0.5, 0.0]


def test_exact_equals_flow_grpo_score_whatever_the_verdict():
    cases = [([at("car", 10, 10, colour=c)], RED_CAR) for c in ("red", "blue", None)] + [
        ([at("teddy bear", 20, 50), at("dog", 80, 50)], DOG_RIGHT_OF_BEAR),
        ([at("teddy bear", 80, 50), at("dog", 20, 50)], DOG_RIGHT_OF_BEAR),
        ([at("car", 20 * i, 10) for i in range(3)],
         meta("two_object", {"class": "car", "count": 1}, {"class": "cat", "count": 1})),
    ]
    for dets, m in cases:
        assert score_prompt(dets, m).exact == flow_grpo_score(dets, m)


def test_soft_is_floored_at_zero_where_flow_grpo_goes_negative():
    two = meta("two_object", {"class": "car", "count": 1}, {"class": "cat", "count": 1})
    cars = [at("car", 20 * i, 10) for i in range(3)]
    assert flow_grpo_score(cars, two) == -0.5  # car 1 - 2/1 = -1, cat 1 - 1/1 = 0
    assert score_prompt(cars, two).soft == 0.0


def test_colour_right_wrong_and_unclassified():
    assert score_prompt([at("car", 10, 10, colour="red")], RED_CAR).strict
    for colour in ("blue", None):
        result = score_prompt([at("car", 10, 10, colour=colour)], RED_CAR)
        assert not result.strict
        assert result.soft == 0.5  # count 1, colour 1 - |1 - 0|/1 = 0


def test_colour_partial_credit_counts_matching_objects():
    two_red = meta("colors", {"class": "car", "count": 2, "color": "red"})
    dets = [at("car", 10, 10, colour="red"), at("car", 40, 10, colour="blue")]
    assert score_prompt(dets, two_red).soft == 0.75  # count 1, colour 1 - 1/2


def test_colour_is_judged_on_the_most_confident_objects_only():
    top_red = [at("car", 10, 10, score=0.9, colour="red"), at("car", 40, 10, score=0.8, colour="blue")]
    top_blue = [at("car", 10, 10, score=0.9, colour="blue"), at("car", 40, 10, score=0.8, colour="red")]
    assert score_prompt(top_red, RED_CAR).strict
    result = score_prompt(top_blue, RED_CAR)
    assert not result.strict
    assert result.soft == 0.0  # Flow-GRPO: 2 cars != 1 -> count 1 - 1/1 = 0 and one 0.0 for the colour


def test_an_exclude_not_implied_by_an_include_adds_a_zero_term():
    no_cat = meta("single_object", {"class": "dog", "count": 1}, exclude=[{"class": "cat", "count": 1}])
    dets = [at("dog", 10, 10), at("cat", 40, 10)]
    result = score_prompt(dets, no_cat)
    assert result.reasons == ("expected fewer than 1 'cat', found 1",)
    assert flow_grpo_score(dets, no_cat) == 1.0  # Flow-GRPO ignores excludes
    assert result.soft == 0.5                     # (1 + 0) / 2


def test_soft_is_one_exactly_when_strict():
    cases = [
        ([at("car", 10, 10)], ONE_CAR), ([], ONE_CAR), ([at("car", 10, 10), at("car", 40, 10)], ONE_CAR),
        *[([at("clock", 20 * i, 10) for i in range(n)], TWO_CLOCKS) for n in range(5)],
        ([at("car", 10, 10, colour="red")], RED_CAR), ([at("car", 10, 10, colour="blue")], RED_CAR),
        ([at("teddy bear", 20, 50), at("dog", 80, 50)], DOG_RIGHT_OF_BEAR),
        ([at("teddy bear", 80, 50), at("dog", 20, 50)], DOG_RIGHT_OF_BEAR),
    ]
    for dets, m in cases:
        result = score_prompt(dets, m)
        assert (result.soft == 1.0) == result.strict and 0.0 <= result.soft <= 1.0
        assert (result.reasons == ()) == result.strict


# ----------------------------------------------------------------------------- metadata checks


@pytest.mark.parametrize("bad, message", [
    ({"tag": "colour", "include": [{"class": "car", "count": 1}]}, "unknown GenEval tag 'colour'"),
    ({"include": [{"class": "car", "count": 1}]}, 'no "tag"'),
    ({"tag": "colors"}, '"include"'),
    ({"tag": "colors", "include": []}, '"include"'),
    ({"tag": "colors", "include": [{"class": "car", "count": 0}]}, "integer >= 1"),
    ({"tag": "colors", "include": [{"count": 1}]}, '"class"'),
    ({"tag": "position", "include": [{"class": "car", "count": 1},
                                     {"class": "dog", "count": 1, "position": ["beside", 0]}]}, "unknown relation"),
    ({"tag": "position", "include": [{"class": "car", "count": 1, "position": ["above", 0]}]}, "earlier include"),
    ({"tag": "position", "include": [{"class": "car", "count": 1},
                                     {"class": "dog", "count": 1, "position": ["above", -1]}]}, "earlier include"),
    ({"tag": "counting", "include": [{"class": "car", "count": 1}], "exclude": [{"class": "car"}]}, "exclude[0]"),
    ("not a mapping", "mapping"),
])
def test_malformed_metadata_is_a_value_error(bad, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        score_prompt([], bad)


def test_detection_box_must_have_four_numbers():
    assert Detection("car", [0, 1, 2, 3], 1).box == (0.0, 1.0, 2.0, 3.0)
    with pytest.raises(ValueError, match="x0, y0, x1, y1"):
        Detection("car", (0, 1, 2), 1.0)


# ----------------------------------------------------------------------------- summary


def test_summarise_means_and_standard_errors_by_hand():
    tags = ["counting"] * 4 + ["position"] + ["colors"] * 3
    strict = [True, True, False, False, True, True, False, False]
    table = summarise(tags, strict)
    cats = table["categories"]
    assert list(cats) == ["counting", "colors", "position"]  # GenEval's tag order
    assert cats["counting"] == {"mean": 0.5, "sem": pytest.approx(math.sqrt(0.25 / 3)), "n": 4}
    assert cats["colors"] == {"mean": pytest.approx(1 / 3), "sem": pytest.approx(1 / 3), "n": 3}  # sqrt(2/9 / 2)
    assert cats["position"] == {"mean": 1.0, "sem": 0.0, "n": 1}
    # mean of the category means, not of the images: (1/2 + 1/3 + 1)/3 = 11/18 (the images give 4/8)
    assert table["overall"]["mean"] == pytest.approx(11 / 18)
    assert table["overall"]["sem"] == pytest.approx(math.sqrt(1 / 12 + 1 / 9) / 3)  # sqrt(7)/18
    assert table["overall"]["n"] == 8


@pytest.mark.parametrize("tags, strict, message", [
    (["counting"], [True, False], "one verdict per tag"),
    ([], [], "at least one"),
    (["counting", "nope"], [True, True], "unknown GenEval tag"),
    (["counting"], [0.5], "true or false"),
])
def test_summarise_rejects_bad_input(tags, strict, message):
    with pytest.raises(ValueError, match=message):
        summarise(tags, strict)


# ----------------------------------------------------------------------------- files


def test_load_metadata_reads_one_object_a_line(tmp_path):
    path = tmp_path / "evaluation_metadata.jsonl"
    path.write_text('{"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a bench"}\n'
                    "\n"
                    '{"tag": "counting", "include": [{"class": "clock", "count": 2}], '
                    '"exclude": [{"class": "clock", "count": 3}], "prompt": "two clocks"}\n', encoding="utf-8")
    records = load_metadata(path)
    assert [r["tag"] for r in records] == ["single_object", "counting"]
    assert records[1]["exclude"] == [{"class": "clock", "count": 3}]


@pytest.mark.parametrize("second_line, message", [
    ('{"tag": "colors", "include": [', "not valid JSON"),
    ('["colors"]', "expected a JSON object"),
    ('{"include": [{"class": "car", "count": 1}]}', 'missing "tag"'),
    ('{"tag": "colors"}', 'missing "include"'),
    ('{"tag": "colors", "include": [{"class": "car", "count": "1"}]}', "integer >= 1"),
])
def test_load_metadata_names_the_file_and_line_of_a_bad_record(tmp_path, second_line, message):
    path = tmp_path / "meta.jsonl"
    path.write_text('{"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}\n'
                    + second_line + "\n", encoding="utf-8")
    with pytest.raises(ValueError) as info:
        load_metadata(path)
    assert str(info.value).startswith(f"{path}:2: ") and message in str(info.value)
