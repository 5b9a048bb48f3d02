"""The one refusal of a layer name that names nothing: the closest candidates first."""

from __future__ import annotations

import pytest

from dattri_llm.utils.names import check_names, close_candidates

NAMES = ["emb", "h.0.attn", "h.0.mlp", "h.1.attn", "h.1.mlp", "lm_head"]


def test_close_candidates_put_a_wrapper_prefix_relative_first():
    assert close_candidates("model.lm_head", NAMES)[0] == "lm_head"
    assert close_candidates("mlp", ["model.mlp", "x"])[0] == "model.mlp"
    assert close_candidates("h.0.atn", NAMES)[0] == "h.0.attn"
    assert close_candidates("zzz", NAMES) == NAMES  # nothing close: the names themselves


def test_check_names_keeps_known_names_and_refuses_the_rest():
    assert check_names("opt=", ["lm_head", "emb"], NAMES, "the layers") == ["lm_head", "emb"]
    with pytest.raises(ValueError, match=r"opt=: \['model.emb'\] match none of the layers.*"
                       r"Closest to 'model.emb': \['emb'\]"):  # fmt: skip
        check_names("opt=", ["emb", "model.emb"], NAMES, "the layers")
