"""Non-finite gradients are refused when written, naming the sample, the layer and the record.

* A finite float32 gradient that overflows on the cast to ``storage_dtype="float16"`` is
  refused as an overflow (its largest value, float16's limit, ``bfloat16`` suggested); the
  suggested ``bfloat16`` store takes the same capture and scores it like float32.
* A gradient already non-finite as captured is refused as such, with or without a cast.
* ``GradientStorageManager.write`` refuses it for any writer; ``nonfinite="warn"`` writes it.
* Nothing of a refused record reaches the store.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm import (
    CaptureCallback,
    GradientStorageManager,
    HookManager,
    OffloadCallback,
    TracInAttributor,
)
from dattri_llm.gradient import Gradient, GradientRecord, Materialized
from dattri_llm.gradient.store import NonFiniteGradientError
from dattri_llm.gradient.store.finite import find_nonfinite
from tests.helpers.store import args


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def batch(scale: float = 1.0) -> torch.Tensor:
    """Three samples of six tokens; the second is scaled by ``scale``."""
    x = torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(1))
    x[1] *= scale
    return x


def write(path, x: torch.Tensor, cap: CaptureCallback | None = None, **offload) -> list:
    """Capture one step of ``x`` into a store at ``path``; the captured records."""
    m = model()
    cap = cap or CaptureCallback(keep_all=True)
    off = OffloadCallback(file_manager=GradientStorageManager(path), **offload)
    hm = HookManager(m, callbacks=[cap, off])
    try:
        with hm.collect():
            (m(x) ** 2).sum().backward()
    finally:
        hm.remove()
    return cap.records


def test_overflow_of_the_float16_cast_is_refused_naming_sample_layer_record(tmp_path):
    x = batch(scale=300.0)  # sample 1's first-layer gradient is ~1e5: finite in float32
    with pytest.raises(NonFiniteGradientError) as err:
        write(tmp_path / "fp16", x, storage_dtype="float16")
    cap = write(tmp_path / "fp32", x)  # the same capture, float32: finite
    rec = cap[0]
    big = rec.gradient.layers["0"].materialize().data[1]
    assert torch.isfinite(big).all() and big.abs().max() > 65504  # beyond float16 only
    assert find_nonfinite(rec.gradient) is None
    msg = str(err.value)
    assert rec.hashes[1] in msg and "'0'" in msg and "step 0" in msg and "checkpoint 0" in msg
    assert "overflowed on the cast" in msg and "65504" in msg
    assert "storage_dtype='bfloat16'" in msg
    assert len(GradientStorageManager(tmp_path / "fp16")) == 0  # nothing of it was written
    # the suggested fix works: bfloat16 stores it, and it scores like the float32 store
    write(tmp_path / "bf16", x, storage_dtype="bfloat16")
    write(tmp_path / "q", batch()[:1])
    got = {}
    for name in ("bf16", "fp32"):
        score = TracInAttributor(args(tmp_path)).attribute_from_cache(
            tmp_path / name, tmp_path / "q"
        )
        got[name] = score.scores
    assert torch.isfinite(got["bf16"]).all()
    torch.testing.assert_close(got["bf16"], got["fp32"], rtol=2e-2, atol=0)


@pytest.mark.filterwarnings("ignore:layer '")  # autograd's own gradient is NaN too
@pytest.mark.parametrize("storage_dtype", [None, "float16", "bfloat16"])
def test_gradient_non_finite_as_captured_is_refused(tmp_path, storage_dtype):
    x = batch()
    x[2, 3, 0] = float("inf")  # sample 2's loss is inf, its gradient NaN / inf
    cap = CaptureCallback(keep_all=True)  # runs first: the captured ids
    with pytest.raises(NonFiniteGradientError) as err:
        write(tmp_path / "s", x, cap, storage_dtype=storage_dtype)
    msg = str(err.value)
    assert cap.records[0].hashes[2] in msg and "step 0" in msg and "layer '" in msg
    assert "overflowed" not in msg
    if storage_dtype is None:
        assert "non-finite as given (stored in float32)" in msg
    else:
        assert f"already non-finite before the cast to {storage_dtype}" in msg
    assert "nonfinite='warn'" in msg
    assert len(GradientStorageManager(tmp_path / "s")) == 0


def _record(values: torch.Tensor) -> GradientRecord:
    kw = {"_d": 4, "proj_dim": 4, "seed": 0, "source_layer_type": "nn.Linear"}
    grad = Gradient(
        {
            "a": Materialized(torch.ones(3, 4), "projected.mask", kw),
            "b": Materialized(values, "projected.mask", kw),
        }
    )
    return GradientRecord(7, ["h0", "h1", "h2"], grad, 2)


def test_manager_write_refuses_any_non_finite_record_and_warn_writes_it(tmp_path):
    for bad in (float("nan"), float("inf"), float("-inf")):
        values = torch.zeros(3, 4)
        values[2, 1] = bad
        with GradientStorageManager(tmp_path / "e", mode="overwrite") as store:
            with pytest.raises(NonFiniteGradientError, match=r"'h2' \(row 2 .*step 7, "):
                store.write(_record(values))
            store.write(_record(torch.zeros(3, 4)))  # the store still takes finite records
        assert len(GradientStorageManager(tmp_path / "e")) == 1
    with GradientStorageManager(tmp_path / "w", nonfinite="warn") as store:
        with pytest.warns(UserWarning, match="'h2'.*layer 'b'.*Written anyway"):
            store.write(_record(values))
    assert len(GradientStorageManager(tmp_path / "w")) == 1
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        GradientStorageManager(tmp_path / "x", nonfinite="ignore")


def test_find_nonfinite_locates_the_first_bad_number():
    values = torch.zeros(3, 4)
    assert find_nonfinite(_record(values).gradient) is None
    values[1, 3] = float("-inf")
    values[2, 0] = float("nan")
    found = find_nonfinite(_record(values).gradient)
    assert (found.layer, found.row, found.value) == ("b", 1, float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finite_numbers_whose_sum_overflows_are_finite(dtype):
    big = torch.finfo(dtype).max
    values = torch.full((3, 4), big, dtype=dtype)  # every number finite, every sum overflows
    values[0] = -big
    assert find_nonfinite(_record(values).gradient) is None
    for bad in (float("nan"), float("inf"), float("-inf")):  # one bad number among huge ones
        v = values.clone()
        v[2, 2] = bad
        found = find_nonfinite(_record(v).gradient)
        assert (found.layer, found.row) == ("b", 2) and str(found.value) == str(bad), found
