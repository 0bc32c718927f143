"""The chat-template sandbox: Jinja2 under limits, rendered in this process.

This is the engine; `chat_template.ChatTemplate` is the API, and `template_worker` runs this same
engine in a separate process under OS limits. It imports jinja2 and the standard library only,
so that process starts quickly.

The template is code from a downloaded file, so it runs in Jinja2's immutable sandbox (no
attribute tricks, no mutating lists or dicts). Real templates are written for the conventions
of Hugging Face's renderer, so those hold here too: trim_blocks and lstrip_blocks on, `break` and
`continue`, `raise_exception(msg)`, a `tojson` that keeps non-ASCII text and takes `indent`, and
`strftime_now(fmt)`.

The sandbox stops attribute tricks, not denial of service, so rendering also runs under limits
(`TemplateLimits`): wall time, output size, the size of any value the template builds, and macro
nesting. They are enforced from inside the rendered code, so they work in any thread (no
signals): the parsed template is rewritten so that every loop iteration, macro body and output
statement calls back into the environment, string concatenation (`~`) and list/dict literals go
through size checks, and the sandbox's own hooks (calls, attribute access, the `*`, `**`, `+` and
`%` operators, str.format) check time and sizes before the work is done. They are the fast path:
a precise message with the template's line, before any memory is spent. What they miss (a C call
they do not know) meets the worker process's hard limits.
"""
from __future__ import annotations

import datetime
import json
import re
import threading
import time
import types
from dataclasses import dataclass
from functools import update_wrapper
from typing import Any, Callable

import jinja2
from jinja2 import nodes
from jinja2.runtime import LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import Namespace, _PassArg, pass_context
from jinja2.visitor import NodeTransformer

from .errors import ChatTemplateError

OVERRIDE_HINT = "pass --chat-template FILE to use another template"


@dataclass(frozen=True)
class TemplateLimits:
    """What one render may use. The longest context we run (262,144 tokens) is about 1.1 M
    characters of English; 4 Mi characters leaves room for any real prompt and still keeps a
    render's memory in the tens of MB."""

    seconds: float = 2.0                # wall time of one render
    output_chars: int = 4 << 20         # the rendered prompt
    value_size: int = 4 << 20           # any one value built: characters, plus 2 per element
    emitted_chars: int = 32 << 20       # all output statements, macro and {% set %} buffers too
    depth: int = 64                     # nested macro / recursive-loop calls
    source_chars: int = 64 << 10        # the template's text: real ones are 2-30 KiB, and
                                        # Jinja compiles about 40 KiB a second
    # hard limits of the worker process (template_worker), which the checks here do not need
    memory: int = 256 << 20             # address space a render may add to the worker's own
    compile_seconds: float = 10.0       # wall time to compile the source


DEFAULT_LIMITS = TemplateLimits()


class _LimitExceeded(Exception):
    """Raised inside a render when it passes a limit; becomes ChatTemplateError."""


class _TemplateRaised(Exception):
    """A template called raise_exception(msg): it refuses this conversation."""


class _Budget:
    """One render's use of its limits (thread-local: a template may render in many threads)."""

    def __init__(self, limits: TemplateLimits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        self.emitted = 0
        self.depth = 0              # macro / recursive loop calls
        self.walk = 0               # namespaces being sized (they can contain themselves)
        self.namespaces = 0         # namespaces sized so far: their sizes can change
        self.sizes: dict[int, tuple[Any, int]] = {}   # id -> (object kept alive, size)
        self.cached = 0             # sum of the sizes in `sizes`

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _LimitExceeded(f"rendering took longer than its {self.limits.seconds:g} s limit")

    def too_big(self, what: str) -> _LimitExceeded:
        return _LimitExceeded(f"{what} is larger than the {self.limits.value_size:,}-character "
                              "limit on one value")

    def size(self, value: Any) -> int:
        """About len(str(value)) (strings and bytes: their length; containers: their elements
        plus 2 each), refusing past the limit. Lists, tuples and dicts are immutable in the
        sandbox, so their sizes are cached: a value built from itself many times over
        ([a, a], then [b, b], ...) costs a lookup, not a walk."""
        if isinstance(value, (str, bytes, bytearray)):
            n = len(value)
        elif value is None or isinstance(value, (bool, float)):
            return 8
        elif isinstance(value, int):
            return value.bit_length() // 3 + 2
        elif isinstance(value, (list, tuple, dict, set, frozenset, Namespace)):
            n = self._container(value)
        elif isinstance(value, range):
            n = 8 * len(value)
        else:
            return 16   # undefined, macros, loop objects, generators (their items are checked)
        if n > self.limits.value_size:
            raise self.too_big(f"a {type(value).__name__}")
        return n

    def _container(self, value: Any) -> int:
        if isinstance(value, Namespace):   # mutable and may contain itself: walked, not cached
            if self.walk >= self.limits.depth:
                raise self.too_big("a namespace nested in itself")
            self.walk += 1
            self.namespaces += 1
            try:
                return 16 + self._walk(value._Namespace__attrs.items(), True)  # type: ignore
            finally:
                self.walk -= 1
        hit = self.sizes.get(id(value))
        if hit is not None and hit[0] is value:
            return hit[1]
        namespaces = self.namespaces
        total = self._walk(value.items() if isinstance(value, dict) else value,
                           isinstance(value, dict))
        if self.namespaces == namespaces:   # nothing mutable inside: the size is final
            # the cache keeps what it sizes alive: bound what it holds
            self.cached += total
            if self.cached > 2 * self.limits.value_size:
                self.sizes.clear()
                self.cached = total
            self.sizes[id(value)] = (value, total)
        return total

    def _walk(self, items: Any, pairs: bool) -> int:
        limit, total = self.limits.value_size, 2
        for i, item in enumerate(items):
            if pairs:
                total += 4 + self.size(item[0]) + self.size(item[1])
            else:
                total += 2 + self.size(item)
            if total > limit:
                raise self.too_big("a collection")
            if not i & 4095:
                self.tick()
        return total


_local = threading.local()


def _budget() -> _Budget:
    b = getattr(_local, "budget", None)
    # outside a render (compile-time constant folding): sizes only, no clock
    return b if b is not None else _Budget(TemplateLimits(seconds=float("inf")))


# -- checks of operations that can make large values ---------------------------------------------

_DIGITS = re.compile(r"\d+")


def _check_width(b: _Budget, n: Any, what: str) -> None:
    if isinstance(n, int) and n > b.limits.value_size:
        raise b.too_big(f"{what} of {n:,}")


def _check_spec(b: _Budget, spec: str, what: str) -> None:
    # widths and precisions in a format spec ("%9999999d", "{:>9999999}", "%.9999999f")
    for m in _DIGITS.finditer(spec):
        if len(m.group()) > 9 or int(m.group()) > b.limits.value_size:
            raise b.too_big(f"a {what} width of {m.group()}")


def _check_printf(b: _Budget, fmt: str, args: Any) -> None:
    _check_spec(b, fmt, "'%' format")
    for a in args if isinstance(args, tuple) else (args,):
        if "*" in fmt:
            _check_width(b, a, "a '*' width")
        b.size(a)


class _BoundedFormatter(SandboxedFormatter):
    def format_field(self, value: Any, format_spec: str) -> Any:
        b = _budget()
        b.tick()    # a format string of a million fields is one call, with a clock
        _check_spec(b, format_spec, "str.format")
        b.size(value)
        return super().format_field(value, format_spec)


def _replace_size(b: _Budget, s: str | bytes, old: Any, new: Any, count: Any = -1) -> int:
    if not isinstance(old, (str, bytes)) or not isinstance(new, (str, bytes)):
        return len(s)
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(0, len(new) - len(old))


def _join_size(b: _Budget, sep: Any, items: list) -> int:
    n = len(sep) * max(0, len(items) - 1) if isinstance(sep, (str, bytes)) else 0
    for x in items:
        n += b.size(x)
        if n > b.limits.value_size:
            break
    return n


def _translate_size(b: _Budget, s: str, table: Any) -> int:
    """The length of s.translate(table): each character becomes its entry's text."""
    if isinstance(table, dict):
        entries = table.items()
    elif isinstance(table, (list, tuple)):
        entries = enumerate(table)
    else:
        return len(s)       # a str table maps a character to a character
    growing = [(k, len(v)) for k, v in entries if isinstance(v, str) and len(v) > 1]
    if len(growing) > 4096:
        raise b.too_big("a str.translate table of so many long entries")
    est = len(s)
    for key, n in growing:
        if isinstance(key, int) and 0 <= key <= 0x10FFFF:
            est += s.count(chr(key)) * (n - 1)
            if est > b.limits.value_size:
                break
    return est


_WIDTH_METHODS = ("center", "ljust", "rjust", "zfill")


def _check_str_method(b: _Budget, method: Any, args: tuple, kwargs: dict) -> tuple:
    """Refuse str and bytes methods whose result would pass the size limit; return the args to
    use."""
    s, name = method.__self__, method.__name__
    kind = type(s).__name__
    est = len(s)
    if name in _WIDTH_METHODS and args:
        _check_width(b, args[0], f"{kind}.{name} width")
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int):
            est = len(s) + s.count("\t" if isinstance(s, str) else b"\t") * max(0, tab)
    elif name == "replace" and len(args) >= 2:
        est = _replace_size(b, s, *args[:3])
    elif name == "join" and args:
        items = list(args[0]) if not isinstance(args[0], (list, tuple)) else args[0]
        est = _join_size(b, s, items)
        args = (items,) + args[1:]
    elif name == "translate" and isinstance(s, str) and args:
        est = _translate_size(b, s, args[0])
    if est > b.limits.value_size:
        raise b.too_big(f"the result of {kind}.{name}")
    return args


def _check_builtin_args(b: _Budget, func: Any, args: tuple, kwargs: dict) -> None:
    # a count or length argument past the size limit to a method of text, bytes or a number is
    # a request for that much memory: int.to_bytes(n), bytes.center(n), ... (a dict's or a
    # list's methods take no counts: dict.get(k, 10**10) is fine)
    for a in (*args, *kwargs.values()):
        if type(a) is int and a > b.limits.value_size:
            raise b.too_big(f"an argument of {a:,} to "
                            f"{type(func.__self__).__name__}.{func.__name__}")


# -- filters: each call checked; none is folded into a constant at compile time -----------------

# Jinja filters no chat template needs whose cost is hard to bound (regex scans over the text,
# pretty-printing, HTML helpers), and lipsum (size by argument).
_DROPPED_FILTERS = ("urlize", "striptags", "wordwrap", "pprint", "xmlattr")

# what HTML escaping adds per character: &amp; &lt; &gt; &#34; &#39;
_ESCAPE_GROWTH = (("&", 4), ("<", 3), (">", 3), ('"', 4), ("'", 4))


def _filter_prechecks(b: _Budget, name: str, value: Any, args: tuple, kwargs: dict) -> tuple:
    """Refuse a filter call whose result would pass the size limit; return the args to use."""
    def arg(i: int, key: str, default: Any = None) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool):
            _check_width(b, a, f"a '{name}' argument")
    if name in ("slice", "batch"):
        n = arg(0, "slices" if name == "slice" else "linecount")
        if isinstance(n, int) and n > 1 << 16:
            raise b.too_big(f"'{name}' into {n:,} parts")
    elif name == "indent" and isinstance(value, str):
        width = arg(0, "width", 4)
        pad = width if isinstance(width, int) else len(str(width))
        if len(value) + (value.count("\n") + 1) * pad > b.limits.value_size:
            raise b.too_big("the result of 'indent'")
    elif name == "replace" and isinstance(value, str):
        if _replace_size(b, value, arg(0, "old"), arg(1, "new"), arg(2, "count", -1)) > \
                b.limits.value_size:
            raise b.too_big("the result of 'replace'")
    elif name == "join":
        items = list(value)
        if _join_size(b, arg(0, "d", ""), items) > b.limits.value_size:
            raise b.too_big("the result of 'join'")
        value = items
    elif name == "format" and isinstance(value, str):
        _check_printf(b, value, tuple(args) or tuple(kwargs.values()))
    elif name in ("escape", "e", "forceescape") and isinstance(value, str):
        if len(value) + sum(value.count(c) * n for c, n in _ESCAPE_GROWTH) > b.limits.value_size:
            raise b.too_big(f"the result of '{name}'")
    elif name == "urlencode" and 3 * 4 * b.size(value) > b.limits.value_size:
        raise b.too_big("the result of 'urlencode'")
    elif name == "sum" and not isinstance(arg(1, "start", 0), (int, float)):
        raise jinja2.TemplateRuntimeError("'sum' adds numbers only here")
    b.size(value)
    return (value, *args)


def _wrap_filter(name: str, func: Callable) -> Callable:
    pass_arg = _PassArg.from_obj(func)

    @pass_context
    def checked(ctx: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.tick()
        value, *args = _filter_prechecks(b, name, value, args, kwargs)
        if pass_arg is _PassArg.context:
            out = func(ctx, value, *args, **kwargs)
        elif pass_arg is _PassArg.eval_context:
            out = func(ctx.eval_ctx, value, *args, **kwargs)
        elif pass_arg is _PassArg.environment:
            out = func(ctx.environment, value, *args, **kwargs)
        else:
            out = func(value, *args, **kwargs)
        if isinstance(out, types.GeneratorType):   # map, select, ...: checked as consumed
            return _ticking(out, b, f"what '{name}' produced")
        b.size(out)
        return out

    checked.__name__ = getattr(func, "__name__", name)
    return checked


def _ticking(items: Any, b: _Budget, what: str) -> Any:
    # the items of one generator count as one value: a consumer may keep them all (|list)
    total = 0
    for i, x in enumerate(items):
        if not i & 1023:
            b.tick()
        total += 2 + b.size(x)
        if total > b.limits.value_size:
            raise b.too_big(what)
        yield x


def _raise_exception(message: Any = "") -> None:
    raise _TemplateRaised(str(message))


def _tojson(value: Any, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; prompts want the plain JSON
    if indent is not None and not (isinstance(indent, int) and 0 <= indent <= 16):
        raise jinja2.TemplateRuntimeError(f"tojson indent must be 0..16, not {indent!r:.20}")
    if separators is not None and not (
            isinstance(separators, (list, tuple)) and len(separators) == 2
            and all(isinstance(x, str) and len(x) <= 16 for x in separators)):
        got = [len(x) if isinstance(x, str) else type(x).__name__ for x in separators] \
            if isinstance(separators, (list, tuple)) else type(separators).__name__
        raise _LimitExceeded(f"tojson separators must be two strings of at most 16 characters "
                             f"(got {got!r:.60})")
    b = _budget()
    size = b.size(value)
    # every character may become a 6-character escape, each element adds its separators and
    # a line of indentation per level: past the limit, the text is built in pieces and counted
    seps = sum(map(len, separators)) if separators else 4
    pad = 1 + 16 * indent if indent is not None else 0
    kwargs = dict(indent=indent, separators=separators, sort_keys=sort_keys,
                  ensure_ascii=ensure_ascii)
    if size * (6 + seps) + size * pad <= b.limits.value_size:
        return json.dumps(value, **kwargs)
    out, n = [], 0
    for i, piece in enumerate(json.JSONEncoder(**kwargs).iterencode(value)):
        n += len(piece)
        if n > b.limits.value_size:
            raise b.too_big("the result of 'tojson'")
        if not i & 4095:
            b.tick()
        out.append(piece)
    return "".join(out)


def _strftime_now(fmt: str) -> str:
    _check_spec(_budget(), str(fmt), "strftime")
    return datetime.datetime.now().strftime(fmt)


# -- the environment -----------------------------------------------------------------------------

def _env_call(name: str, args: list, lineno: int) -> nodes.Call:
    return nodes.Call(nodes.EnvironmentAttribute(name, lineno=lineno), args, [], None, None,
                      lineno=lineno)


class _Guard(NodeTransformer):
    """Rewrites a parsed template so the limits are checked from inside the rendered code."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.body.insert(0, nodes.ExprStmt(_env_call("ftpatch_tick", [], node.lineno),
                                           lineno=node.lineno))
        if node.test is not None:   # a filtered loop can run without entering its body
            node.test = nodes.And(_env_call("ftpatch_tick", [], node.lineno), node.test,
                                  lineno=node.lineno)
        return node

    def _body_tick(self, node: Any) -> nodes.Node:
        node = self.generic_visit(node)
        node.body.insert(0, nodes.ExprStmt(_env_call("ftpatch_tick", [], node.lineno),
                                           lineno=node.lineno))
        return node

    visit_Macro = visit_CallBlock = _body_tick

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        node = self.generic_visit(node)
        # literal text and constants skip `finalize`; count them here
        const = 0
        for child in node.nodes:
            if isinstance(child, nodes.TemplateData):
                const += len(child.data)
            elif isinstance(child, nodes.Const):
                const += len(str(child.value))
        node.nodes.insert(0, _env_call("ftpatch_emit", [nodes.Const(const)], node.lineno))
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return _env_call("ftpatch_concat", node.nodes, node.lineno)

    def _literal(self, node: Any) -> nodes.Node:
        node = self.generic_visit(node)
        if getattr(node, "ctx", "load") != "load":   # assignment targets stay as they are
            return node
        return _env_call("ftpatch_value", [node], node.lineno)

    visit_List = visit_Tuple = visit_Dict = _literal


class _Environment(ImmutableSandboxedEnvironment):
    """The immutable sandbox plus the limit checks its hooks allow."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, finalize=_finalize,
                         extensions=["jinja2.ext.loopcontrols"])
        self.filters["tojson"] = _tojson
        for name in _DROPPED_FILTERS:
            self.filters.pop(name, None)
        self.filters = {name: _wrap_filter(name, f) for name, f in self.filters.items()}
        self.globals.pop("lipsum", None)
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)

    # hooks the rewritten template calls (as `environment.ftpatch_*`)
    @staticmethod
    def ftpatch_tick() -> bool:
        _budget().tick()
        return True

    @staticmethod
    def ftpatch_emit(n: int) -> str:
        b = _budget()
        b.emitted += n
        if b.emitted > b.limits.emitted_chars:
            raise _LimitExceeded(f"it wrote more than {b.limits.emitted_chars:,} characters "
                                 "(output, macro and set-block text together)")
        return ""

    @staticmethod
    def ftpatch_concat(*parts: Any) -> str:
        b = _budget()
        total = 0
        for p in parts:
            total += b.size(p)
            if total > b.limits.value_size:
                raise b.too_big("a '~' concatenation")
        return "".join(map(str, parts))

    @staticmethod
    def ftpatch_value(value: Any) -> Any:
        _budget().size(value)
        return value

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = _Guard().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    # sandbox hooks
    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        b = _budget()
        b.tick()
        if isinstance(__obj, types.BuiltinMethodType):
            if isinstance(__obj.__self__, (str, bytes, bytearray)):
                args = _check_str_method(b, __obj, args, kwargs)
            if isinstance(__obj.__self__, (str, bytes, bytearray, int)):
                _check_builtin_args(b, __obj, args, kwargs)
        nested = isinstance(__obj, (Macro, LoopContext))
        if nested:
            if b.depth >= b.limits.depth:
                raise _LimitExceeded(f"macros or recursive loops nest deeper than "
                                     f"{b.limits.depth} calls")
            b.depth += 1
        try:
            out = super().call(__context, __obj, *args, **kwargs)
        finally:
            if nested:
                b.depth -= 1
        b.size(out)
        return out

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _budget()
        b.tick()
        limit = b.limits.value_size
        ints = (isinstance(left, int) and isinstance(right, int))
        if operator == "**" and ints:
            if abs(left) > 1 and right > 0 and right * left.bit_length() > 1 << 16:
                raise b.too_big(f"{left} ** {right}")
        elif operator == "*":
            if ints:
                if left.bit_length() + right.bit_length() > 1 << 16:
                    raise b.too_big("an integer product")
            else:
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(n, int) and not isinstance(seq, (int, float)) and n > 0 and \
                        b.size(seq) * n > limit:
                    raise b.too_big(f"a {type(seq).__name__} repeated {n:,} times")
        elif operator == "+" and not ints and not isinstance(left, (int, float)):
            if b.size(left) + b.size(right) > limit:
                raise b.too_big(f"a {type(left).__name__} sum")
        elif operator == "%" and isinstance(left, (str, bytes)):
            _check_printf(b, left if isinstance(left, str) else left.decode("latin-1"), right)
        out = super().call_binop(context, operator, left, right)
        if not isinstance(out, (int, float)):
            b.size(out)
        return out

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().tick()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        # the sandbox's own wrapper with a formatter that checks widths before formatting
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or \
                value.__name__ not in ("format", "format_map") or \
                not isinstance(value.__self__, str):
            return None
        text, is_map = str(value.__self__), value.__name__ == "format_map"
        vformat = _BoundedFormatter(self).vformat

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            out = vformat(text, args, kwargs)
            _budget().size(out)
            return out

        return update_wrapper(wrapper, value)


@pass_context
def _finalize(context: Any, value: Any) -> Any:
    # every `{{ ... }}` value on its way to a buffer: counted before str() makes it text
    b = _budget()
    b.tick()
    b.emitted += len(value) if isinstance(value, str) else b.size(value)
    if b.emitted > b.limits.emitted_chars:
        raise _LimitExceeded(f"it wrote more than {b.limits.emitted_chars:,} characters "
                             "(output, macro and set-block text together)")
    return value


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def check_source(source: Any, where: str, limits: TemplateLimits) -> str:
    """The template's text, or ChatTemplateError when it is not text or is too long."""
    if not isinstance(source, str):
        raise ChatTemplateError(f"{where} is a {type(source).__name__}, not text; "
                                f"{OVERRIDE_HINT}")
    if len(source) > limits.source_chars:
        raise ChatTemplateError(f"{where} is {len(source):,} characters, over the "
                                f"{limits.source_chars:,}-character limit; {OVERRIDE_HINT}")
    return source


def compile_template(source: str, where: str, limits: TemplateLimits) -> jinja2.Template:
    """`source` parsed, rewritten with the limit checks and compiled; ChatTemplateError (one
    line, the template's line number) when it does not compile."""
    check_source(source, where, limits)
    prev = getattr(_local, "budget", None)
    _local.budget = _Budget(limits)
    try:
        return _Environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{where}: syntax error at template line {e.lineno}: "
                                f"{_one_line(e.message or e)}; {OVERRIDE_HINT}") from None
    except (RecursionError, SyntaxError, MemoryError):
        # Python's own limits on nesting (parser recursion, nested blocks in the code)
        raise ChatTemplateError(f"{where} nests blocks or expressions too deeply to "
                                f"compile; {OVERRIDE_HINT}") from None
    except _LimitExceeded as e:
        raise ChatTemplateError(f"{where}: {e}; {OVERRIDE_HINT}") from None
    finally:
        _local.budget = prev


def render_compiled(template: jinja2.Template, where: str, limits: TemplateLimits,
                    context: dict[str, Any]) -> str:
    """Render a compiled template with `context` under `limits`: the text, or ChatTemplateError
    naming the failure or the limit. MemoryError is raised as is: what it means depends on the
    process (the worker's address-space limit, or the host's memory)."""
    prev = getattr(_local, "budget", None)
    budget = _local.budget = _Budget(limits)
    try:
        out, n = [], 0
        for chunk in template.generate(**context):
            n += len(chunk)
            if n > limits.output_chars:
                raise _LimitExceeded(f"the prompt passed the {limits.output_chars:,}"
                                     "-character output limit")
            out.append(chunk)
        return "".join(out)
    except _TemplateRaised as e:
        raise ChatTemplateError(f"{where} refused the conversation: {_one_line(e)}") from None
    except _LimitExceeded as e:
        raise ChatTemplateError(f"{where}: {e}{_at(e)}; {OVERRIDE_HINT}") from None
    except RecursionError as e:
        raise ChatTemplateError(f"{where}: nests too deeply (Python's recursion "
                                f"limit){_at(e)}; {OVERRIDE_HINT}") from None
    except MemoryError:
        raise
    except Exception as e:   # the template is untrusted code: any failure is its own
        what = f"{type(e).__name__}: {_one_line(e)}"[:300]
        raise ChatTemplateError(f"{where} failed{_at(e)}: {what}; {OVERRIDE_HINT}") from None
    finally:
        budget.sizes.clear()
        _local.budget = prev


def _at(e: BaseException) -> str:
    # Jinja rewrites tracebacks so the template's own frames carry template line numbers
    line, tb = None, e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" at template line {line}" if line else ""
