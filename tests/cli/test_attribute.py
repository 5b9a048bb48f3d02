"""The `--layers` of the commands (`cli/_common.select_layers`): one pattern language, globs."""

from __future__ import annotations

import pytest

from dattri_llm.cli._common import UsageError, select_layers

#: A 12-block model's stored layers.
NAMES = [f"h.{i}.{part}" for i in range(12) for part in ("attn", "mlp")] + ["lm_head"]


def test_a_glob_selects_its_block_and_not_its_lookalikes() -> None:
    """``h.1.*`` read also as a regex selected blocks 10 and 11 as well; a glob is one block."""
    assert select_layers(["h.1.*"], NAMES, "--train s") == ["h.1.attn", "h.1.mlp"]
    assert select_layers(["lm_head", "h.1?.mlp"], NAMES, "--train s") == [
        "h.10.mlp",
        "h.11.mlp",
        "lm_head",
    ]
    assert select_layers(["*"], NAMES, "--train s") == NAMES  # store order, each once


@pytest.mark.parametrize("pattern", ["h\\.1\\..*", "h.(1|2).mlp", "model.lm_head"])
def test_a_pattern_that_matches_no_layer_is_refused_with_candidates(pattern: str) -> None:
    with pytest.raises(UsageError, match="matches no layer of --train s.*globs") as e:
        select_layers([pattern], NAMES, "--train s")
    assert "argument --layers" in str(e.value)
    if pattern == "model.lm_head":  # a wrapper's prefix: the stored name is offered first
        assert "Closest: ['lm_head'" in str(e.value)
