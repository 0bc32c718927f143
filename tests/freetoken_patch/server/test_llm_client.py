"""Simon Willison's `llm` CLI (a client we did not write) against the server, as its users
point it at an OpenAI-compatible endpoint: a model in extra-openai-models.yaml. A streamed
prompt, a non-streamed one with options, and `--schema` (llm sends it as response_format
json_schema), whose reply must validate whatever the tiny model's random weights say."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llm")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.fixture(scope="module")
def llm_cli(tiny_parts, kit, tmp_path_factory):
    """Runs `llm ARGS` against a live server on the tiny model: (returncode, stdout, stderr)."""
    home = tmp_path_factory.mktemp("llm")
    served = kit.make_served(tiny_parts, n_ctx=512)
    with kit.live(served) as url:
        (home / "extra-openai-models.yaml").write_text(
            f'- model_id: ftpatch\n  model_name: default\n  api_base: "{url}/v1"\n'
            "  supports_schema: true\n")
        env = {**os.environ, "LLM_USER_PATH": str(home)}

        def run(*args: str):
            r = subprocess.run([sys.executable, "-m", "llm", *args], capture_output=True,
                               text=True, env=env, timeout=120)
            return r.returncode, r.stdout, r.stderr
        yield run


def test_llm_prompts_stream_and_not(llm_cli):
    rc, out, err = llm_cli("-m", "ftpatch", "Hello there", "-o", "max_tokens", "8")
    assert rc == 0, err
    rc, out2, err = llm_cli("-m", "ftpatch", "--no-stream", "Hello there", "-o", "max_tokens",
                            "8", "-o", "temperature", "0")
    assert rc == 0, err
    rc, out3, err = llm_cli("-m", "ftpatch", "--no-stream", "Hello there", "-o", "max_tokens",
                            "8", "-o", "temperature", "0")
    assert rc == 0 and out3 == out2, err           # greedy: the same text twice
    # llm logged what the server answered: the usage it reports
    rc, logs, err = llm_cli("logs", "-n", "1", "--json")
    entry = json.loads(logs)[0]
    assert rc == 0 and entry["output_tokens"] <= 8 and entry["input_tokens"] > 0


@pytest.mark.parametrize("seed", range(2))
def test_llm_schema_replies_validate(llm_cli, seed):
    rc, out, err = llm_cli("-m", "ftpatch", "--schema", json.dumps(SCHEMA), "a person",
                           "-o", "max_tokens", "200", "-o", "seed", str(seed),
                           "-o", "temperature", "1")
    assert rc == 0, err
    jsonschema.validate(json.loads(out), SCHEMA)


def test_llm_shows_the_servers_error(llm_cli):
    rc, out, err = llm_cli("-m", "ftpatch", "x", "-o", "max_tokens", "0")
    assert rc != 0 and "max_tokens=0: give 1 or more" in err, (out, err)   # our 400, shown
