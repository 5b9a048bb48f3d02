"""``check_query_weights``: which train labels a query side meets, and when it is refused."""

from __future__ import annotations

import pytest

from dattri_llm.attribution.engine.blocks import WeightsWatch, check_query_weights
from dattri_llm.gradient.gradient import GradientBlock


def test_a_single_query_label_meets_every_train_label():
    train = {0: {"0:a"}, 1: {"0:b"}}
    check_query_weights(train, {1: "0:b"}, "train", "test")
    check_query_weights(train, {0: "0:a"}, "train", "test")  # any label it meets will do
    with pytest.raises(ValueError, match=r"label 0: 0:a; label 1: 0:b") as err:
        check_query_weights(train, {1: "0:c"}, "train store T", "test store Q")
    message = str(err.value)
    assert "0:c" in message and "test store Q (checkpoint label 1)" in message
    assert "train store T" in message and "check_weights=False" in message


def test_several_query_labels_each_meet_their_own():
    train = {0: {"0:a"}, 1: {"0:b"}}
    check_query_weights(train, {0: "0:a", 1: "0:b"}, "train", "test")
    with pytest.raises(ValueError, match=r"checkpoint label 0\).*label 0: 0:a\)"):
        check_query_weights(train, {0: "0:b", 1: "0:b"}, "train", "test")


def test_unknown_weights_other_ranks_and_missing_fingerprints_are_not_checked():
    check_query_weights({0: None}, {0: "0:z"}, "train", "test")  # trained without declaring
    check_query_weights({0: {"1:a"}}, {0: "0:z"}, "train", "test")  # another rank's shard
    check_query_weights({0: {"0:a"}}, {0: None}, "train", "test")  # no fingerprint recorded
    check_query_weights({}, {0: "0:z"}, "train", "test")  # no store


def _block(step: int, fingerprint: str) -> GradientBlock:
    return GradientBlock(step, None, [], 0, {"weights_fingerprint": fingerprint})


def test_declared_intervals_are_not_warned_about():
    watch = WeightsWatch("train", intervals={0})
    watch.see(_block(0, "0:a"), 0)
    watch.see(_block(1, "0:b"), 0)  # a declared training interval: no warning
    with pytest.warns(UserWarning, match="captured at different weights"):
        other = WeightsWatch("train")
        other.see(_block(0, "0:a"), 0)
        other.see(_block(1, "0:b"), 0)
