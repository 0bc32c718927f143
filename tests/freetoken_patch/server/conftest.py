"""Fixtures of the server tests: the tiny model loaded once, scripted token streams, and a
uvicorn server on 127.0.0.1 (a free port) in a background thread."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from moe_offload import DoneEvent, Timings, TokenEvent

# A Qwen3-style template: the tools as JSON lines in the system turn, tool calls and results.
TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.role == 'tool' %}<tool_response>
{{ m.content }}
</tool_response>{% else %}{{ m.content }}{% endif %}
{%- for c in m.tool_calls or [] %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


@pytest.fixture(scope="session")
def tiny_parts(tiny_model):
    """(model, tokenizer, chat template) of the tiny synthetic model, on the CPU."""
    from loaders import open_model
    from loaders.chat_template import ChatTemplate
    from loaders.tokenizer import Tokenizer
    from moe_offload import build_model
    lm = open_model(tiny_model)
    return (build_model(lm, "cpu"), Tokenizer.from_metadata(lm.metadata, str(tiny_model)),
            ChatTemplate.from_metadata(lm.metadata, str(tiny_model)))


def make_served(parts, *, n_ctx=256, parallel=4, queue=64, prefix_cache=4, api_key=None,
                generate_fn=None, template=None, model_id="tiny"):
    from freetoken_patch.server.app import Served
    from freetoken_patch.server.engine import Engine
    from freetoken_patch.server.metrics import Metrics
    model, tok, tmpl = parts
    metrics = Metrics()
    kw = {} if generate_fn is None else {"generate_fn": generate_fn}
    eng = Engine(model, tok, n_ctx, parallel=parallel, queue_size=queue,
                 prefix_cache=prefix_cache, metrics=metrics, **kw)
    return Served(eng, tok, template or tmpl, model_id, n_ctx, api_key, metrics)


@contextlib.contextmanager
def live(served, log=None, log_format="off"):
    """Serve `served` on 127.0.0.1 at a free port; yields the base URL (…/v1 is the API).
    The access log is off unless `log` (a text stream) is given."""
    import uvicorn
    from freetoken_patch.server.app import create_app
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(served, log_format="text" if log is not None and log_format == "off"
                     else log_format, log_out=log)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not th.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        th.join(30)


def scripted(texts, reason="eog", delay=0.0, log=None):
    """A generate() stand-in: yields `texts` as tokens (at most params.max_tokens), then Done.
    `texts` may be a callable prompt -> texts; `log` collects (prompt[0], i) per step."""
    def gen(model, state, prompt, params, *, tokenizer=None, history=()):
        items = texts(list(history) + list(prompt)) if callable(texts) else texts
        t = Timings(len(prompt), 0.001, 0, 0.0, 0.001)
        n = 0
        for i, s in enumerate(items):
            if n >= params.max_tokens:
                break
            if delay:
                time.sleep(delay)
            if log is not None:
                log.append((prompt[0], i))
            n += 1
            yield TokenEvent(i, s, t)
        yield DoneEvent(reason if n < params.max_tokens else "length", "", tuple(range(n)), t)
    return gen


class Script:
    """What a scripted tool-template server replies next (`reply`) and the prompts it was shown."""

    def __init__(self):
        self.reply: list[str] = []
        self.prompts: list[str] = []


@contextlib.contextmanager
def scripted_tool_server(parts):
    """A live server on the tool-calling template whose model says script.reply -> (url, script)."""
    from loaders.chat_template import ChatTemplate
    tok, script = parts[1], Script()

    def record(ids):
        script.prompts.append(tok.decode(ids))
        return script.reply

    served = make_served(parts, n_ctx=1024, template=ChatTemplate(TOOL_TEMPLATE),
                         generate_fn=scripted(record))
    with live(served) as url:
        yield url, script


@pytest.fixture(scope="session")
def kit():
    """The helpers above, for test modules (conftest is not importable under importlib mode)."""
    class Kit:
        pass
    k = Kit()
    k.make_served, k.live, k.scripted = staticmethod(make_served), staticmethod(live), \
        staticmethod(scripted)
    k.live_app = staticmethod(live)
    k.tool_template = TOOL_TEMPLATE
    k.scripted_tool_server = staticmethod(scripted_tool_server)
    return k
