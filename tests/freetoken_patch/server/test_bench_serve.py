"""`ftpatch bench serve`: the in-process server on the tiny model (JSON shape, every request
counted, prefix reuse seen in cached_tokens), and the refusals (a non-loopback --url, a bad
--concurrency) as one line each."""
from __future__ import annotations

import json

import pytest

from freetoken_patch.cli import main

pytest.importorskip("fastapi")
pytest.importorskip("httpx")


def test_own_server_levels_and_followup(tiny_model, capsys, tmp_path):
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", str(tiny_model), "--ctx", "512", "--concurrency", "1,2",
               "--requests", "2", "--max-tokens", "4", "--prompt-tokens", "64", "--json",
               "--out", str(out)])
    assert rc == 0
    cap = capsys.readouterr()
    r = json.loads(cap.out)
    assert json.loads(out.read_text()) == r
    assert r["kind"] == "ftpatch-bench-serve" and r["model"] == tiny_model.stem
    srv = r["server"]
    assert srv["mode"] == "child process" and srv["url"].startswith("http://127.0.0.1:")
    assert srv["n_ctx"] == 512 and srv["parallel"] == 4 and srv["decode"] == "batched"
    assert srv["command"][:4] == ["ftpatch", "serve", str(tiny_model), "--ctx"]
    assert isinstance(r["method"], str) and r["method"]
    assert [lv["concurrency"] for lv in r["levels"]] == [1, 2]
    for lv in r["levels"]:
        assert lv["requests"] == lv["sent"] == lv["ok"] == 2 and lv["errors"] == 0
        assert lv["skipped_time_limit"] == 0
        assert 0 < lv["completion_tokens"] <= 2 * 4
        assert lv["aggregate_decode_tps"] > 0 and lv["wall_s"] > 0
        # a reply of a few sampled tokens of the random model may have no text at all (byte
        # tokens that complete no character): it is counted apart, without a TTFT
        assert lv["ttft_s"]["n"] + lv["no_content"] == 2
        if lv["ttft_s"]["n"]:
            assert all(lv["ttft_s"][k] > 0 for k in ("p50", "p90", "p99"))
        itl = lv["inter_token_s"]
        if itl["n"]:
            assert 0 < itl["p50"] <= itl["p90"] <= itl["p99"] <= itl["max"]
        ps = lv["per_stream_decode_tps"]
        if ps["streams"]:
            assert 0 < ps["min"] <= ps["median"] <= ps["max"]
        # the server's own account of the level: its engine thread prefilled and decoded
        e = lv["engine"]
        assert e["busy_s"]["prefill"] > 0 and e["busy_s"]["decode"] > 0
        assert e["busy_s"]["generate"] == 0            # batched mode: no generate() turns
        assert sum(e["busy_s"].values()) + e["idle_s"] == pytest.approx(lv["wall_s"], abs=2e-3)
        assert e["graph_captures"] == 0                # the plain model captures no graphs
    fu = r["followup"]
    assert fu["turns"] == 2 and fu["first"]["error"] is None
    [turn] = fu["followups"]
    reuse, fresh = turn["with_reuse"], turn["without_reuse"]
    assert reuse["error"] is None and fresh["error"] is None
    assert reuse["cached_tokens"] >= fu["first"]["prompt_tokens"]
    assert fresh["cached_tokens"] == 0
    assert reuse["ttft_s"] > 0 and fresh["ttft_s"] > 0
    assert "bench serve:" in cap.err and "turn 2:" in cap.err


def test_server_flags_pass_on_and_bench_flags_stay():
    from freetoken_patch.cli.bench_serve import serve_argv
    argv = ["m.gguf", "--vram", "8GiB", "--concurrency", "1,4", "--json", "--parallel=4",
            "--out=x.json", "--requests", "8", "--no-batch", "--time-limit", "60"]
    assert serve_argv(argv) == ["m.gguf", "--vram", "8GiB", "--parallel=4", "--no-batch"]


def test_a_server_that_cannot_start_is_one_line(tmp_path, capsys):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF nonsense")
    assert main(["bench", "serve", str(bad), "--concurrency", "1", "--requests", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the server did not start (exit status" in err[0]


@pytest.mark.parametrize("url", ["http://10.1.2.3:8080", "http://example.com",
                                 "https://192.168.0.1/v1", "ftp://127.0.0.1:21"])
def test_non_loopback_url_refused(url, capsys):
    assert main(["bench", "serve", "--url", url]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ftpatch: error: --url {url}:")


def test_loopback_urls_accepted():
    from freetoken_patch.cli.bench_serve import loopback_url
    assert loopback_url("http://127.0.0.1:8080/v1") == "http://127.0.0.1:8080"
    assert loopback_url("http://127.3.0.9:1") == "http://127.3.0.9:1"
    assert loopback_url("http://localhost:8080/") == "http://localhost:8080"
    assert loopback_url("http://[::1]:8080") == "http://[::1]:8080"


@pytest.mark.parametrize("value", ["1,x", "0", "", "2,,4", "300"])
def test_bad_concurrency_refused(value, capsys):
    assert main(["bench", "serve", "--concurrency", value]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ftpatch: error: --concurrency ")


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "usage: ftpatch bench serve" in text and "examples:" in text


def test_url_mode_against_a_running_server(tiny_parts, kit, capsys):
    with kit.live(kit.make_served(tiny_parts, parallel=2)) as url:
        assert main(["bench", "serve", "--url", url + "/v1", "--concurrency", "2",
                     "--requests", "3", "--max-tokens", "3", "--turns", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["server"] == {"mode": "url", "url": url, "n_ctx": 256, "parallel": 2,
                           "decode": "batched"}
    [lv] = r["levels"]
    assert lv["sent"] == lv["ok"] == 3 and r["followup"] is None


def test_a_stream_is_timed_chunk_by_chunk():
    """_chat against a scripted SSE stream: TTFT is the first chunk with output (not the role
    chunk before it), and each later output chunk adds one gap to the inter-token latencies."""
    import asyncio
    import time

    import httpx

    from freetoken_patch.cli.bench_serve import _chat

    def chunk(delta=None, finish=None, usage=None):
        obj = {"choices": [] if usage else [{"delta": delta or {}, "finish_reason": finish}]}
        if usage:
            obj["usage"] = usage
        return f"data: {json.dumps(obj)}\n\n".encode()

    script = [(0.0, chunk({"role": "assistant"})), (0.15, chunk({"content": "a"})),
              (0.05, chunk({"content": "b"})), (0.25, chunk({"content": "c"})),
              (0.0, chunk(finish="stop")),
              (0.0, chunk(usage={"prompt_tokens": 5, "completion_tokens": 3})),
              (0.0, b"data: [DONE]\n\n")]

    async def body():
        for delay, data in script:
            await asyncio.sleep(delay)
            yield data

    async def run():
        transport = httpx.MockTransport(lambda req: httpx.Response(200, content=body()))
        async with httpx.AsyncClient(transport=transport) as client:
            return await _chat(client, "http://127.0.0.1:1", [], 4, seed=0)

    t0 = time.perf_counter()
    r = asyncio.run(run())
    assert r["error"] is None and r["completion_tokens"] == 3
    assert 0.14 <= r["ttft_s"] < time.perf_counter() - t0
    assert len(r["itl_s"]) == 2
    assert 0.04 <= r["itl_s"][0] < 0.2 and 0.24 <= r["itl_s"][1] < 0.4
