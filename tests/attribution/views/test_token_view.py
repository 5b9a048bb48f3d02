"""Token-level attribution (``attribution_granularity="token"``) against brute force (float64).

* Token scores sum to the instance scores, for a factorized and a materialized test side, live
  and from a gradient store; padding positions score exactly zero.
* A materialized train side is a clear error.
* One linear layer: each position's score equals ``<g_t a_t^T, G_test>`` built from explicit
  tensors (activations and output gradients by autograd, the test gradient checked against
  torch.func), also with Grad-Cos and a logra projection.
* The HTML / terminal renderer (``dattri_llm.attribution.views.token_view``).
"""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
import torch
from torch import nn

from dattri_llm import (
    AttributionArguments,
    AttributionScore,
    AttributionTask,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    TracInAttributor,
)
from dattri_llm.attribution.views.token_view import (
    TokenHeatmap,
    display_token,
    html_page,
    html_tokens,
    terminal_heatmap,
    write_html,
)
from dattri_llm.gradient import Shared, ops
from tests.helpers.reference import per_sample_grads, rel_err

GPT2_V, GPT2_T = 40, 8


def args(tmp_path, **kw) -> AttributionArguments:
    kw.setdefault("per_device_train_batch_size", 3)
    kw.setdefault("per_device_eval_batch_size", 2)
    return AttributionArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, show_progress=False, **kw
    )


# ---- a tiny GPT-2 with right padding ----------------------------------------------------------
def gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=16,
        vocab_size=GPT2_V,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def padded(lengths: list[int], seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        mask = (torch.arange(GPT2_T) < n).long()
        ids = torch.randint(1, GPT2_V, (GPT2_T,), generator=g) * mask
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def gpt2_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Sum over samples of the summed next-token losses of the real (unpadded) tokens."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask).logits
    labels = ids.masked_fill(mask == 0, -100)
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, GPT2_V), labels[:, 1:].reshape(-1), reduction="sum"
    )


def loop_grads(model: nn.Module, ds: list[dict]) -> torch.Tensor:
    """Brute force: one sample per backward, every parameter (tied weights counted once)."""
    rows = []
    for item in ds:
        model.zero_grad(set_to_none=True)
        gpt2_loss(model, {k: v[None] for k, v in item.items()}).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    return torch.stack(rows)


def offload(model: nn.Module, ds: list[dict], path, capture_style: str, batch: int = 3) -> str:
    fm = GradientStorageManager(str(path))
    hm = HookManager(
        model,
        HookManagerConfig(capture_style=capture_style),
        # token granularity needs the train store's token axis (compact storage drops it)
        callbacks=[
            OffloadCallback(file_manager=fm, recording_type="per_sample", keep_token_factors=True)
        ],
    )
    with hm.collect():
        for i in range(0, len(ds), batch):
            model.zero_grad(set_to_none=True)
            items = ds[i : i + batch]
            gpt2_loss(model, {k: torch.stack([d[k] for d in items]) for k in items[0]}).backward()
    hm.remove()
    model.zero_grad(set_to_none=True)
    fm.close()
    return str(path)


def _kinds(grad) -> set[str]:
    out = set()
    for lg in grad.layers.values():
        for site in lg.sites if isinstance(lg, Shared) else [lg]:
            out.add(type(site).__name__)
    return out


TRAIN_LENGTHS = [8, 5, 6, 3, 8]


def test_token_scores_sum_to_instance_scores_live_and_from_cache(tmp_path, monkeypatch):
    model = gpt2()
    train, test = padded(TRAIN_LENGTHS, seed=3), padded([7, 4, 6], seed=4)
    ref = loop_grads(model, train) @ loop_grads(model, test).T

    seen: list[set[str]] = []  # kinds of the test-side layers each token score block got
    real = ops.cross_dot_per_token

    def spy(x, y, mode="auto", per_layer=False):
        assert _kinds(x) == {"Factorized"}
        seen.append(_kinds(y))
        return real(x, y, mode=mode, per_layer=per_layer)

    monkeypatch.setattr(ops, "cross_dot_per_token", spy)
    task = AttributionTask(gpt2_loss, model)
    runs: dict[str, AttributionScore] = {}
    # live: mode="factorized" keeps the test side factorized, "materialized" densifies it once
    for mode, kind in (("factorized", "Factorized"), ("materialized", "Materialized")):
        seen.clear()
        runs[f"live-{mode}"] = TracInAttributor(args(tmp_path), task=task, mode=mode).attribute(
            train, test, attribution_granularity="token"
        )
        assert seen and all(k == {kind} for k in seen), (mode, seen)
    # from a cache: a factorized train store against a factorized / a materialized test store
    tr_dir = offload(model, train, tmp_path / "train", "factorized")
    # (mode="factorized" scores the test store as stored; "auto" densifies some test layers)
    for style, kind in (("factorized", "Factorized"), ("materialized", "Materialized")):
        te_dir = offload(model, test, tmp_path / f"test-{style}", style, batch=2)
        for mode in ("factorized", "auto"):
            seen.clear()
            att = TracInAttributor(args(tmp_path), mode=mode)
            runs[f"cache-{style}-{mode}"] = att.attribute_from_cache(
                tr_dir, te_dir, attribution_granularity="token"
            )
            assert seen, (style, mode)
            if mode == "factorized":
                assert all(k == {kind} for k in seen), (style, seen)

    # instance scores of a sample-granularity run (cross_dot, not the per-token path)
    inst = TracInAttributor(args(tmp_path), task=task).attribute(train, test)
    assert rel_err(inst.query(train, test), ref) < 1e-10 and not inst.has_token_scores
    base = runs["live-factorized"]
    for how, score in runs.items():
        assert rel_err(score.query(train, test), ref) < 1e-10, how
        for item, n in zip(train, TRAIN_LENGTHS):
            pos, ts = score.token_scores(item)
            assert pos.tolist() == list(range(GPT2_T)) and ts.shape == (GPT2_T, len(test))
            assert rel_err(ts.sum(0), score.query([item], test)[0]) <= 1e-10, how
            assert rel_err(ts.sum(0), inst.query([item], test)[0]) <= 1e-10, how
            # padding, and the last real token (its target is padding), score exactly zero
            assert torch.all(ts[n - 1 :] == 0), how
            assert torch.all(ts[: n - 1].abs().sum(1) > 0), how
            assert rel_err(ts, base.token_scores(item)[1]) < 1e-10, how

    # token scores survive save / load
    loaded = AttributionScore.load(base.save(tmp_path / "saved"))
    for item in train:
        assert torch.equal(loaded.token_scores(item)[1], base.token_scores(item)[1])


def test_materialized_train_side_is_a_clear_error(tmp_path):
    model = gpt2()
    train, test = padded([8, 5, 6], seed=3), padded([7, 4], seed=4)
    task = AttributionTask(gpt2_loss, model)
    with pytest.raises(ValueError, match="Capture factorized") as live_err:
        TracInAttributor(args(tmp_path), task=task).attribute(
            train,
            test,
            hook_config=HookManagerConfig(capture_style="materialized"),
            attribution_granularity="token",
        )
    assert "transformer.h.0.attn.c_attn" in str(live_err.value)  # names the layers
    tr_dir = offload(model, train, tmp_path / "train", "materialized")
    te_dir = offload(model, test, tmp_path / "test", "factorized")
    with pytest.raises(ValueError, match="no token axis.*Capture factorized"):
        TracInAttributor(args(tmp_path)).attribute_from_cache(
            tr_dir, te_dir, attribution_granularity="token"
        )
    # the same stores score fine at sample granularity
    score = TracInAttributor(args(tmp_path)).attribute_from_cache(tr_dir, te_dir)
    ref = loop_grads(model, train) @ loop_grads(model, test).T
    assert rel_err(score.query(train, test), ref) < 1e-10


# ---- one linear layer: explicit per-position formula ------------------------------------------
V, T = 23, 5


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 6)
        self.fc = nn.Linear(6, 9)
        self.norm = nn.LayerNorm(9)
        self.head = nn.Linear(9, V)

    def rest(self, fc_out: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(fc_out)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.rest(self.fc(self.emb(input_ids)))


def ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), reduction="sum"
    )


def mlp_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return ce(model(batch["input_ids"]), batch["input_ids"])


def per_position_fc(model: MLP, ds: list[dict]) -> torch.Tensor:
    """``(B, T, K, D + 1)``: ``g_t a_t^T`` of ``fc`` per sample and position (bias last).

    ``a_t`` is the layer input, ``g_t`` the gradient of the sample's loss w.r.t. the layer
    output at position ``t`` (the batch loss is a sum over samples, so one autograd call gives
    every sample's own ``g``).
    """
    ids = torch.stack([d["input_ids"] for d in ds])
    x = model.emb(ids).detach()
    out = (x @ model.fc.weight.detach().T + model.fc.bias.detach()).requires_grad_(True)
    (g,) = torch.autograd.grad(ce(model.rest(out), ids), out)
    a = torch.cat([x, torch.ones(*x.shape[:2], 1, dtype=x.dtype)], -1)
    return g[:, :, :, None] * a[:, :, None, :]


@pytest.mark.parametrize(
    "variant", ["grad-dot", "grad-cos", "logra"], ids=["grad-dot", "grad-cos", "logra"]
)
def test_single_linear_layer_equals_per_position_formula(tmp_path, variant: str):
    torch.manual_seed(0)
    model = MLP().double().eval()
    g = torch.Generator().manual_seed(1)
    train = [{"input_ids": torch.randint(0, V, (T,), generator=g)} for _ in range(5)]
    test = [{"input_ids": torch.randint(0, V, (T,), generator=g)} for _ in range(3)]

    p_train, p_test = per_position_fc(model, train), per_position_fc(model, test)
    # the brute force itself: summed over positions it is torch.func's per-sample gradient
    ref = per_sample_grads(
        model, mlp_loss, {"input_ids": torch.stack([d["input_ids"] for d in test])}
    )
    g_test = torch.cat([ref["fc.weight"], ref["fc.bias"][..., None]], -1)
    assert rel_err(p_test.sum(1), g_test) < 1e-12

    projection = None
    if variant == "logra":
        from dattri_llm.gradient.ops import ProjectionConfig
        from dattri_llm.gradient.ops.projection import projection_matrix

        pytest.importorskip("dattri")
        projection = ProjectionConfig("logra", proj_dim_in=4, proj_dim_out=3, seed=2)
        row = projection_matrix(9, 3, 3, "normal", torch.float64)  # row side: seed + 1
        col = projection_matrix(7, 4, 2, "normal", torch.float64)  # column side: seed
        p_train, g_test = row.T @ p_train @ col, row.T @ g_test @ col
    share = torch.einsum("btkd,jkd->btj", p_train, g_test)  # <g_t a_t^T, G_test>
    if variant == "grad-cos":
        n_train = p_train.sum(1).flatten(1).norm(dim=1)
        n_test = g_test.flatten(1).norm(dim=1)
        share = share / n_train[:, None, None] / n_test[None, None, :]

    hook_config = HookManagerConfig(linear_io=["fc"], projection=projection)
    task = AttributionTask(mlp_loss, model)
    for mode in ("auto", "factorized", "materialized"):
        att = TracInAttributor(
            args(tmp_path, score_block_size=2),
            task=task,
            normalized_grad=variant == "grad-cos",
            mode=mode,
        )
        score = att.attribute(train, test, hook_config=hook_config, attribution_granularity="token")
        for i, item in enumerate(train):
            pos, ts = score.token_scores(item)
            assert pos.tolist() == list(range(T))
            assert rel_err(ts, share[i]) < 1e-10, (variant, mode, i)
        assert rel_err(score.query(train, test), share.sum(1)) < 1e-10
        assert torch.all(share[:, -1] == 0)  # the last position predicts nothing


# ---- rendering ---------------------------------------------------------------------------------
class _Spans(HTMLParser):
    """Collects the text and attributes of every ``<span class="tok">``."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[dict] = []
        self.tags: list[str] = []
        self._open: dict | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        attrs = dict(attrs)
        if tag == "span" and attrs.get("class") == "tok":
            self._open = {**attrs, "text": ""}

    def handle_endtag(self, tag):
        if tag == "span" and self._open is not None:
            self.spans.append(self._open)
            self._open = None

    def handle_data(self, data):
        if self._open is not None:
            self._open["text"] += data


def test_html_page_escapes_and_has_one_span_per_token(tmp_path):
    tokens = ["<script>alert(1)</script>", " a&b", ' "q"', "\n", "x", "'"]
    scores = torch.tensor([0.5, -1.0, 0.25, 0.0, 2.0, -0.125], dtype=torch.float64)
    page = html_page(
        [TokenHeatmap("<script>heading</script>", tokens, scores, note="<img src=x>")],
        title="<script>title</script>",
        description="a & b",
    )
    assert "<script" not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    parser = _Spans()
    parser.feed(page)
    assert "script" not in parser.tags and "img" not in parser.tags
    assert len(parser.spans) == len(tokens) == page.count('class="tok"')
    for span, tok, s in zip(parser.spans, tokens, scores.tolist()):
        assert span["text"] == display_token(tok)
        assert float(span["data-score"]) == s
        assert f"{s:+.4e}" in span["title"]  # the hover shows the score
        assert ("style" in span) == (s != 0)  # exact zeros stay uncoloured
    # strongest scores get full colour: green for positive, red for negative
    assert "rgb(0, 158, 74)" in parser.spans[4]["style"]
    assert "rgb(235, 147, 147)" in parser.spans[1]["style"]  # -1.0 at scale 2.0: half red
    # self-contained: nothing is fetched
    for needle in ("src=", "href=", "http", "@import", "url("):
        assert needle not in page.replace("&lt;img src=x&gt;", "")
    path = write_html(tmp_path / "sub" / "page.html", [TokenHeatmap("h", tokens, scores)])
    assert open(path, encoding="utf-8").read().count('class="tok"') == len(tokens)


def test_terminal_heatmap_and_errors():
    tokens = ["Hello", " \x1b[31mworld", "\n", "!"]
    scores = [1.0, -0.5, 0.0, 0.25]
    out = terminal_heatmap(tokens, scores, color=True)
    assert out.count("\x1b[0m") == 3  # one coloured cell per non-zero score
    assert "\x1b[31m" not in out and "\\x1b[31mworld" in out  # a token cannot inject codes
    assert "\x1b[48;2;0;158;74m" in out  # the largest score is full green
    plain = terminal_heatmap(tokens, scores, color=False)
    assert "\x1b" not in plain.replace("\\x1b", "")
    assert plain == "[Hello|+1.00e+00][ \\x1b[31mworld|-5.00e-01]⏎[!|+2.50e-01]"
    with pytest.raises(ValueError, match="one score per token"):
        html_tokens(tokens, scores[:-1])
    with pytest.raises(ValueError, match="one score per token"):
        TokenHeatmap("h", tokens, [1.0])
    with pytest.raises(TypeError, match="sequence of token strings"):
        terminal_heatmap("abc", [1.0, 2.0, 3.0])
    assert terminal_heatmap(["a", "b"], [0.0, 0.0]) == "ab"  # nothing to colour


def test_terminal_colours_only_on_a_terminal_without_no_color(monkeypatch):
    import io

    from dattri_llm.attribution.views.token_view import color_enabled

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tokens, scores = ["a", "b"], [1.0, -1.0]
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert not color_enabled(io.StringIO())  # a pipe or a file: no ANSI codes
    assert color_enabled(Tty())
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert "\x1b" not in terminal_heatmap(tokens, scores)  # the default follows stdout
    monkeypatch.setattr("sys.stdout", Tty())
    assert "\x1b[48;2" in terminal_heatmap(tokens, scores)
    monkeypatch.setenv("NO_COLOR", "1")  # https://no-color.org
    assert not color_enabled(Tty())
    assert "\x1b" not in terminal_heatmap(tokens, scores)
    assert "\x1b[48;2" in terminal_heatmap(tokens, scores, color=True)  # explicit wins
    monkeypatch.setenv("NO_COLOR", "")  # empty: not set
    assert color_enabled(Tty())


def test_token_window_places_a_short_token_list_by_its_padding():
    from dattri_llm.attribution.views.token_view import token_window

    t = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    assert token_window(["a", "b", "c", "d"], t) == slice(0, 4)
    # positions 0 and 3 are zero: "left" (1..3) and "right" (0..2) both fit and differ
    with pytest.raises(ValueError, match="not padding on one side alone"):
        token_window(["b", "c", "d"], t)
    assert token_window(["b", "c"], torch.tensor([0.0, 0.0, 1.0, 2.0])) == slice(2, 4)
    assert token_window(["b", "c"], [1.0, 2.0, 0.0]) == slice(0, 2)
    assert token_window(["a"], torch.zeros(3)) == slice(0, 1)  # nothing to misplace
    with pytest.raises(ValueError, match="tokens has 3 entries but the scores have 2"):
        token_window(["a", "b", "c"], [1.0, 2.0])
    with pytest.raises(ValueError, match="not padding"):
        token_window(["a"], [1.0, 0.0, 2.0])
