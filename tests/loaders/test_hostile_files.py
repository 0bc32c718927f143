"""Hostile inputs from the new-user findings: each gets the loaders' error (GGUFError, or its
ChatTemplateError), in one line that names the key, tensor or limit -- never a traceback, a hang
or a machine's worth of memory. Every case runs under a 10 s alarm and a 1 GiB allocation check
(hang and memory guards, not speed measurements)."""
from __future__ import annotations

import contextlib
import copy
import re
import signal
import struct
import threading
import tracemalloc

import numpy as np
import pytest

from helpers import build_gguf, rewrite
from loaders import GGUFError, StreamDecoder, Tokenizer, open_gguf, open_model
from loaders.chat_template import ChatTemplate, ChatTemplateError, TemplateLimits
from loaders.vocab import builtin_vocab

A = "qwen35moe."


@contextlib.contextmanager
def bounded(seconds: int = 10, memory: int = 1 << 30):
    """Fails the test if the body runs `seconds` or allocates more than `memory` at its peak."""
    def on_alarm(*_):
        raise AssertionError(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    tracemalloc.start()
    try:
        yield
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert peak < memory, f"peak allocation {peak >> 20} MiB"


def refused(call, pattern: str, cls: type = GGUFError) -> str:
    with bounded(), pytest.raises(cls) as ei:
        call()
    msg = str(ei.value)
    assert "\n" not in msg, msg
    assert re.search(pattern, msg), msg
    return msg


def _s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


# -- the file format -----------------------------------------------------------------------------

def test_vocabulary_string_length_2_63(tmp_path):
    # tokens = ["a", <length 2**63>]: the reader must not believe the length
    body = _s(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + _s(b"a")
    body += struct.pack("<Q", 2**63) + b"bc"
    path = tmp_path / "v.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body)
    refused(lambda: open_gguf(path), r"v\.gguf: truncated header inside a string array .*"
                                     r"'tokenizer\.ggml\.tokens'")


@pytest.mark.parametrize("length", [2**63, 2**64 - 1, 2**62])
def test_key_and_value_string_lengths(tmp_path, length):
    path = tmp_path / "k.gguf"
    pad = b"\0" * 64
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", length) + pad)
    refused(lambda: open_gguf(path), "truncated header: needs .* metadata key 1 of 1")
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _s(b"general.name") +
                     struct.pack("<IQ", 8, length) + pad)
    refused(lambda: open_gguf(path), "truncated header: .*'general.name'")


@pytest.mark.parametrize("etype", [4, 8, 9])
def test_array_counts_past_the_file(tmp_path, etype):
    path = tmp_path / "a.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _s(b"big") +
                     struct.pack("<IIQ", 9, etype, 2**62) + b"\0" * 64)
    refused(lambda: open_gguf(path), "(truncated|cannot fit).*'big'")


def test_arrays_nested_too_deep(tmp_path):
    nest = struct.pack("<IQ", 9, 1) * 40 + struct.pack("<IQ", 4, 0)
    path = tmp_path / "n.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _s(b"deep") + struct.pack("<I", 9) + nest)
    refused(lambda: open_gguf(path), "nested more than 8 deep.*'deep'")


def test_counts_claiming_more_than_the_file(tmp_path):
    path = tmp_path / "c.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**63, 2**63) + b"\0" * 64)
    refused(lambda: open_gguf(path), "corrupt header: claims 9223372036854775808 tensors")


def _tensor_file(tmp_path, ne, type_id=0, offset=0, data=b"\0" * 64, alignment=None):
    kv = [("general.architecture", 8, "x", None)]
    if alignment is not None:
        kv.append(("general.alignment", alignment[0], alignment[1], None))
    raw = build_gguf(kv, [("t", ne, type_id, data)], offsets=[offset] if offset else None)
    path = tmp_path / "t.gguf"
    path.write_bytes(raw)
    return path


@pytest.mark.parametrize("ne", [(2**32, 2**32), (2**62, 4), (2**63 + 1,), (2**64 - 1, 2, 0)])
def test_dims_whose_product_wraps_int64(tmp_path, ne):
    path = _tensor_file(tmp_path, ne)
    refused(lambda: open_gguf(path), r"tensor 't' has dimensions \[.*\], more elements than int64")


def test_tensor_bytes_offsets_and_dims(tmp_path):
    refused(lambda: open_gguf(_tensor_file(tmp_path, (1 << 20,))), "tensor 't' data .* runs past")
    refused(lambda: open_gguf(_tensor_file(tmp_path, (4,), offset=2**64 - 32)),
            "tensor 't' data .* runs past")
    refused(lambda: open_gguf(_tensor_file(tmp_path, (4,), offset=3)), "'t' data offset 3 is not")
    refused(lambda: open_gguf(_tensor_file(tmp_path, tuple([1] * 9))), "'t' claims 9 dimensions")
    refused(lambda: open_gguf(_tensor_file(tmp_path, (4,), type_id=2**32 - 1)),
            "'t' has unknown ggml type id 4294967295")


@pytest.mark.parametrize("alignment", [(4, 0), (4, 3), (8, "32"), (7, True), (10, 2**40),
                                       (6, 32.0)])
def test_bad_alignment(tmp_path, alignment):
    refused(lambda: open_gguf(_tensor_file(tmp_path, (4,), alignment=alignment)),
            "general.alignment")


def test_split_keys_of_the_wrong_type(tiny_model, tmp_path):
    p = rewrite(tiny_model, tmp_path / "s.gguf", metadata={"split.count": ("str", "1")})
    refused(lambda: open_gguf(p), "split.count is a str, not an integer")


# -- the architecture's config -------------------------------------------------------------------

def _model(tiny_model, tmp_path, drop=(), **md):
    meta = {k.replace("__", ".").replace("_dot_", "."): v for k, v in md.items()}
    return rewrite(tiny_model, tmp_path / "m.gguf", metadata=meta, drop_keys=drop)


@pytest.mark.parametrize("key,value,pattern", [
    ("block_count", ("str", "4"), r"qwen35moe\.block_count = '4' is a string, expected an integer"),
    ("block_count", ("f32", 4.0), r"qwen35moe\.block_count = 4\.0 is a float, expected an integer"),
    ("block_count", ("u32", 0), r"qwen35moe\.block_count = 0 is out of range"),
    ("block_count", ("u64", 2**40), r"qwen35moe\.block_count = 1099511627776 is out of range"),
    ("attention.head_count", ("u32", 0), r"qwen35moe\.attention\.head_count = 0 is out of range"),
    ("attention.head_count_kv", ("u32", 0), r"head_count_kv = 0 is out of range"),
    ("attention.head_count_kv", ("u32", 3), r"head_count = 2 is not a multiple of .*head_count_kv = 3"),
    ("ssm.time_step_rank", ("u32", 0), r"qwen35moe\.ssm\.time_step_rank = 0 is out of range"),
    ("ssm.time_step_rank", ("u32", 3), r"ssm\.inner_size = 256 is not a multiple of .*time_step_rank = 3"),
    ("ssm.group_count", ("u32", 0), r"qwen35moe\.ssm\.group_count = 0 is out of range"),
    ("expert_used_count", ("u32", 17), r"qwen35moe\.expert_used_count = 17 exceeds "
                                       r"qwen35moe\.expert_count = 16"),
    ("expert_used_count", ("u32", 0), r"qwen35moe\.expert_used_count = 0 is out of range"),
    ("expert_count", ("arr", [16, 16, 8, 16], "u32"), r"expert_count varies per layer"),
    ("expert_count", ("arr", [16, 16], "u32"), r"expert_count has 2 per-layer entries, expected "
                                               r"qwen35moe\.block_count = 4"),
    ("expert_count", ("arr", ["16"], "str"), r"expert_count is an array of strings"),
    ("attention.key_length", ("u32", 64), r"key_length = 64 differs from .*value_length = 128"),
    ("rope.dimension_count", ("u32", 129), r"rope\.dimension_count = 129 must be even and at most"),
    ("rope.dimension_sections", ("str", "x"), r"dimension_sections is a string, expected an array"),
    ("rope.dimension_sections", ("arr", [1, 2, 3, 4, 5], "i32"), r"dimension_sections = \[1, 2, 3, 4, 5\]"),
    ("attention.layer_norm_rms_epsilon", ("f32", float("nan")), r"rms_epsilon = nan is out of range"),
    ("attention.layer_norm_rms_epsilon", ("str", "1e-6"), r"rms_epsilon = '1e-6' is a string"),
    ("attention.recurrent_layers", ("arr", [True, False], "bool"),
     r"recurrent_layers has 2 entries, expected qwen35moe\.block_count = 4"),
    ("nextn_predict_layers", ("u32", 4), r"block_count = 4 leaves no trunk layers"),
    ("context_length", ("i32", -1), r"context_length = -1 is out of range"),
])
def test_config_keys_checked(tiny_model, tmp_path, key, value, pattern):
    p = rewrite(tiny_model, tmp_path / "m.gguf", metadata={A + key: value})
    msg = refused(lambda: open_model(p, strict=False), pattern)
    assert msg.startswith(f"{p}: "), msg    # the file is named


def test_full_attention_interval_zero(tiny_model, tmp_path):
    p = rewrite(tiny_model, tmp_path / "m.gguf", drop_keys=[A + "attention.recurrent_layers"],
                metadata={A + "full_attention_interval": ("u32", 0)})
    refused(lambda: open_model(p, strict=False),
            r"qwen35moe\.full_attention_interval = 0 is out of range")


def test_expert_used_count_message_as_in_the_issue(tiny_model, tmp_path):
    p = rewrite(tiny_model, tmp_path / "model.gguf", metadata={
        A + "expert_count": ("u32", 8), A + "expert_used_count": ("u32", 12)})
    refused(lambda: open_model(p, strict=False),
            r"^.*model\.gguf: qwen35moe\.expert_used_count = 12 exceeds qwen35moe\.expert_count = 8$")


def test_missing_architecture_names_file_and_key(tiny_model, tmp_path):
    p = rewrite(tiny_model, tmp_path / "m.gguf", drop_keys=["general.architecture"])
    msg = refused(lambda: open_model(p), r"m\.gguf: metadata key 'general\.architecture' is missing")
    assert "None" not in msg
    p = rewrite(tiny_model, tmp_path / "n.gguf", metadata={"general.architecture": ("u32", 7)})
    refused(lambda: open_model(p), r"general\.architecture is not text")


def test_token_embd_of_wrong_rank(tiny_model, tmp_path):
    p = rewrite(tiny_model, tmp_path / "m.gguf", replace={"token_embd.weight": ((4,), 0, b"\0" * 16)})
    refused(lambda: open_model(p, strict=False), r"tensor 'token_embd.weight' has shape \[4\]")


def test_more_tokens_than_embedding_rows_is_a_problem(tiny_model, tmp_path):
    toks = open_gguf(tiny_model).metadata["tokenizer.ggml.tokens"]
    types = open_gguf(tiny_model).metadata["tokenizer.ggml.token_type"].tolist()
    p = rewrite(tiny_model, tmp_path / "m.gguf", metadata={
        "tokenizer.ggml.tokens": ("arr", toks + ["extra"], "str"),
        "tokenizer.ggml.token_type": ("arr", types + [1], "i32")})
    m = open_model(p, strict=False)
    assert any("tokenizer.ggml.tokens has" in x and "token_embd.weight" in x for x in m.problems)


# -- the vocabulary ------------------------------------------------------------------------------

@pytest.mark.parametrize("meta,pattern", [
    ({"tokenizer.ggml.token_type": ("arr", [1] * 5000, "i32")},
     r"tokenizer\.ggml\.token_type has 5,000 entries but tokenizer\.ggml\.tokens has"),
    ({"tokenizer.ggml.token_type": ("arr", ["1"], "str")}, r"token_type is an array of strings"),
    ({"tokenizer.ggml.scores": ("arr", [0.0], "f32")}, r"tokenizer\.ggml\.scores has 1 entries"),
    ({"tokenizer.ggml.tokens": ("arr", [1, 2], "u32")}, r"tokenizer\.ggml\.tokens is an array of uint32"),
    ({"tokenizer.ggml.tokens": ("arr", [], "str")}, r"tokenizer\.ggml\.tokens is empty"),
    ({"tokenizer.ggml.merges": ("arr", [1], "i32")}, r"tokenizer\.ggml\.merges is an array of int32"),
    ({"tokenizer.ggml.merges": ("arr", ["abc"], "str")}, r"tokenizer\.ggml\.merges\[0\] = 'abc'"),
    ({"tokenizer.ggml.eos_token_id": ("str", "7")}, r"tokenizer\.ggml\.eos_token_id is a str"),
    ({"tokenizer.ggml.add_bos_token": ("u32", 7)}, r"tokenizer\.ggml\.add_bos_token = 7 is not a bool"),
    ({"tokenizer.ggml.pre": ("u32", 7)}, r"tokenizer\.ggml\.pre is a int"),
    ({"tokenizer.ggml.model": ("str", "llama")}, r"tokenizer\.ggml\.model = 'llama' is not supported"),
    ({"tokenizer.chat_template": ("u32", 7)}, r"tokenizer\.chat_template is a int, not text"),
])
def test_vocabulary_tables_checked(tiny_model, tmp_path, meta, pattern):
    from loaders.chat_template import ChatTemplate
    p = rewrite(tiny_model, tmp_path / "v.gguf", metadata=meta)
    md = open_gguf(p).metadata

    def build():
        Tokenizer.from_metadata(md, str(p))
        ChatTemplate.from_metadata(md, str(p))
    msg = refused(build, pattern)
    assert msg.startswith(f"{p}: "), msg          # every message names the file


def test_token_list_shorter_than_token_types(tmp_path):
    # the finding: an IndexError while building the special-token table
    v = builtin_vocab()
    md = {"tokenizer.ggml.tokens": v.tokens[:100], "tokenizer.ggml.token_type": v.token_types,
          "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35"}
    refused(lambda: Tokenizer.from_metadata(md, "short.gguf"),
            r"short\.gguf: tokenizer\.ggml\.token_type has .* entries but tokenizer\.ggml\.tokens "
            r"has 100")


def test_a_vocabulary_of_special_tokens_builds_quickly():
    # 150k control tokens: a regex alternation of them took seconds to compile
    n = 150_000
    md = {"tokenizer.ggml.tokens": [f"<t{i}>" for i in range(n)] + builtin_vocab().tokens,
          "tokenizer.ggml.token_type": np.array([3] * n + builtin_vocab().token_types.tolist(),
                                                np.int32),
          "tokenizer.ggml.pre": "qwen35"}
    with bounded():
        tok = Tokenizer.from_metadata(md)
        assert tok.encode("a<t7><t149999>b", parse_special=True)[1:3] == [7, 149999]


def test_out_of_range_special_ids_are_ignored_as_llama_cpp_does():
    v = builtin_vocab()
    md = {"tokenizer.ggml.tokens": v.tokens, "tokenizer.ggml.token_type": v.token_types,
          "tokenizer.ggml.merges": v.merges, "tokenizer.ggml.pre": "qwen35",
          "tokenizer.ggml.eos_token_id": 10**9, "tokenizer.ggml.bos_token_id": len(v.tokens)}
    tok = Tokenizer.from_metadata(md)
    assert tok.eos_id is None and tok.bos_id is None and tok.bos_token == ""


# -- text that is not valid UTF-8 ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_vocab(builtin_vocab())


@pytest.mark.parametrize("data", [
    b"\xff\xfe\xfd", b"ok \xc3(", b"\xed\xa0\x80 lone surrogate (CESU)", b"\xf4\x90\x80\x80",
    b"\x00\x01\x02\x1b[31mred\x7f", bytes(range(256)), b"caf\xc3\xa9 \xe6\x97", b"",
])
def test_encode_accepts_any_bytes(tok, data):
    with bounded():
        ids = tok.encode(data)
        assert b"".join(map(tok.token_bytes, ids)) == data
        assert tok.encode(data, parse_special=True, add_special=True) is not None


def test_lone_surrogates_encode_as_their_bytes(tok):
    raw = b"ab\xff\x80cd\xe9"
    text = raw.decode("utf-8", "surrogateescape")    # as os.fsdecode / sys.stdin may give it
    assert b"".join(map(tok.token_bytes, tok.encode(text))) == raw
    ids = tok.encode("x\ud800y\udbff")               # surrogates surrogateescape never makes
    assert b"".join(map(tok.token_bytes, ids)) == "x\ud800y\udbff".encode("utf-8", "surrogatepass")
    assert tok.encode("\x00") == tok.encode(b"\x00")


def test_encode_refuses_other_types(tok):
    refused(lambda: tok.encode(12), r"encode\(\) takes text \(str or bytes\), not int")


def test_decoding_never_emits_half_a_character(tok):
    ids = tok.encode("é😀日".encode() + b"\xff" + "ü".encode())
    dec = StreamDecoder(tok)
    out = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(out) == "é😀日\ufffdü"
    assert all(not (len(s) == 1 and 0xD800 <= ord(s) < 0xE000) for s in out)


# -- chat templates ------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "hi"}]
HINT = r"pass --chat-template FILE to use another template$"


@pytest.mark.parametrize("src,pattern", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     r"rendering took longer than its 2 s limit at template line 1"),
    ("{% for i in range(100000) %}{% for j in range(100000) if j < 0 %}{% endfor %}{% endfor %}",
     r"longer than its 2 s limit"),
    ("{{ 'x' * 10**8 }}", r"a str repeated 100,000,000 times is larger than the 4,194,304-character"),
    ("{% set s = 'x' * 4000000 %}{% for i in range(100) %}{{ s }}{% endfor %}",
     r"(output limit|more than 33,554,432 characters)"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", r"nest deeper than 64 calls"),
    ("{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}", r"nest deeper than 64 calls"),
    ("{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", r"nests blocks or expressions too deeply"),
    ("".join("{%% for i%d in [1] %%}" % i for i in range(40)) + "{% endfor %}" * 40,
     r"nests blocks or expressions too deeply"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}", r"a '~' concatenation is larger"),
    ("{% set ns = namespace(s=[1]) %}{% for i in range(64) %}{% set ns.s = [ns.s, ns.s] %}"
     "{% endfor %}{{ ns.s }}", r"a collection is larger"),
    ("{{ 'x'|center(10**9) }}", r"'center' argument of 1,000,000,000"),
    ("{{ '%999999999d' % 1 }}", r"'%' format width of 999999999"),
    ("{{ '{:>{}}'.format(1, 999999999) }}", r"str.format width of 999999999"),
    ("{{ 7 ** 1000000 }}", r"7 \*\* 1000000 is larger"),
    ("{{ ('x' * 100000)|replace('x', 'x' * 1000) }}", r"the result of 'replace'"),
    ("{{ lipsum(10**6) }}", r"failed at template line 1: UndefinedError"),
    ("{{ 'a'|wordwrap(5) }}", r"syntax error .*No filter named 'wordwrap'"),
    ("x" * 300_000, r"300,000 characters, over the 65,536-character limit"),
    ("{% for x in range(100000)|map('string')|map('string')|map('string') %}"
     "{% for y in range(100000)|map('string')|select %}{% endfor %}{% endfor %}", r"2 s limit"),
])
def test_hostile_templates(src, pattern):
    messages = copy.deepcopy(MESSAGES)
    msg = refused(lambda: ChatTemplate(src).render(messages), pattern, ChatTemplateError)
    assert re.search(HINT, msg), msg
    assert messages == MESSAGES


def test_template_limits_hold_in_worker_threads():
    # a server renders from worker threads: no signals, the same limits
    src = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    tpl = ChatTemplate(src, limits=TemplateLimits(seconds=0.3))
    errors = []

    def work():
        try:
            tpl.render(MESSAGES)
        except ChatTemplateError as e:
            errors.append(str(e))
    with bounded():
        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(errors) == 3 and all("0.3 s limit" in e for e in errors)


def test_template_from_a_file_names_the_file(tiny_model, tmp_path):
    p = rewrite(tiny_model, tmp_path / "t.gguf", metadata={
        "tokenizer.chat_template": ("str", "{{ 'x' * 10**9 }}")})
    tpl = ChatTemplate.from_gguf(p)
    refused(lambda: tpl.render(MESSAGES),
            rf"^{re.escape(str(p))}: tokenizer\.chat_template: a str repeated .*{HINT}",
            ChatTemplateError)


def test_limits_leave_real_templates_alone():
    src = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content|trim }}"
           "{{ '<|im_end|>\\n' }}{% endfor %}{{ (messages|map(attribute='content')|join(' '))|length }}")
    big = [{"role": "user", "content": "word " * 200_000}] * 3     # 3 MB of prompt
    out = ChatTemplate(src).render(big)
    assert len(out) > 3_000_000 and np.isfinite(len(out))


# What tool-calling templates do (recursive schema macros, "    " * depth, selectattr / map /
# unique, tuple unpacking, namespace lists, printf and str.format, caller): the checks must
# leave the output exactly as Jinja's plain sandbox renders it.
CONSTRUCTS = r'''{%- macro conv(t) -%}{%- if t == "integer" or t == "float" -%}{{ "number" }}{%- else -%}{{ t }}{%- endif -%}{%- endmacro -%}
{%- macro ptype(param) -%}
    {%- set param_type = "any" -%}
    {%- if "type" in param -%}
        {%- set raw = param["type"] -%}
        {%- if raw is iterable and raw is not string -%}{%- set param_type = raw | join(" | ") -%}{%- else -%}{%- set param_type = raw -%}{%- endif -%}
        {{ conv(param_type) }}
    {%- elif "oneOf" in param -%}
        {%- set one = param["oneOf"]|selectattr("type", "defined")|list -%}
        {%- set one = one|map(attribute="type")|unique|list -%}
        {{ conv(one | join(" | ")) }}
    {%- endif -%}
{%- endmacro -%}
{%- macro ts(properties, required, depth=0) -%}
    {%- for name, param in properties.items() -%}
        {%- set offset = "    " * depth -%}
        {%- set decl = name ~ ("?" if name not in required else "") -%}
        {%- set t = ptype(param) -%}
        {%- if t == "object" -%}
            {{ "\n" + offset + decl + ": {" }}{{- ts(param.get("properties", {}), param.get("required", []), depth + 1) -}}{{- "\n" + offset + "}," }}
        {%- else -%}
            {%- for field, fname in [("maximum", "Maximum"), ("minimum", "Minimum")] -%}
                {%- if field in param -%}{{ " " + fname ~ "=" ~ param[field] }}{%- endif -%}
            {%- endfor -%}
            {{ "\n" + offset + decl + ": " + t + "," }}
            {%- if "examples" in param %}{{ "// " + param["examples"]|string|replace("'", '"') }}{% endif -%}
        {%- endif -%}
    {%- endfor -%}
{%- endmacro -%}
{%- set ns = namespace(n=0, names=[]) -%}
{%- for tool in tools or [] -%}
  {%- set f = tool.function -%}
  {%- set ns.n = ns.n + 1 -%}
  {%- set ns.names = ns.names + [f.name] -%}
  // {{ f.description }}
type {{ f.name }} = (_: {{ '{' }}{{ ts(f.parameters.properties, f.parameters.required or []) }}
}) => any;
{% endfor -%}
{{ ns.n }} tools: {{ ns.names|join(', ') }} {{ "%s-%d" % ("x", 3) }} {{ "{}/{:>4}".format("a", 7) }}
{%- for m in messages[::-1] %}{{ loop.index0 }}{{ m.role|upper }}{{ (m.content if m.content is string else m.content|tojson)|truncate(20) }}{% endfor %}
{{ messages|length }} {{ (messages|map(attribute='role')|list)[-1] }} {{ messages[0].content.split(' ')|reverse|join('_') }}
{%- set d = {'a': [1, 2], 'b': {'c': none}} %} {{ d|tojson(indent=2) }} {{ d.items()|list|length }} {{ dict(x=1).x }}
{%- for k, v in d|dictsort %} {{ k }}={{ v }}{% endfor %}{{ strftime_now("%Y")|length }}
{%- macro wrap() %}[{{ caller() }}]{% endmacro %}{% call wrap() %}inner{% endcall %}
'''
CONSTRUCTS_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "w", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "examples": ["a'b"], "maximum": 3},
        "n": {"type": ["integer", "null"]},
        "o": {"oneOf": [{"type": "integer"}, {"type": "float"}]},
        "sub": {"type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"]}},
        "required": ["city"]}}}]
CONSTRUCTS_MESSAGES = [
    {"role": "system", "content": "sys prompt here"},
    {"role": "user", "content": [{"type": "text", "text": "multi"}]},
    {"role": "assistant", "content": "a very long answer that will be truncated somewhere"}]


def test_limits_leave_tool_templates_alone():
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from loaders.template_sandbox import _raise_exception, _strftime_now, _tojson
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    kw = dict(messages=CONSTRUCTS_MESSAGES, tools=CONSTRUCTS_TOOLS, add_generation_prompt=True,
              bos_token="", eos_token="")
    plain = env.from_string(CONSTRUCTS).render(**kw)
    assert "type get_weather" in plain and "sub?: {\n    q: number," in plain
    assert ChatTemplate(CONSTRUCTS).render(CONSTRUCTS_MESSAGES, tools=CONSTRUCTS_TOOLS) == plain
