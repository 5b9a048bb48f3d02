"""``dattri-llm serve --model MODEL --train STORE``: an attribution explorer over HTTP."""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import os
import secrets
import sys
from typing import Any

from dattri_llm.cli._common import HelpFormatter, UsageError

DESCRIPTION = """Serve a web page and a JSON API that attribute a prompt (and a completion, or
the one the model generates greedily) to the training samples of a store written by dattri-llm
capture: the query's gradient is computed live with MODEL, exactly as capture computes a
sample's, and the top-k training samples are ranked as dattri-llm attribute ranks them.

  GET  /                 the page: a prompt box, an optional completion, the ranked samples
  POST /api/attribute    {"prompt": str, "completion": str | null, "k": int}
                         -> {"completion", "method", "elapsed_ms", "exact",
                             "expected_recall", "results": [{"rank", "id", "score", "text"}]}
  GET  /api/health       {"status": "ok", "method", "train_samples", "index", "exact"}
  GET  /api/sample/ID    {"id", "text"} of one training sample

A store of more than 500 samples or 1e7 numbers (samples x numbers per sample) is searched
through an index (--index auto, the default): built on the first start into STORE.index/ (a
flat exact index while small, IVF with exact re-ranking when large) and reopened by later
starts while the store is unchanged. Answers through an IVF or HNSW index carry "exact":
false. --index none scans the store for every query; --index DIR searches an index built by
dattri-llm index build.

Errors are JSON {"error": message, "field": name} with a 4xx status. The server binds
127.0.0.1; another --host needs --allow-remote, and then every request must carry the token
(header "Authorization: Bearer TOKEN", or ?token=TOKEN on the page's address). One query is
computed at a time; the store is only read. Needs the serve extra: pip install
"dattri_llm[serve]"."""

#: The largest request body accepted, in bytes.
MAX_BODY = 64 * 1024


def add_parser(sub: Any) -> None:
    """Register the command."""
    p = sub.add_parser(
        "serve",
        help="an attribution explorer (web page + JSON API) over a captured store",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", required=True, help="the model directory the store was captured from")
    p.add_argument(
        "--train", required=True, metavar="STORE", help="the store of dattri-llm capture"
    )
    p.add_argument(
        "--index",
        metavar="INDEX",
        default="auto",
        help="auto: scan a small store, index a large one (built once, kept in STORE.index/); "
        "none: scan; or a dattri-llm index directory over STORE",
    )
    p.add_argument("--method", choices=("grad-cos", "grad-dot"), default="grad-cos")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind")
    p.add_argument("--port", type=int, default=8000, help="the port (0: any free port)")
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a --host other than a loopback address (a token is then required)",
    )
    p.add_argument(
        "--token",
        default=None,
        help="the token requests must carry (default with --allow-remote: $DATTRI_LLM_TOKEN, "
        "else a random one, printed)",
    )
    p.add_argument("--max-k", type=int, default=100, help="the largest k a request may ask")
    p.add_argument("--max-new-tokens", type=int, default=32, help="length of a generated answer")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="the model's dtype (default: the capture's)")  # fmt: skip
    p.add_argument("--device", default="cpu", help="torch device of the model")
    p.set_defaults(run=run)


def build_parser_defaults(**values: Any) -> argparse.Namespace:
    """The command's options with their defaults, updated with ``values`` (``demo --serve``)."""
    parser = argparse.ArgumentParser(add_help=False)
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args(["serve", "--model", "", "--train", ""])
    for name, value in values.items():
        setattr(args, name, value)
    return args


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _BadRequest(Exception):
    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.field, self.status = field, status


def _parse(body: bytes, max_k: int) -> tuple[str, str | None, int]:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _BadRequest("body", "the body is not valid JSON.") from None
    if not isinstance(data, dict):
        raise _BadRequest("body", "the body must be a JSON object.")
    unknown = sorted(set(data) - {"prompt", "completion", "k"})
    if unknown:
        raise _BadRequest(unknown[0], f"unknown field {unknown[0]!r} (prompt, completion, k).")
    prompt = data.get("prompt")
    if not isinstance(prompt, str):
        raise _BadRequest("prompt", "prompt must be a string.")
    completion = data.get("completion")
    if completion is not None and not isinstance(completion, str):
        raise _BadRequest("completion", "completion must be a string or null.")
    k = data.get("k", 10)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= max_k:
        raise _BadRequest("k", f"k must be an integer from 1 to {max_k}, got {k!r}.")
    return prompt, completion, k


def answer_json(result: Any) -> dict[str, Any]:
    """The JSON object ``POST /api/attribute`` answers for an :class:`~dattri_llm.Attribution`."""
    return {
        "completion": result.completion,
        "generated": result.generated,
        "method": result.method,
        "query_id": result.query_id,
        "elapsed_ms": round(result.elapsed_ms, 3),
        "exact": result.exact,
        "expected_recall": result.expected_recall,
        "results": [
            {"rank": r.rank, "id": r.id, "score": r.score, "text": r.text} for r in result.results
        ],
    }


def build_app(
    explorer: Any, *, token: str | None = None, max_k: int = 100, max_body: int = MAX_BODY
) -> Any:
    """The Starlette application serving ``explorer`` (see the command's description).

    Args:
        explorer: A :class:`~dattri_llm.Explorer`.
        token: When set, every request must carry it.
        max_k: The largest ``k`` a request may ask.
        max_body: The largest request body, in bytes.
    """
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse
    from starlette.routing import Route

    def error(field: str, message: str, status: int = 400) -> JSONResponse:
        return JSONResponse({"error": message, "field": field}, status_code=status)

    def authorized(request: Request) -> bool:
        if token is None:
            return True
        given = request.query_params.get("token", "")
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        return hmac.compare_digest(given.encode(), token.encode())

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body):
            raise _BadRequest("body", f"the body is larger than {max_body} bytes.", 413)
        body = b""
        async for chunk in request.stream():  # also bounds a body sent without a length
            body += chunk
            if len(body) > max_body:
                raise _BadRequest("body", f"the body is larger than {max_body} bytes.", 413)
        return body

    async def page(request: Request) -> HTMLResponse:
        return HTMLResponse(PAGE.replace("__MAX_K__", str(max_k)))

    async def attribute(request: Request) -> JSONResponse:
        try:
            prompt, completion, k = _parse(await read_body(request), max_k)
            result = await run_in_threadpool(explorer.attribute, prompt, completion, k)
        except _BadRequest as e:
            return error(e.field, str(e), e.status)
        except ValueError as e:  # e.g. a completion with no token to predict
            msg = str(e)
            return error(msg.split(":", 1)[0] if ":" in msg[:12] else "prompt", msg, 422)
        return JSONResponse(answer_json(result))

    async def health(request: Request) -> JSONResponse:
        index = getattr(explorer, "index", None)
        return JSONResponse(
            {
                "status": "ok",
                "method": explorer.method_name,
                "train_samples": explorer.num_train,
                "index": None if index is None else index.kind,
                "exact": getattr(explorer, "exact", True),
            }
        )

    async def sample(request: Request) -> JSONResponse:
        sid = request.path_params["id"]
        text = explorer.sample(sid)
        if text is None:
            return error("id", f"no training sample with id {sid[:80]!r}.", 404)
        return JSONResponse({"id": sid, "text": text})

    async def guard(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            if not authorized(request):
                await error("token", "a valid token is required.", 401)(scope, receive, send)
                return
        await inner(scope, receive, send)

    inner = Starlette(
        routes=[
            Route("/", page),
            Route("/api/attribute", attribute, methods=["POST"]),
            Route("/api/health", health),
            Route("/api/sample/{id}", sample),
        ]
    )
    return guard


def run(args: argparse.Namespace) -> int:
    """Run the command."""
    try:
        import uvicorn
    except ImportError:
        raise UsageError(
            "serve", 'the explorer needs the serve extra: pip install "dattri_llm[serve]"'
        ) from None
    from dattri_llm.attribution.explorer import Explorer
    from dattri_llm.cli.capture import load_model
    from dattri_llm.gradient.causal_lm import read_settings

    token = args.token
    if not _is_loopback(args.host):
        if not args.allow_remote:
            raise UsageError(
                "--host",
                f"{args.host!r} is not a loopback address: anyone who reaches it could query "
                "the model and read the corpus. Add --allow-remote (a token is then required).",
            )
        token = token or os.environ.get("DATTRI_LLM_TOKEN") or secrets.token_urlsafe(24)
    if args.max_k < 1:
        raise UsageError("--max-k", f"must be >= 1, got {args.max_k}.")
    if not os.path.isdir(args.train):
        raise UsageError("--train", f"{args.train!r} is not a directory (a capture's --out).")
    settings = read_settings(args.train)
    if settings is None:
        raise UsageError("--train", f"{args.train!r} was not written by dattri-llm capture.")
    model, tokenizer = load_model(args.model, args.dtype or settings.dtype, args.device)
    explorer = Explorer(
        model,
        tokenizer,
        args.train,
        method=args.method,
        index=None if args.index == "none" else args.index,
        max_new_tokens=args.max_new_tokens,
    )
    app = build_app(explorer, token=token, max_k=args.max_k)
    where = f"http://{args.host}:{args.port}/"
    how = "store scan" if explorer.index is None else f"{explorer.index.kind} index"
    print(f"serving {explorer.num_train} training samples ({args.method}, {how}) on {where}")
    if token is not None:
        print(f"requests must carry the token: {where}?token={token}", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


# The page builds every text with textContent: nothing from a sample is ever parsed as HTML.
PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>dattri-llm explorer</title>
<style>
body{font:15px/1.45 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
textarea{width:100%;font:inherit;box-sizing:border-box}
#results li{margin:.5rem 0;padding:.4rem .6rem;background:#f4f6f8;border-radius:4px}
.score{font-family:monospace;color:#075;margin-right:.6rem}
.text{white-space:pre-wrap}
#error{color:#a00}
</style></head>
<body>
<h1>Which training samples does this answer come from?</h1>
<form id="ask">
<label>Prompt<br><textarea id="prompt" rows="3"></textarea></label>
<label>Completion (empty: the model's own answer)<br>
<textarea id="completion" rows="2"></textarea></label>
<label>k <input id="k" type="number" min="1" max="__MAX_K__" value="10"></label>
<button id="go" type="submit">Attribute</button>
</form>
<p id="error"></p>
<p id="answer"></p>
<ol id="results"></ol>
<script>
"use strict";
const token = new URLSearchParams(location.search).get("token");
document.getElementById("ask").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const err = document.getElementById("error"), list = document.getElementById("results");
  const answer = document.getElementById("answer");
  err.textContent = ""; answer.textContent = "…"; list.replaceChildren();
  const completion = document.getElementById("completion").value;
  const body = {prompt: document.getElementById("prompt").value,
                completion: completion === "" ? null : completion,
                k: Number(document.getElementById("k").value)};
  const headers = {"Content-Type": "application/json"};
  if (token) headers["Authorization"] = "Bearer " + token;
  try {
    const r = await fetch("api/attribute", {method: "POST", headers, body: JSON.stringify(body)});
    const data = await r.json();
    if (!r.ok) {
      err.textContent = data.field + ": " + data.error; answer.textContent = ""; return;
    }
    answer.textContent = "completion: " + data.completion + "  (" + data.method + ", " +
      Math.round(data.elapsed_ms) + " ms" + (data.exact ? "" : ", approximate index" +
      (data.expected_recall === null ? "" : ", expected recall " + data.expected_recall)) + ")";
    for (const hit of data.results) {
      const li = document.createElement("li");
      li.className = "hit";
      li.dataset.rank = hit.rank;
      const score = document.createElement("span");
      score.className = "score";
      score.textContent = hit.score.toFixed(4);
      const text = document.createElement("span");
      text.className = "text";
      text.textContent = hit.text === null ? hit.id : hit.text;
      li.append(score, text);
      list.append(li);
    }
    document.body.dataset.done = String(data.results.length);
  } catch (e) { err.textContent = String(e); answer.textContent = ""; }
});
</script>
</body></html>
"""
