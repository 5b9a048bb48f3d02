"""``dattri-llm serve``: the explorer's JSON API and page, on a real server (uvicorn).

The reference for every answer is ``attribute_from_cache(top_k=k)`` over a query store that
``dattri-llm capture`` wrote from the same prompts and completions.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from dattri_llm.cli import main
from tests.helpers.tiny_lm import INJECTIONS, QUERIES, captured_stores, corpus

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(base url, explorer, train store, query store)`` of a server on a free port."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dattri_llm import Explorer
    from dattri_llm.cli.serve import build_app

    docs = corpus(n_per_topic=4) + list(INJECTIONS)  # markup in the corpus must stay text
    model_dir, train, query = captured_stores(tmp_path_factory.mktemp("serve"), docs)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    explorer = Explorer(model, AutoTokenizer.from_pretrained(model_dir), train)
    server = uvicorn.Server(
        uvicorn.Config(build_app(explorer, max_k=50), host="127.0.0.1", port=0, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", explorer, train, query
    server.should_exit = True
    thread.join(timeout=10)


def _files(path: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def test_api_top_k_equals_attribute_from_cache(served, tmp_path: Path) -> None:
    from dattri_llm import AttributionArguments, TracInAttributor

    url, _, train, query = served
    before = _files(train)
    k = 6
    attributor = TracInAttributor(
        AttributionArguments(output_dir=str(tmp_path), show_progress=False), normalized_grad=True
    )
    ref = attributor.attribute_from_cache(str(train), str(query), top_k=k).top_k(k)
    texts = {json.loads(x)["id"]: json.loads(x)["text"] for x in open(train / "texts.jsonl")}
    with httpx.Client(base_url=url) as client:
        assert client.get("/api/health").json()["train_samples"] == len(texts)
        answers = []
        for q in QUERIES:
            r = client.post("/api/attribute", json={**q, "k": k})
            assert r.status_code == 200, r.text
            answers.append(r.json())
        for j, a in enumerate(answers):  # the query store holds the queries in this order
            assert a["completion"] == QUERIES[j]["completion"] and a["method"] == "grad-cos"
            assert [x["id"] for x in a["results"]] == ref.proponent_hashes[j]
            got = torch.tensor([x["score"] for x in a["results"]], dtype=torch.float64)
            tol = 1e-5 * float(got.abs().max())
            torch.testing.assert_close(got, ref.proponent_scores[j].double(), rtol=0, atol=tol)
            assert [x["rank"] for x in a["results"]] == list(range(1, k + 1))
            assert [x["text"] for x in a["results"]] == [texts[h] for h in ref.proponent_hashes[j]]
            assert a["elapsed_ms"] > 0
        h = ref.proponent_hashes[0][0]
        assert client.get(f"/api/sample/{h}").json() == {"id": h, "text": texts[h]}
        r = client.get("/api/sample/nope")
        assert r.status_code == 404 and r.json()["field"] == "id"
        r = client.post("/api/attribute", json={"prompt": "cat", "completion": None, "k": 3})
        assert r.status_code == 200 and len(r.json()["results"]) == 3  # generated greedily
    assert _files(train) == before  # the store is only read


def test_answers_through_an_approximate_index_say_so(served, tmp_path: Path) -> None:
    pytest.importorskip("faiss")
    from starlette.testclient import TestClient

    from dattri_llm import Explorer, GradientIndex
    from dattri_llm.cli.serve import build_app

    url, explorer, train, _ = served
    q = {**QUERIES[0], "k": 3}
    with httpx.Client(base_url=url) as client:  # the store scan: exact
        assert client.post("/api/attribute", json=q).json()["exact"] is True
        health = client.get("/api/health").json()
        assert health["index"] is None and health["exact"] is True
    ivf = GradientIndex.build(str(train), tmp_path / "ivf", metric="cosine", kind="ivf", nlist=1)
    with Explorer(explorer.model, explorer.tokenizer, train, index=ivf) as approximate:
        with TestClient(build_app(approximate)) as client:
            a = client.post("/api/attribute", json=q).json()
            assert a["exact"] is False and len(a["results"]) == 3
            assert a["expected_recall"] == ivf.expected_recall is not None
            health = client.get("/api/health").json()
            assert health["index"] == "ivf" and health["exact"] is False


def test_oversized_and_invalid_requests_are_refused_naming_the_field(served) -> None:
    url = served[0]
    with httpx.Client(base_url=url) as client:
        r = client.post("/api/attribute", content=b"x" * (10 * 1024 * 1024))
        assert r.status_code == 413 and r.json()["field"] == "body"

        def chunks():  # no Content-Length: the server counts what it reads
            for _ in range(200):
                yield b"x" * 1024

        r = client.post("/api/attribute", content=chunks())
        assert r.status_code == 413 and r.json()["field"] == "body"
        for body, field in (
            ({"prompt": "cat", "completion": "purr", "k": 10**9}, "k"),
            ({"prompt": "cat", "completion": "purr", "k": 0}, "k"),
            ({"prompt": "cat", "completion": "purr", "k": True}, "k"),
            ({"completion": "purr"}, "prompt"),
            ({"prompt": "cat", "completion": 3}, "completion"),
            ({"prompt": "cat", "completion": "purr", "extra": 1}, "extra"),
            ({"prompt": "cat", "completion": ""}, "completion"),
        ):
            r = client.post("/api/attribute", json=body)
            assert 400 <= r.status_code < 500 and r.json()["field"] == field, (body, r.text)
        r = client.post("/api/attribute", content=b"{not json")
        assert r.status_code == 400 and r.json()["field"] == "body"


def test_concurrent_clients_get_the_sequential_answers(served) -> None:
    url = served[0]
    asks = [{**q, "k": 5} for q in QUERIES] * 4

    def ask(body: dict) -> list:
        with httpx.Client(base_url=url, timeout=60) as client:
            r = client.post("/api/attribute", json=body)
            assert r.status_code == 200, r.text
            return [(x["id"], x["score"]) for x in r.json()["results"]]

    sequential = [ask(b) for b in asks]
    out: dict[int, list] = {}

    def worker(offset: int) -> None:
        for i in range(offset, len(asks), 3):
            out[i] = ask(asks[i])

    # three clients at once (without the explorer's lock their hooks mix and this fails)
    threads = [threading.Thread(target=worker, args=(o,)) for o in (0, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i] for i in range(len(asks))] == sequential


def test_page_never_contains_sample_text_and_the_token_is_required(served) -> None:
    from starlette.testclient import TestClient

    from dattri_llm.cli.serve import build_app

    url, explorer, _, _ = served
    with httpx.Client(base_url=url) as client:
        page = client.get("/").text
        assert "<textarea" in page and "textContent" in page and "innerHTML" not in page
    client = TestClient(build_app(explorer, token="s3cret"))
    assert client.get("/api/health").status_code == 401
    assert client.get("/?token=wrong").status_code == 401
    assert client.get("/?token=s3cret").status_code == 200
    auth = {"Authorization": "Bearer s3cret"}
    assert client.get("/api/health", headers=auth).status_code == 200
    r = client.post("/api/attribute", json={"prompt": "cat", "completion": "purr", "k": 2})
    assert r.status_code == 401 and r.json()["field"] == "token"


def test_a_public_host_needs_the_explicit_flag(served, capsys) -> None:
    _, _, train, _ = served
    code = main(["serve", "--model", "m", "--train", str(train), "--host", "0.0.0.0"])
    assert code == 2 and "argument --host" in capsys.readouterr().err


# ---- a real browser ----------------------------------------------------------------------
BROWSER = next(
    (b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
)


class _DevTools:
    """The DevTools protocol over ``--remote-debugging-pipe`` (fds 3 and 4), no extra package."""

    def __init__(self, tmp: Path) -> None:
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()

        def fds() -> None:  # the child reads commands on fd 3 and writes answers on fd 4
            os.dup2(to_chrome_r, 3)
            os.dup2(from_chrome_w, 4)

        cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               "--disable-extensions", f"--user-data-dir={tmp / 'profile'}",
               "--remote-debugging-pipe", "about:blank"]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, preexec_fn=fds, pass_fds=(3, 4),  # kept open after fds() set them
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf, self._id, self.attached = b"", 0, None

    def send(self, method: str, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if self.attached is not None:
            msg["sessionId"] = self.attached
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self._buf:
                chunk = os.read(self._r, 1 << 16)
                assert chunk, "the browser closed the pipe"
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                assert "error" not in reply, reply
                return reply["result"]

    def evaluate(self, expression: str):
        r = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        return r["result"].get("value")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        os.close(self._w)
        os.close(self._r)


@pytest.mark.skipif(BROWSER is None, reason="no Chromium (.ci/run installs it)")
def test_chromium_types_a_prompt_and_reads_the_ranked_texts_inert(served, tmp_path: Path) -> None:
    url, explorer, _, _ = served
    k = explorer.num_train  # every sample, the injected ones included
    cdp = _DevTools(tmp_path)
    try:
        target = cdp.send("Target.createTarget", url="about:blank")["targetId"]
        cdp.attached = cdp.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        cdp.send("Page.enable")
        cdp.send("Runtime.enable")
        cdp.send("Page.navigate", url=url + "/")
        for _ in range(200):
            if cdp.evaluate("document.readyState") == "complete" and cdp.evaluate(
                "!!document.getElementById('prompt')"
            ):
                break
            time.sleep(0.05)
        cdp.evaluate("document.getElementById('prompt').focus()")
        cdp.send("Input.insertText", text="cat kitten")
        cdp.evaluate("document.getElementById('completion').focus()")
        cdp.send("Input.insertText", text="purr meow fur")
        cdp.evaluate(f"document.getElementById('k').value = '{k}'")
        cdp.evaluate("document.getElementById('go').click()")
        for _ in range(600):
            if cdp.evaluate("document.body.dataset.done"):
                break
            time.sleep(0.05)
        shown = cdp.evaluate(
            "Array.from(document.querySelectorAll('#results li .text')).map(e => e.textContent)"
        )
        pwned = cdp.evaluate("document.body.getAttribute('data-pwned')")
        images = cdp.evaluate("document.querySelectorAll('img').length")
        scripts = cdp.evaluate("document.querySelectorAll('script').length")
    finally:
        cdp.close()
    expected = explorer.attribute("cat kitten", "purr meow fur", k=k)
    assert shown == [r.text for r in expected.results]  # the ranked documents, in order
    assert set(INJECTIONS) <= set(shown)  # the markup is shown as text ...
    assert pwned is None and images == 0 and scripts == 1  # ... and never ran
