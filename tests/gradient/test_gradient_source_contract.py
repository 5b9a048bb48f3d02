"""The ``GradientSource`` contract of the specification: per-step ``(step, Gradient, hashes)``.

A user-written source yielding the specification's 3-tuples (or 4-tuples with a checkpoint)
scores exactly like the library's own ``InMemoryGradientSource`` over the same gradients, for
the shared score loop (TracIn), a fitted method (K-FAC) and a trajectory method (DVEmb); the
library's ``GradientBlock`` unpacks as the specification's triple and carries its checkpoint
and metadata as attributes.
"""

from __future__ import annotations

import pytest
import torch

from dattri_llm import EKFACAttributor, GradientBlock, TracInAttributor
from dattri_llm.gradient.sources import DiskGradientSource, InMemoryGradientSource
from dattri_llm.gradient.streaming import GradientStreamer
from tests.helpers.reference import assert_same_formula
from tests.helpers.tracin import args, dataset, make_mlp, mlp_loss, vmap_grads


class TupleSource:
    """A source as a user would write it from the specification: ``(step, Gradient, hashes)``."""

    rereadable = True

    def __init__(self, blocks, with_checkpoint: bool = False) -> None:
        self.blocks = list(blocks)
        self.with_checkpoint = with_checkpoint

    def __iter__(self):
        for b in self.blocks:
            if self.with_checkpoint:
                yield (b.step, b.gradient, list(b.hashes), b.checkpoint)
            else:
                yield (b.step, b.gradient, list(b.hashes))


def blocks(tmp_path):
    model = make_mlp()
    train, test = dataset(7), dataset(3, seed=2)
    tr = list(GradientStreamer(model, train, mlp_loss, batch_size=3))
    te = list(GradientStreamer(model, test, mlp_loss, batch_size=2))
    return model, train, test, tr, te


def test_tracin_from_a_user_tuple_source_equals_in_memory(tmp_path):
    model, train, test, tr, te = blocks(tmp_path)
    att = TracInAttributor(args(tmp_path))
    ref = att.attribute_sources(InMemoryGradientSource(tr), InMemoryGradientSource(te))
    for train_src, test_src in (
        (TupleSource(tr), TupleSource(te)),
        (TupleSource(tr, with_checkpoint=True), TupleSource(te, with_checkpoint=True)),
        ([(b.step, b.gradient, b.hashes) for b in tr], (x[:3] for x in te)),  # list, generator
    ):
        got = att.attribute_sources(train_src, test_src)
        assert got.train_hashes == ref.train_hashes
        assert got.test_hashes == ref.test_hashes
        assert_same_formula(got.scores, ref.scores)
    # and right, not only equal: brute force per-sample gradients
    brute = vmap_grads(model, train) @ vmap_grads(model, test).T
    assert torch.allclose(ref.query(train, test), brute, rtol=1e-10, atol=1e-10)


def test_a_fitted_method_reads_a_user_tuple_source(tmp_path):
    _, _, _, tr, te = blocks(tmp_path)
    ref = EKFACAttributor(args(tmp_path), non_kronecker="diagonal").attribute_sources(
        InMemoryGradientSource(tr), InMemoryGradientSource(te)
    )
    got = EKFACAttributor(args(tmp_path), non_kronecker="diagonal").attribute_sources(
        TupleSource(tr), TupleSource(te)
    )
    assert torch.allclose(got.scores, ref.scores, rtol=1e-12, atol=1e-12)
    listed = EKFACAttributor(args(tmp_path), non_kronecker="diagonal")
    listed.fit([(b.step, b.gradient, b.hashes) for b in tr])  # a list of tuples, not a dataset
    assert set(listed.factors) == {0}


def test_a_trajectory_method_reads_a_user_tuple_source(tmp_path):
    from dattri_llm import DVEmbAttributor
    from tests.helpers.dvemb_run import LRS, make_run

    make_run(tmp_path)
    train = list(DiskGradientSource(tmp_path / "train"))
    query = list(DiskGradientSource(tmp_path / "query"))
    att = DVEmbAttributor(args(tmp_path), loss_reduction="sum")
    ref = att.attribute_sources(
        InMemoryGradientSource(train), InMemoryGradientSource(query), learning_rate=LRS
    )
    got = att.attribute_sources(TupleSource(train), TupleSource(query), learning_rate=LRS)
    assert got.train_hashes == ref.train_hashes and got.train_steps == ref.train_steps
    assert_same_formula(got.scores, ref.scores)
    emb = att.embed(TupleSource(train), learning_rate=LRS)
    assert torch.allclose(emb.score(InMemoryGradientSource(query)).scores, ref.scores)


def test_library_blocks_are_a_superset_of_the_specification_triple(tmp_path):
    from dattri_llm.gradient.sources import as_block

    _, _, _, tr, _ = blocks(tmp_path)
    b = tr[0]
    assert isinstance(b, GradientBlock) and isinstance(b, tuple)
    step, gradient, hashes = b  # exactly the specification's triple
    assert len(b) == 3 and b[:3] == (step, gradient, hashes)
    assert (b.step, b.gradient, b.hashes) == (step, gradient, hashes)
    assert isinstance(b.checkpoint, int) and b.metadata is not None  # carried as attributes
    filled = as_block((step, gradient, hashes))
    assert filled.checkpoint == 0 and dict(filled.metadata) == {}


def test_malformed_blocks_are_refused_with_their_position(tmp_path):
    _, _, _, tr, te = blocks(tmp_path)
    att = TracInAttributor(args(tmp_path))
    with pytest.raises(TypeError, match=r"item 1 of the train source is a tuple of 2 fields"):
        att.attribute_sources([tr[0][:3], (0, tr[1].gradient)], te)
    with pytest.raises(TypeError, match=r"item 0 of the test source: its second field"):
        att.attribute_sources(tr, [(0, torch.zeros(2, 3), ["a", "b"])])
    with pytest.raises(TypeError, match=r"hashes\) must be a sequence"):
        att.attribute_sources([(0, tr[0].gradient, "abc")], te)
    with pytest.raises(TypeError, match="must be an iterable"):
        att.attribute_sources(3, te)


def test_in_memory_blocks_unpack_as_the_specification_triple(tmp_path):
    _, _, _, tr, _ = blocks(tmp_path)
    source = InMemoryGradientSource([(b.step, b.gradient, b.hashes, 2, {"lr": 0.1}) for b in tr])
    seen = []
    for step, gradient, hashes in source:  # the specification's loop
        seen.append((step, gradient.batch_size, list(hashes)))
    assert seen == [(b.step, b.gradient.batch_size, list(b.hashes)) for b in tr]
    first = next(iter(source))
    assert first.checkpoint == 2 and dict(first.metadata) == {"lr": 0.1}
    moved = first._replace(checkpoint=5)
    assert moved.checkpoint == 5 and moved.metadata == first.metadata and moved[:3] == first[:3]
