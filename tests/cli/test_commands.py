"""The ``dattri-llm`` command line, run as a user runs it: the real console script, in a subprocess.

A tiny language model is trained while its per-sample gradients are offloaded (the Python side
of the workflow), then ``inspect`` -> ``attribute`` -> ``top`` -> ``report`` run as commands and
their outputs are checked against the library's own results (the command line computes nothing
itself). Exit codes and error messages are checked for the usual mistakes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from dattri_llm import (
    AttributionScore,
    EKFACAttributor,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    KFACAttributor,
    OffloadCallback,
    TracInAttributor,
    hash_sample,
)
from dattri_llm.cli import main
from tests.helpers.reference import assert_same_formula

ROOT = Path(__file__).resolve().parents[2]
_SCRIPT = Path(sys.executable).parent / "dattri-llm"
#: The installed console script when there is one (CI installs the package), else the module.
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "dattri_llm"]
INJECTED = '<script>document.title="PWNED";document.body.dataset.pwned="1"</script><b>bold</b>'

TRAIN_TEXTS = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "cats and dogs are pets",
    INJECTED,
    "the sun is a star",
    "stars shine at night",
]
QUERY_TEXTS = ["the cat is a pet", "night sky stars", "a dog in a park"]
SEQ = 24


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(128, 8)
        self.fc = nn.Linear(8, 16)
        self.head = nn.Linear(16, 128)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(self.emb(input_ids))))


def encode(text: str) -> torch.Tensor:
    ids = [min(ord(c), 127) for c in text[:SEQ]]
    return torch.tensor(ids + [0] * (SEQ - len(ids)))


def loss_fn(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids)[:, :-1]
    labels = ids[:, 1:].masked_fill(ids[:, 1:] == 0, -100)
    return nn.functional.cross_entropy(
        logits.reshape(-1, 128), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )


def capture(
    model: nn.Module,
    texts: list[str],
    path: Path,
    batch: int,
    checkpoints: int,
    layers: list[str] | None = None,
) -> None:
    """Offload per-sample gradients of ``texts`` at ``checkpoints`` training states."""
    store = GradientStorageManager(path)
    config = HookManagerConfig(linear_io=layers or [r"fc", r"head"], capture_style="factorized")
    # the token heatmaps need the train store's token axis (compact storage drops it)
    off = OffloadCallback(file_manager=store, keep_token_factors=True)
    hm = HookManager(model, config=config, callbacks=[off])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = torch.stack([encode(t) for t in texts])
    with hm.collect(deregister_on_exit=True):
        for c in range(checkpoints):
            hm.checkpoint = c
            for i in range(0, len(ids), batch):
                opt.zero_grad(set_to_none=True)
                loss_fn(model, ids[i : i + batch]).backward()
            opt.step()
    store.close()


def write_texts(path: Path, texts: list[str], by_id: bool = True) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            ids = encode(t)
            row = {"text": t, "tokens": list(t[:SEQ]), "n": i}
            if by_id or i % 2:  # the other rows are matched by the content hash of input_ids
                row["id"] = hash_sample({"input_ids": ids})
            else:
                row["input_ids"] = ids.tolist()
            f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    model = TinyLM().double()
    train_model = TinyLM().double()
    train_model.load_state_dict(model.state_dict())
    capture(train_model, TRAIN_TEXTS, w / "train", batch=4, checkpoints=2)
    # queries at both checkpoint states (the same weights the train side saw)
    query_model = TinyLM().double()
    query_model.load_state_dict(model.state_dict())
    qstore = GradientStorageManager(w / "query")
    config = HookManagerConfig(linear_io=[r"fc", r"head"], capture_style="factorized")
    hm = HookManager(query_model, config=config, callbacks=[OffloadCallback(file_manager=qstore)])
    opt = torch.optim.SGD(query_model.parameters(), lr=0.05)
    train_ids = torch.stack([encode(t) for t in TRAIN_TEXTS])
    with hm.collect():
        for c in range(2):
            hm.checkpoint = c
            query_model.zero_grad(set_to_none=True)
            loss_fn(query_model, torch.stack([encode(t) for t in QUERY_TEXTS])).backward()
            with hm.paused():  # replay the training step without capturing it
                for i in range(0, len(train_ids), 4):  # as capture() does: the last batch steps
                    query_model.zero_grad(set_to_none=True)
                    loss_fn(query_model, train_ids[i : i + 4]).backward()
                opt.step()
    hm.remove()
    qstore.close()
    write_texts(w / "train.jsonl", TRAIN_TEXTS, by_id=False)
    write_texts(w / "queries.jsonl", QUERY_TEXTS)
    return w


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [*CLI, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


# ---- help, version, exit codes ----------------------------------------------------------------
def test_version_help_and_usage_errors() -> None:
    from dattri_llm import __version__

    r = cli("--version")
    assert r.returncode == 0 and r.stdout.startswith(f"dattri-llm {__version__}"), r
    r = cli("--help")
    assert r.returncode == 0
    for command in ("inspect", "attribute", "top", "report", "demo", "exit codes"):
        assert command in r.stdout
    r = cli("attribute", "--method", "nope", "--train", "a", "--test", "b", "--out", "c")
    assert r.returncode == 2 and "argument --method: invalid choice: 'nope'" in r.stderr
    r = cli()
    assert r.returncode == 2 and "COMMAND" in r.stderr


@pytest.mark.parametrize(
    "command", ["inspect", "attribute", "top", "report", "demo", "capture", "serve"]
)
def test_every_command_has_help_with_defaults(command: str, capsys) -> None:
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"usage: dattri-llm {command}" in out
    if command != "inspect":
        assert "(default: " in out  # defaults are shown


# ---- the workflow -----------------------------------------------------------------------------
@pytest.mark.slow
def test_capture_inspect_attribute_top_report(work: Path, tmp_path: Path) -> None:
    # inspect: what the store holds, and an intact verification
    r = cli("inspect", work / "train", "--verify")
    assert r.returncode == 0, r.stderr
    assert "records      4 (steps 0, 1, 2, 3)" in r.stdout
    assert "checkpoints  0, 1" in r.stdout
    assert "samples      12 rows, 6 distinct" in r.stdout
    assert "head" in r.stdout and "a (24, 17), g (24, 128)" in r.stdout
    assert "verified 4 records: all intact" in r.stdout

    # attribute: every method; the scores are the library's, bit for bit
    expected = {
        "tracin": TracInAttributor().attribute_from_cache(work / "train", work / "query"),
        "grad-cos": TracInAttributor(normalized_grad=True).attribute_from_cache(
            work / "train", work / "query", checkpoints=[1]
        ),
        "kfac": KFACAttributor().attribute_from_cache(work / "train", work / "query"),
        "ekfac": EKFACAttributor().attribute_from_cache(
            work / "train", work / "query", damping=1e-3
        ),
    }
    extra = {"ekfac": ["--damping", "1e-3"]}
    for method, ref in expected.items():
        out = tmp_path / method
        r = cli("attribute", "--method", method, "--train", work / "train", "--test",
                work / "query", "--out", out, *extra.get(method, []))  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert f"{method}: 6 training samples x 3 queries" in r.stdout
        got = AttributionScore.load(out)
        assert got.train_hashes == ref.train_hashes and got.test_hashes == ref.test_hashes
        assert_same_formula(got.scores, ref.scores)
        run = json.loads((out / "attribution_run.json").read_text())
        assert run["method"] == method
    assert json.loads((tmp_path / "grad-cos" / "attribution_run.json").read_text())[
        "checkpoints"
    ] == [1]  # the single-checkpoint methods score the last one by default

    # top: texts matched by id and by content hash
    r = cli("top", tmp_path / "tracin", "--texts", work / "train.jsonl", "--k", "2",
            "--query", "0", "--test-texts", work / "queries.jsonl")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("query 0") and "the cat is a pet" in r.stdout
    assert r.stdout.count("\n    1  ") == 2  # one proponent and one opponent table
    r = cli("top", tmp_path / "tracin", "--texts", work / "train.jsonl", "--json", "--k", "6")
    data = json.loads(r.stdout)
    assert len(data) == 3 and all(len(q["proponents"]) == 6 for q in data)
    assert all(e["text"] in TRAIN_TEXTS for q in data for e in q["proponents"])
    ref = expected["tracin"].top_k(6)
    assert [e["hash"] for e in data[1]["proponents"]] == ref.proponent_hashes[1]

    # report: one HTML file, one section per query, every text escaped
    page = tmp_path / "report.html"
    r = cli("report", tmp_path / "kfac", "--train-texts", work / "train.jsonl",
            "--test-texts", work / "queries.jsonl", "-o", page, "--k", "6")  # fmt: skip
    assert r.returncode == 0, r.stderr
    html = page.read_text(encoding="utf-8")
    assert html.count('<section class="query"') == 3
    assert "<script" not in html and "&lt;script&gt;" in html and "<b>bold" not in html
    assert "kfac" in html and "<svg" in html
    for needle in ("src=", 'href="http', "@import", "url("):
        assert needle not in html


@pytest.mark.slow
def test_token_scores_give_heatmaps(work: Path, tmp_path: Path) -> None:
    out = tmp_path / "tok"
    r = cli("attribute", "--method", "grad-dot", "--train", work / "train", "--test",
            work / "query", "--out", out, "--granularity", "token", "--top-k", "1")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "proponents:" in r.stdout  # --top-k prints the tables
    assert AttributionScore.load(out).has_token_scores
    page = tmp_path / "tok.html"
    assert main(["report", str(out), "--train-texts", str(work / "train.jsonl"), "-o",
                 str(page), "--token-k", "2"]) == 0  # fmt: skip
    html = page.read_text(encoding="utf-8")
    assert html.count("token view") == 3 * 2 * 2  # 2 proponents + 2 opponents per query
    assert 'class="tok"' in html and "&lt;script&gt;" in html


# ---- mistakes ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_errors_name_the_argument_and_exit_codes(work: Path, tmp_path: Path, capsys) -> None:
    def run(*args) -> tuple[int, str]:
        code = main([str(a) for a in args])
        return code, capsys.readouterr().err

    base = ["attribute", "--train", work / "train", "--test", work / "query"]
    code, err = run(*base, "--method", "tracin", "--out", tmp_path / "o", "--damping", "0.1")
    assert code == 2 and "argument --damping: --method tracin takes no damping" in err
    code, err = run("attribute", "--method", "kfac", "--train", tmp_path / "nope", "--test",
                    work / "query", "--out", tmp_path / "o")  # fmt: skip
    assert code == 2 and "argument --train: " in err and "does not exist" in err
    code, err = run(*base, "--method", "tracin", "--out", work / "train")
    assert code == 2 and "argument --out: " in err and "holds other files" in err
    code, err = run(*base, "--method", "tracin", "--out", tmp_path / "o", "--checkpoints", "7")
    assert code == 2 and "argument --checkpoints: [7] not in --train" in err
    code, err = run(*base, "--method", "tracin", "--out", tmp_path / "o", "--layers", "emb")
    assert code == 2 and "argument --layers: ['emb'] matches no layer of --train" in err
    code, err = run("top", tmp_path / "missing")
    assert code == 2 and "argument SCORES: " in err
    code, err = run("inspect", work / "train.jsonl")
    assert code == 2 and "argument STORE: " in err and "not a directory" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x", "id": "a"}\n{"text": "no identity"}\n')
    assert main([*map(str, base), "--method", "tracin", "--out", str(tmp_path / "ok")]) == 0
    code, err = run("top", tmp_path / "ok", "--texts", bad)
    assert code == 2 and "argument --texts: " in err and "line 2 has neither an 'id'" in err
    code, err = run("top", tmp_path / "ok", "--query", "9")
    assert code == 2 and "argument --query: query 9 out of range" in err
    # a library error (incompatible stores) is a failure of the command: exit 1
    other = tmp_path / "other"
    capture(TinyLM().double(), QUERY_TEXTS, other, batch=2, checkpoints=1, layers=[r"fc"])
    code, err = run("attribute", "--method", "tracin", "--train", work / "train", "--test",
                    other, "--out", tmp_path / "o2")  # fmt: skip
    assert code == 1 and err.startswith("dattri-llm attribute: error: ") and "layers" in err


@pytest.mark.slow
def test_verify_names_damaged_files_with_exit_code_3(work: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(work / "train", store)
    shards = sorted((store / "shards").glob("*.safetensors"))
    data = bytearray(shards[1].read_bytes())
    data[-3] ^= 0xFF  # flip bits in a tensor
    shards[1].write_bytes(bytes(data))
    shards[2].write_bytes(shards[2].read_bytes()[:-10])  # truncated
    r = cli("inspect", store, "--verify")
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "verified 4 records: 2 damaged" in r.stdout
    assert shards[1].name in r.stderr and shards[2].name in r.stderr
    assert r.stderr.count("dattri-llm inspect: damaged: ") == 2


@pytest.mark.slow
def test_demo_then_the_commands_it_suggests(tmp_path: Path) -> None:
    """``dattri-llm demo --workdir W`` keeps stores and texts; the commands it prints then work."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    w = tmp_path / "demo"
    r = cli("demo", "--per-topic", "3", "--queries-per-topic", "1", "--epochs", "1", "--show",
            "0", "--seq-len", "16", "--workdir", w)  # fmt: skip
    assert r.returncode == 0, r.stderr
    suggested = [
        line.strip().split()[1:] for line in r.stdout.splitlines() if line.startswith("  dattri")
    ]
    assert [s[0] for s in suggested] == ["inspect", "attribute", "top", "report"]
    for args in suggested:
        r = cli(*args)
        assert r.returncode == 0, (args, r.stderr)
    html = (w / "report.html").read_text(encoding="utf-8")
    assert html.count('<section class="query"') == 8  # one query per topic
    assert "topic: " in html  # the demo's texts carry their topic


def test_kfac_non_kronecker_flag_layer_patterns_and_one_line_warnings(
    work: Path, tmp_path: Path, capsys
) -> None:
    """The warning's advice is a flag; --layers takes globs (only)."""

    def run(*args) -> tuple[int, str]:
        code = main([str(a) for a in args])
        return code, capsys.readouterr().err

    with_emb = tmp_path / "with_emb"
    query = tmp_path / "query_emb"
    torch.manual_seed(0)
    model = TinyLM().double()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    capture(model, TRAIN_TEXTS, with_emb, batch=4, checkpoints=1, layers=[r"emb", r"fc", r"head"])
    model.load_state_dict(initial)  # the queries at the weights the train side was captured at
    capture(model, QUERY_TEXTS, query, batch=2, checkpoints=1, layers=[r"emb", r"fc", r"head"])
    base = ["attribute", "--method", "kfac", "--train", with_emb, "--test", query]
    code, err = run(*base, "--out", tmp_path / "skip")
    assert code == 0
    assert "dattri-llm attribute: warning: " in err and "non_kronecker='diagonal'" in err
    assert "eigendecompose(" not in err  # no internal source line
    code, err = run(*base, "--out", tmp_path / "diag", "--non-kronecker", "diagonal")
    assert code == 0 and "non_kronecker" not in err
    run_file = json.loads((tmp_path / "diag" / "attribution_run.json").read_text())
    assert run_file["non-kronecker layers"] == "diagonal"
    code, err = run(*base[:2], "tracin", *base[3:], "--out", tmp_path / "t", "--non-kronecker",
                    "diagonal")  # fmt: skip
    assert code == 2 and "argument --non-kronecker: only kfac, ekfac take it" in err
    # --layers: globs select what the names select, and the run records the names scored
    tr = ["attribute", "--method", "tracin", "--train", with_emb, "--test", query]
    scores = {}
    for tag, layers in (("names", ["fc", "head"]), ("glob", ["f*", "h*"])):
        assert main([*map(str, tr), "--out", str(tmp_path / tag), "--layers", *layers]) == 0
        capsys.readouterr()
        scores[tag] = AttributionScore.load(tmp_path / tag).scores
        recorded = json.loads((tmp_path / tag / "attribution_run.json").read_text())["layers"]
        assert recorded == ["fc", "head"], recorded
    assert_same_formula(scores["glob"], scores["names"])
    code, err = run(*tr, "--out", tmp_path / "none", "--layers", "transformer.h.*")
    assert code == 2 and "argument --layers: ['transformer.h.*'] matches no layer" in err
    code, err = run(*tr, "--out", tmp_path / "rx", "--layers", "fc|head")  # one language: globs
    assert code == 2 and "argument --layers: ['fc|head'] matches no layer" in err


def test_demo_help_is_plain_text_and_inspect_speaks_as_a_reader(tmp_path: Path, capsys) -> None:
    """No raw Sphinx markup in ``demo --help``; a non-store is read, not written."""
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "OffloadCallback" in out
    assert ":class:" not in out and "``" not in out
    (tmp_path / "notes.txt").write_text("not a store")
    code = main(["inspect", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "argument STORE: " in err and "is not a gradient store" in err
    assert "Pass an empty or new directory" not in err  # the writer's advice
    assert "notes.txt" in err and "save_dir" in err


def test_top_labels_name_their_field(capsys) -> None:
    """``top`` shows a text's labels as ``[field=value]``."""
    import torch

    from dattri_llm.attribution.score import AttributionScore
    from dattri_llm.attribution.views.report import SampleText
    from dattri_llm.cli.top import print_top

    score = AttributionScore(torch.tensor([[2.0], [-1.0]]), ["a", "b"], [0, 0], ["q"])
    texts = {
        "a": SampleText("a helpful text", labels={"topic": "import"}),
        "b": SampleText("an unhelpful one", labels={"topic": "try", "split": 1}),
    }
    print_top(score, 1, texts, None)
    out = capsys.readouterr().out
    assert "[topic=import] a helpful text" in out
    assert "[topic=try] [split=1] an unhelpful one" in out


def test_a_huge_k_on_the_command_line_is_every_sample(tmp_path: Path, capsys) -> None:
    """``attribute --top-k``, ``top --k``, ``report --k`` and ``index search --k`` of 10**12 on
    an 8-sample store: every sample, ranked as the library ranks it (nothing allocated for
    10**12 entries)."""
    from tests.helpers.index import record, train_vectors

    huge = str(10**12)
    train, test = train_vectors(8), train_vectors(2, seed=1)
    with GradientStorageManager(tmp_path / "train") as store:
        store.write(record(0, train, [f"t{i}" for i in range(8)]))
    with GradientStorageManager(tmp_path / "test") as store:
        store.write(record(0, test, ["q0", "q1"]))
    out = tmp_path / "scores"
    assert main(["attribute", "--method", "grad-dot", "--train", str(tmp_path / "train"),
                 "--test", str(tmp_path / "test"), "--out", str(out),
                 "--top-k", huge]) == 0  # fmt: skip
    assert capsys.readouterr().out.count("\n    8  ") == 4  # 8 proponents and 8 opponents x 2
    order = (test @ train.T).argsort(dim=1, descending=True).tolist()
    assert main(["top", str(out), "--k", huge, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [[e["hash"] for e in q["proponents"]] for q in data] == [
        [f"t{i}" for i in row] for row in order
    ]
    assert main(["report", str(out), "-o", str(tmp_path / "r.html"), "--k", huge]) == 0
    pytest.importorskip("faiss")
    assert main(["index", "build", str(tmp_path / "train"), "-o", str(tmp_path / "idx"),
                 "--block-rows", huge]) == 0  # fmt: skip
    assert main(["index", "search", str(tmp_path / "idx"), "--test", str(tmp_path / "test"),
                 "--k", huge, "--out", str(tmp_path / "s2")]) == 0  # fmt: skip
    got = AttributionScore.load(tmp_path / "s2")
    assert got.top_k_kept == 8 and got.top_k(8).proponent_hashes == [
        [f"t{i}" for i in row] for row in order
    ]


# ---- repeats, leaks, warnings, projections ------------------------------------------------------
def _epochs_under_one_label(w: Path) -> tuple[list[str], list[str]]:
    """Three epochs captured under checkpoint 0 while training; a query leaked into training."""
    leaked = QUERY_TEXTS[0].replace(" ", "  ", 1)  # the query's text, another hash
    train_texts = [*TRAIN_TEXTS[:3], leaked, QUERY_TEXTS[2]]  # and one query as it is
    torch.manual_seed(1)
    model = TinyLM().double()
    store = GradientStorageManager(w / "train")
    config = HookManagerConfig(linear_io=[r"fc", r"head"])
    hm = HookManager(model, config=config, callbacks=[OffloadCallback(file_manager=store)])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = torch.stack([encode(t) for t in train_texts])
    with hm.collect(deregister_on_exit=True):  # no relabelling: every epoch is checkpoint 0
        for _ in range(3):
            for i in range(0, len(ids), 3):
                opt.zero_grad(set_to_none=True)
                loss_fn(model, ids[i : i + 3]).backward()
                opt.step()
    store.close()
    qstore = GradientStorageManager(w / "query")
    hm = HookManager(model, config=config, callbacks=[OffloadCallback(file_manager=qstore)])
    with hm.collect(deregister_on_exit=True):
        model.zero_grad(set_to_none=True)
        loss_fn(model, torch.stack([encode(t) for t in QUERY_TEXTS])).backward()
    qstore.close()
    write_texts(w / "train.jsonl", train_texts)
    write_texts(w / "queries.jsonl", QUERY_TEXTS)
    return train_texts, [leaked, QUERY_TEXTS[2]]


def test_repeats_leaks_and_the_runs_warnings_are_shown(tmp_path: Path, capsys) -> None:
    texts, leaks = _epochs_under_one_label(tmp_path)
    out = tmp_path / "cos"
    assert main(["attribute", "--method", "grad-cos", "--train", str(tmp_path / "train"),
                 "--test", str(tmp_path / "query"), "--out", str(out)]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "several times under one checkpoint label" in err and "repeats='mean'" in err
    run = json.loads((out / "attribution_run.json").read_text())
    assert run["repeats"] == "mean"
    assert any("several times under one checkpoint label" in w for w in run["warnings"])
    score = AttributionScore.load(out)
    assert score.repeats == "mean" and score.warnings == run["warnings"]
    ref = TracInAttributor(normalized_grad=True).attribute_from_cache(
        tmp_path / "train", tmp_path / "query"
    )
    ids, matrix = score.agnostic_matrix()
    assert torch.allclose(matrix, ref.agnostic_matrix()[1]) and matrix.abs().max() <= 1.0
    assert set(score.occurrence_counts().values()) == {3}  # three epochs, one label

    # top: the run's warnings first, each sample's count, the leaks flagged
    assert main(["top", str(out), "--texts", str(tmp_path / "train.jsonl"), "--test-texts",
                 str(tmp_path / "queries.jsonl"), "--k", "5"]) == 0  # fmt: skip
    shown = capsys.readouterr().out
    assert shown.startswith("warnings of the scoring run (")
    assert "x3" in shown
    for j, leak in ((0, leaks[0]), (2, leaks[1])):
        block = shown.split(f"query {j} ")[1].split("\nquery ")[0]
        lines = [ln for ln in block.splitlines() if "LEAK" in ln]
        assert lines and all(" ".join(leak.split())[:10] in ln for ln in lines), (j, block)
    block1 = shown.split("query 1 ")[1].split("\nquery ")[0]
    assert "LEAK" not in block1
    # --json: the same facts per entry; the warnings on standard error
    assert main(["top", str(out), "--texts", str(tmp_path / "train.jsonl"), "--test-texts",
                 str(tmp_path / "queries.jsonl"), "--k", "5", "--json"]) == 0  # fmt: skip
    cap = capsys.readouterr()
    data = json.loads(cap.out)
    assert "the scoring run warned" in cap.err
    entries = [e for q in data for e in q["proponents"] + q["opponents"]]
    assert all(e["occurrences"]["count"] == 3 for e in entries)
    assert all(len(e["occurrences"]["steps"]["0"]) == 3 for e in entries)
    assert {e["text"] for q in data for e in q["proponents"] if e["leak"]} == set(leaks)
    assert all(q["repeats"] == "mean" for q in data)

    # texts that match no id are warned about (texts of samples that were not trained on)
    other = tmp_path / "other.jsonl"
    write_texts(other, TRAIN_TEXTS[3:])
    assert main(["top", str(out), "--texts", str(other), "--k", "1"]) == 0
    err = capsys.readouterr().err
    assert "--texts" in err and "none of its 3 texts matches the ids of the 5 training" in err
    assert main(["report", str(out), "--train-texts", str(other), "-o",
                 str(tmp_path / "r.html")]) == 0  # fmt: skip
    assert "none of its 3 texts matches" in capsys.readouterr().err

    # report: counts, leaks and warnings on the page
    page = tmp_path / "report.html"
    texts_args = ["--train-texts", str(tmp_path / "train.jsonl"), "--test-texts",
                  str(tmp_path / "queries.jsonl")]  # fmt: skip
    assert main(["report", str(out), *texts_args, "-o", str(page)]) == 0
    html = page.read_text(encoding="utf-8")
    assert "seen 3x under checkpoint 0" in html and "leak: identical to the query" in html
    assert "Warnings of the scoring run (" in html

    # the rule is a choice; a method that sums only says so, naming the flag
    summed = tmp_path / "sum"
    assert main(["attribute", "--method", "grad-cos", "--repeats", "sum", "--train",
                 str(tmp_path / "train"), "--test", str(tmp_path / "query"),
                 "--out", str(summed)]) == 0  # fmt: skip
    capsys.readouterr()
    got = AttributionScore.load(summed)
    assert got.repeats == "sum"
    assert torch.allclose(got.agnostic_matrix()[1], score.agnostic_matrix(repeats="sum")[1])
    code = main(["attribute", "--method", "dvemb", "--repeats", "mean", "--learning-rate",
                 "0.05", "--train", str(tmp_path / "train"), "--test", str(tmp_path / "query"),
                 "--out", str(tmp_path / "d")])  # fmt: skip
    assert code == 2 and "argument --repeats" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("style", "options", "summary"),
    [
        ("logra", {"proj_dim": 4}, "logra 2x2 (output side x input side) = 4, seed 7, normal"),
        ("sparse", {"proj_dim": 5, "nnz": 2}, "sparse dim 5, nnz 2, seed 7"),
        ("dense", {"proj_dim": 5, "proj_type": "rademacher"}, "dense dim 5, seed 7, rademacher"),
    ],
)
def test_inspect_describes_the_projection(tmp_path: Path, capsys, style, options, summary):
    from dattri_llm.gradient.ops.projection import ProjectionConfig

    torch.manual_seed(0)
    model = TinyLM().double()
    store = GradientStorageManager(tmp_path / "s")
    config = HookManagerConfig(
        linear_io=[r"fc"], projection=ProjectionConfig(style, seed=7, **options)
    )
    hm = HookManager(model, config=config, callbacks=[OffloadCallback(file_manager=store)])
    with hm.collect(deregister_on_exit=True):
        loss_fn(model, torch.stack([encode(t) for t in TRAIN_TEXTS[:2]])).backward()
    store.close()
    assert main(["inspect", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert f"projection   {summary} on 1/1 layers" in out
    assert f"{summary}; of nn.Linear 16x9" in out  # the source layer's matrix form
    assert main(["inspect", str(tmp_path / "s"), "--json"]) == 0
    layer = json.loads(capsys.readouterr().out)["layers"][0]
    assert layer["projection"] == f"{summary}; of nn.Linear 16x9"


def test_top_json_writes_a_non_finite_score_as_null(tmp_path, capsys):
    """JSON has no NaN: `top --json` must stay parseable by strict readers (a bare NaN is not
    JSON), so a non-finite score is written as null beside the finite ones."""
    from dattri_llm.attribution.score import AttributionScore

    scores = torch.tensor([[1.0], [float("nan")], [-2.0]])
    AttributionScore(scores, ["a", "b", "c"], [0, 0, 0], ["q"]).save(tmp_path / "s")
    assert main(["top", str(tmp_path / "s"), "--k", "3", "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out, parse_constant=lambda c: pytest.fail(f"bare {c} in the JSON"))
    got = {e["hash"]: e["score"] for e in data[0]["proponents"] + data[0]["opponents"]}
    assert got["a"] == 1.0 and got["c"] == -2.0
    assert "b" not in got or got["b"] is None
