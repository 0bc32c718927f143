"""A model whose weights decode to NaN, served: each request gets one error object naming the
file and the cause (500: the server's fault, not the client's), in its API's format, streamed
or not; no token of NaN logits is ever sent (no NUL text); /health says so; the engine keeps
serving."""
from __future__ import annotations

import json

import pytest

from helpers import poison

fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def nan_parts(tiny_model, tmp_path_factory):
    from loaders import open_model
    from loaders.chat_template import ChatTemplate
    from loaders.tokenizer import Tokenizer
    from moe_offload import build_model
    path = poison(tiny_model, tmp_path_factory.mktemp("nan") / "nan.gguf", "output_norm.weight")
    lm = open_model(path)
    return (path, build_model(lm, "cpu"), Tokenizer.from_metadata(lm.metadata, str(path)),
            ChatTemplate.from_metadata(lm.metadata, str(path)))


def _client(nan_parts, batch):
    from freetoken_patch.server.app import Served, create_app
    from freetoken_patch.server.engine import Engine
    from freetoken_patch.server.metrics import Metrics
    path, model, tok, tmpl = nan_parts
    metrics = Metrics()
    eng = Engine(model, tok, 256, metrics=metrics, batch=batch, source=str(path))
    assert eng.mode == ("batched" if batch is None else "interleaved")
    return TestClient(create_app(Served(eng, tok, tmpl, "nan", 256, None, metrics)))


@pytest.mark.parametrize("batch", [None, False], ids=["batched", "interleaved"])
def test_each_request_gets_the_cause_and_health_says_so(nan_parts, batch):
    path = nan_parts[0]
    cause = f"{path}: the logits at position "
    with _client(nan_parts, batch) as c:
        assert c.get("/health").json()["status"] == "ok"
        for temp in (0, 0.8):
            r = c.post("/v1/chat/completions", json={**CHAT, "temperature": temp})
            assert r.status_code == 500
            err = r.json()["error"]
            assert err["type"] == "server_error" and err["message"].startswith(cause)
            assert "corrupt or stored as the wrong type" in err["message"]
        r = c.post("/v1/chat/completions", json={**CHAT, "stream": True, "temperature": 0})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1]["error"]["message"].startswith(cause)
        text = "".join(e["choices"][0]["delta"].get("content") or ""
                       for e in events if "choices" in e)
        assert text == ""                                  # not a token of it, no NUL
        r = c.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4, "stream": True})
        assert "\\u0000" not in r.text and '"text": "' not in r.text.replace('"text": ""', "")
        r = c.post("/v1/messages", json={"model": "nan", "max_tokens": 8, "stream": True,
                                         "messages": [{"role": "user", "content": "hi"}]})
        assert "event: error" in r.text and cause in r.text and "content_block_delta" not in r.text
        r = c.post("/v1/messages", json={"model": "nan", "max_tokens": 8,
                                         "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 500 and r.json()["type"] == "error"
        assert r.json()["error"]["message"].startswith(cause)
        h = c.get("/health").json()
        assert h["status"] == "degraded" and h["faults"]["non_finite_logits"] == 6
        assert h["faults"]["last"].startswith(cause)
