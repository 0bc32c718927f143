"""The server on a backend whose States keep a q8_0 KV (the tiny model, CPU): greedy replies
are generate()'s on a fresh q8_0 State, and a follow-up reuses the cached prefix (quantized rows
written once, read again) with the same reply as a fresh prefill."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from moe_offload import PlainBackend, SamplingParams, generate  # noqa: E402

MSGS = [{"role": "user", "content": "Tell me about the sea."}]


def _ids(tok, tmpl, messages):
    return tok.encode(tmpl.render(messages, add_generation_prompt=True, bos_token=tok.bos_token,
                                  eos_token=tok.eos_token), parse_special=True)


def test_q8_0_kv_through_the_server_with_prefix_reuse(tiny_parts, kit):
    model, tok, tmpl = tiny_parts
    backend = PlainBackend(model, None, 256, "q8_0")
    served = kit.make_served((backend, tok, tmpl))
    with kit.live(served) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        first = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3,
                                               temperature=0)
        follow = MSGS + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And the mountains?"}]
        r = client.chat.completions.create(model="tiny", messages=follow, max_tokens=4,
                                           temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    st = backend.new_state(1, 256)
    assert st.kv_type.name == "q8_0"
    *toks, done = generate(backend, st, _ids(tok, tmpl, follow),
                           SamplingParams(temperature=0, max_tokens=4), tokenizer=tok)
    assert r.choices[0].message.content == ("".join(e.text for e in toks) + done.text).strip()
