"""``dattri-llm capture``: a saved model and a corpus file to a gradient store, no code.

The reference for every captured gradient is one ``backward()`` of the sample alone, with its
loss written here: the sum of the cross-entropies of its labelled tokens (the completion's).
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

from dattri_llm.cli import main
from dattri_llm.gradient.sources import DiskGradientSource
from dattri_llm.gradient.store import GradientStorageManager
from tests.helpers.reference import captured_by_parameter, rel_err
from tests.helpers.tiny_lm import corpus, save_tiny_lm, write_jsonl

pytest.importorskip("transformers")
pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_lm(tmp_path_factory.mktemp("lm") / "model")


def _capture(*argv: str) -> int:
    return main(["capture", *map(str, argv), "--no-progress"])


def _store_vectors(path: Path) -> dict[str, torch.Tensor]:
    """``{hash: the sample's projected gradient, all layers concatenated}``."""
    out = {}
    for block in DiskGradientSource(str(path)):
        n = len(block.hashes)
        parts = [lg.materialize().data.reshape(n, -1) for lg in block.gradient.layers.values()]
        rows = torch.cat(parts, dim=1)
        out.update(zip(block.hashes, rows))
    return out


def test_capture_equals_one_sample_backward_of_the_summed_completion_loss(
    model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dattri_llm.gradient.causal_lm import hook_config
    from dattri_llm.gradient.hooks import HookManager

    rows = [  # lengths differ, so every batch is padded; two prompts share their completion
        {"prompt": "cat kitten", "completion": "purr meow fur"},
        {"prompt": "ship sail harbor anchor captain", "completion": "deck"},
        {"prompt": "number", "completion": "prime sum proof equation zero angle graph"},
        {"prompt": "cat", "completion": "purr meow fur"},
        {"prompt": "wave port", "completion": "ship ship"},
    ]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    store = tmp_path / "store"
    assert _capture(model_dir, data, "--out", store, "--prompt-field", "prompt",
                    "--completion-field", "completion", "--projection", "none",
                    "--batch-size", "3") == 0  # fmt: skip

    model = AutoModelForCausalLM.from_pretrained(model_dir).train()  # dropout would be on
    tok = AutoTokenizer.from_pretrained(model_dir)
    model.eval()
    hm = HookManager(model, config=hook_config(None, None))  # only its layer -> parameter map
    texts = {json.loads(x)["id"]: json.loads(x)["text"] for x in open(store / "texts.jsonl")}
    seen = 0
    for block in DiskGradientSource(str(store)):
        got = captured_by_parameter(hm, block.gradient, model)
        for i, h in enumerate(block.hashes):
            prompt, completion = texts[h].split("\n")
            p = tok(prompt)["input_ids"]
            c = tok(completion, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([p + c])
            model.zero_grad(set_to_none=True)
            logits = model(input_ids=ids).logits[0]
            # token t+1 predicted from the first t+1 tokens; only the completion's tokens count
            loss = sum(
                torch.nn.functional.cross_entropy(logits[t - 1], ids[0, t], reduction="sum")
                for t in range(len(p), len(p) + len(c))
            )
            loss.backward()
            for name, param in model.named_parameters():
                assert rel_err(got[name][i], param.grad) < 1e-5, (h[:8], name)
            seen += 1
    hm.remove()
    assert seen == len(rows)
    assert set(texts) == {h for b in DiskGradientSource(str(store)) for h in b.hashes}


def test_batch_size_changes_nothing_and_every_format_reads_the_same_documents(
    model_dir: Path, tmp_path: Path
) -> None:
    import datasets

    docs = corpus(n_per_topic=3)
    write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in docs])
    (tmp_path / "d.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    datasets.Dataset.from_dict({"body": docs}).to_csv(str(tmp_path / "d.csv"), index=False)
    datasets.Dataset.from_dict({"body": docs}).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "d_folder"))
    assert _capture(model_dir, tmp_path / "d.jsonl", "--out", tmp_path / "s1",
                    "--batch-size", "1") == 0  # fmt: skip
    ref = _store_vectors(tmp_path / "s1")
    assert len(ref) == len(set(docs))
    for data, extra in (
        ("d.txt", ()),
        ("d.csv", ("--text-field", "body")),
        ("d.parquet", ("--text-field", "body")),
        ("d_folder", ()),
    ):
        out = tmp_path / f"s_{data}"
        assert _capture(model_dir, tmp_path / data, "--out", out, "--batch-size", "4", *extra) == 0
        got = _store_vectors(out)
        assert set(got) == set(ref), data
        for h, v in got.items():
            assert rel_err(v, ref[h]) < 1e-5, data
        texts = [json.loads(x)["text"] for x in open(out / "texts.jsonl")]
        assert sorted(texts) == sorted(set(docs)), data


def test_interrupted_capture_resumes_and_other_settings_are_refused_by_name(
    model_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    from dattri_llm.cli import capture

    docs = corpus(n_per_topic=4)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in docs])
    full = tmp_path / "full"
    assert _capture(model_dir, data, "--out", full, "--batch-size", "3") == 0

    real = capture.samples

    def interrupted(args):  # Ctrl-C while the 8th document is read
        rows, n = real(args)

        def gen():
            for i, row in enumerate(rows):
                if i == 7:
                    raise KeyboardInterrupt
                yield row

        return gen(), n

    out = tmp_path / "out"
    monkeypatch.setattr(capture, "samples", interrupted)
    assert _capture(model_dir, data, "--out", out, "--batch-size", "3") == 130
    assert "--resume" in capsys.readouterr().err
    monkeypatch.setattr(capture, "samples", real)
    assert len(_store_vectors(out)) == 6  # two finished batches of three are kept

    assert _capture(model_dir, data, "--out", out, "--batch-size", "3") == 2
    assert "--resume" in capsys.readouterr().err  # not appended to silently
    assert _capture(model_dir, data, "--out", out, "--batch-size", "3", "--resume") == 0
    got, ref = _store_vectors(out), _store_vectors(full)
    assert set(got) == set(ref) and len(got) == len(set(docs))
    assert max(rel_err(got[h], ref[h]) for h in ref) < 1e-5
    lines = (out / "texts.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["id"] for x in lines) == sorted(ref)  # each text once

    other_model = save_tiny_lm(tmp_path / "other", seed=1)
    capsys.readouterr()
    for argv, name in (
        ((other_model, data, "--out", out), "model: "),
        ((model_dir, data, "--out", out, "--projection", "sparse:64"), "projection: "),
        ((model_dir, data, "--out", out, "--layers", "transformer.h.*"), "layers: "),
    ):
        assert _capture(*argv, "--resume") == 2
        err = capsys.readouterr().err
        assert "argument --resume" in err and name in err, err
    assert len(_store_vectors(out)) == len(ref)  # nothing was written by the refused runs


def test_options_are_checked_and_named(model_dir: Path, tmp_path: Path, capsys) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "cat purr"}, {"prompt": "x"}])
    for argv, name in (
        (("--projection", "sparse"), "--projection"),
        (("--projection", "gauss:4"), "--projection"),
        (("--text-field", "body"), "--text-field"),
        (("--prompt-field", "prompt"), "--completion-field"),  # the one missing
        (("--max-length", "1"), "--max-length"),
        (("--batch-size", "0"), "--batch-size"),
    ):
        assert _capture(model_dir, data, "--out", tmp_path / "s", *argv) == 2, argv
        assert f"argument {name}" in capsys.readouterr().err, argv
    assert _capture(tmp_path / "nope", data, "--out", tmp_path / "s") == 2
    assert "argument MODEL" in capsys.readouterr().err


def test_top_and_report_show_the_captured_texts_without_a_texts_flag(
    model_dir: Path, tmp_path: Path, capsys
) -> None:
    docs = corpus(n_per_topic=2)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in docs])
    queries = write_jsonl(tmp_path / "q.jsonl", [{"text": "cat purr meow"}])
    assert _capture(model_dir, data, "--out", tmp_path / "train") == 0
    assert _capture(model_dir, queries, "--out", tmp_path / "query") == 0
    train, query, scores = (str(tmp_path / x) for x in ("train", "query", "scores"))
    argv = ["--method", "grad-cos", "--train", train, "--test", query, "--out", scores]
    assert main(["attribute", *argv]) == 0
    capsys.readouterr()
    assert main(["top", str(tmp_path / "scores"), "--k", "2", "--json"]) == 0
    (item,) = json.loads(capsys.readouterr().out)
    assert item["text"] == "cat purr meow"
    assert all(e["text"] in docs for e in item["proponents"] + item["opponents"])
    page = tmp_path / "r.html"
    assert main(["report", str(tmp_path / "scores"), "-o", str(page)]) == 0
    assert item["proponents"][0]["text"] in page.read_text(encoding="utf-8")


def test_a_chat_template_formats_the_prompt_and_the_loss_stays_on_the_completion(
    tmp_path: Path,
) -> None:
    from transformers import AutoTokenizer

    from dattri_llm import hash_sample
    from dattri_llm.gradient.causal_lm import read_settings

    model_dir = save_tiny_lm(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = (
        "{% for m in messages %}[BOS] {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}[BOS]{% endif %}"
    )
    tok.save_pretrained(model_dir)
    rows = [{"prompt": "cat kitten", "completion": "purr meow"}]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    store = tmp_path / "store"
    assert _capture(model_dir, data, "--out", store, "--prompt-field", "prompt",
                    "--completion-field", "completion") == 0  # fmt: skip
    assert read_settings(store).chat
    # the template's ids written out here: [BOS] cat kitten [BOS], then the completion
    vocab = tok.get_vocab()
    prompt = [vocab[w] for w in ("[BOS]", "cat", "kitten", "[BOS]")]
    completion = [vocab["purr"], vocab["meow"]]
    item = {
        "input_ids": torch.tensor(prompt + completion),
        "labels": torch.tensor([-100] * len(prompt) + completion),
    }
    assert _store_vectors(store).keys() == {hash_sample(item, keys=["input_ids", "labels"])}


def test_layer_globs_select_layers_and_logra_gives_norms_their_nearest_form(
    model_dir: Path, tmp_path: Path
) -> None:
    pytest.importorskip("dattri")  # logra's random matrices
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dattri_llm import AttributionArguments, Explorer, TracInAttributor

    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in corpus(n_per_topic=3)])
    queries = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "cat", "completion": "purr meow"}])
    opts = ["--projection", "logra:4x4", "--layers", "transformer.h.1.*"]
    assert _capture(model_dir, data, "--out", tmp_path / "train", *opts) == 0
    pair = ["--prompt-field", "prompt", "--completion-field", "completion"]
    assert _capture(model_dir, queries, "--out", tmp_path / "query", *opts, *pair) == 0
    types = GradientStorageManager(tmp_path / "train").layer_types
    block = ["ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"]
    assert list(types) == [f"transformer.h.1.{n}" for n in block]  # the glob, not the block
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    # a norm takes no logra: exact when it has at most 4x4 parameters, else dense of 16
    norm = "nn.LayerNorm" if 2 * model.config.n_embd <= 16 else "projected.dense"
    for name, kind in types.items():
        assert kind == (norm if ".ln_" in name else "projected.logra"), name
    got = Explorer(model, AutoTokenizer.from_pretrained(model_dir), tmp_path / "train")
    got = got.attribute("cat", "purr meow", k=4)
    args = AttributionArguments(output_dir=str(tmp_path / "s"), show_progress=False)
    ref = TracInAttributor(args, normalized_grad=True).attribute_from_cache(
        str(tmp_path / "train"), str(tmp_path / "query"), top_k=4
    )
    assert [r.id for r in got.results] == ref.top_k(4).proponent_hashes[0]


# ---- under torch.distributed: every rank its share, the store a one-process capture's ---------
def _capture_on_rank(
    rank: int, world: int, workdir: str, argv: list[str], interrupt_at: int | None, code: int
) -> None:
    """One rank of a ``dattri-llm capture`` run (a ``tests.helpers.distributed`` rank body)."""
    import contextlib

    from dattri_llm.cli import capture
    from tests.helpers.distributed import init_group

    init_group(rank, world, workdir)
    if interrupt_at is not None:  # Ctrl-C while the row interrupt_at is read, on every rank
        real = capture.samples

        def interrupted(args):
            rows, n = real(args)

            def gen():
                for i, row in enumerate(rows):
                    if i == interrupt_at:
                        raise KeyboardInterrupt
                    yield row

            return gen(), n

        capture.samples = interrupted
    with open(Path(workdir, f"stdout.rank{rank}"), "w") as out, contextlib.redirect_stdout(out):
        got = _capture(*argv)
    assert got == code, f"rank {rank}: exit code {got}, expected {code}"


def _run_capture_ranks(workdir: Path, argv: list, interrupt_at: int | None = None, code=0):
    from tests.helpers.distributed import expect_ok, run_ranks

    argv = [str(a) for a in argv]
    expect_ok(run_ranks(_capture_on_rank, 2, workdir, argv, interrupt_at, code))
    return [Path(workdir, f"stdout.rank{r}").read_text() for r in range(2)]


def _texts_lines(store: Path) -> list[str]:
    return sorted((store / "texts.jsonl").read_text(encoding="utf-8").splitlines())


@pytest.mark.distributed
def test_under_torchrun_two_ranks_write_the_one_process_store(
    model_dir: Path, tmp_path: Path
) -> None:
    """``torchrun --nproc_per_node 2 -m dattri_llm capture ...``, as the help says: the
    command forms its own gloo group from torchrun's environment."""
    docs = corpus(n_per_topic=2)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in docs])
    opts = ["--projection", "none", "--batch-size", "1", "--no-progress"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert _capture(model_dir, data, "--out", one, *opts) == 0
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    argv = ["-m", "dattri_llm", "capture", str(model_dir), str(data), "--out", str(two), *opts]
    run = subprocess.run(
        [*torchrun, "2", *argv], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == [f"captured {len(set(docs))} samples into {two}; "
                                       "projection none (exact), layers all"]  # fmt: skip
    assert GradientStorageManager(two).ranks == [0, 1]
    assert _texts_lines(two) == _texts_lines(one)
    assert (two / "capture.json").read_text() == (one / "capture.json").read_text()
    got, ref = _store_vectors(two), _store_vectors(one)
    assert sorted(got) == sorted(ref)
    for h, v in ref.items():
        torch.testing.assert_close(got[h].double(), v.double(), rtol=1e-12, atol=0)


@pytest.mark.distributed
def test_two_gloo_ranks_capture_their_shares_and_resume_to_the_one_process_store(
    model_dir: Path, tmp_path: Path, capsys
) -> None:
    from dattri_llm import AttributionArguments, TracInAttributor
    from dattri_llm.gradient.causal_lm import read_texts

    docs = corpus(n_per_topic=4)
    # a repeated document and one with no token to predict: skipped the same way on every rank
    rows = [{"text": t} for t in [*docs[:6], docs[2], "cat", *docs[6:]]]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    queries = write_jsonl(tmp_path / "q.jsonl", [{"text": t} for t in corpus(2, seed=5)])
    # batches of one: a sample's float32 arithmetic is then the same in every process, so the
    # two stores must agree to float64 rounding, not only to float32's
    opts = ["--projection", "none", "--batch-size", "1"]
    one, two, query = tmp_path / "one", tmp_path / "two", tmp_path / "query"
    assert _capture(model_dir, data, "--out", one, *opts) == 0
    summary = capsys.readouterr().out
    assert "(1 repeated, 1 with no token to predict skipped)" in summary
    assert _capture(model_dir, queries, "--out", query, *opts) == 0
    capsys.readouterr()

    # interrupted on both ranks while the 9th row is read: each keeps its finished samples
    argv = [model_dir, data, "--out", two, *opts]
    _run_capture_ranks(tmp_path / "run1", argv, interrupt_at=8, code=130)
    kept = GradientStorageManager(two)
    assert kept.ranks == [0, 1] and 0 < kept.num_samples < len(docs)
    assert set(kept.sample_hashes()) <= set(GradientStorageManager(one).sample_hashes())
    assert len(read_texts(two)) == kept.num_samples  # the ranks' texts, read before the fold
    # one process resumes a copy of it: the same store and the same counts as two ranks
    shutil.copytree(two, tmp_path / "two_by_one")
    assert _capture(model_dir, data, "--out", tmp_path / "two_by_one", *opts, "--resume") == 0
    alone = capsys.readouterr().out
    out = _run_capture_ranks(tmp_path / "run2", [*argv, "--resume"])
    assert out[1] == ""  # one summary line, from rank 0, counting every rank's samples
    assert out[0].replace(str(two), "S") == alone.replace(str(tmp_path / "two_by_one"), "S")
    assert f"captured {len(docs) - kept.num_samples} samples" in out[0], out[0]

    ref = GradientStorageManager(one)
    vec_one = _store_vectors(one)
    for store in (two, tmp_path / "two_by_one"):
        got = GradientStorageManager(store)
        assert sorted(got.sample_hashes()) == sorted(ref.sample_hashes())
        assert got.num_samples == len(docs)  # each sample captured once, by one rank
        assert _texts_lines(store) == _texts_lines(one)
        assert not list(store.glob("rank_*/texts.jsonl"))  # folded into texts.jsonl
        settings = json.loads((store / "capture.json").read_text())
        assert settings == json.loads((one / "capture.json").read_text())
        vectors = _store_vectors(store)
        for h, v in vec_one.items():
            torch.testing.assert_close(vectors[h].double(), v.double(), rtol=1e-12, atol=0)
    assert GradientStorageManager(two).ranks == [0, 1]  # both partitions hold records

    # the scores of both stores, against the brute-force dot products of the stored vectors
    q = _store_vectors(query)
    train_ids, test_ids = sorted(vec_one), sorted(q)
    brute = (
        torch.stack([vec_one[h].double() for h in train_ids])
        @ torch.stack([q[k].double() for k in test_ids]).T
    )
    matrices = []
    for store in (one, two):
        args = AttributionArguments(output_dir=str(tmp_path / f"s_{store.name}"))
        args.show_progress = False
        score = TracInAttributor(args).attribute_from_cache(str(store), str(query))
        ids, matrix = score.agnostic_matrix()
        assert sorted(ids) == train_ids and sorted(score.test_hashes) == test_ids
        rows = [ids.index(h) for h in train_ids]
        cols = [score.test_hashes.index(k) for k in test_ids]
        matrices.append(matrix[rows][:, cols].double())
        assert rel_err(matrices[-1], brute) < 1e-5, store.name  # the scorer sums in float32
    torch.testing.assert_close(matrices[1], matrices[0], rtol=1e-12, atol=0)
