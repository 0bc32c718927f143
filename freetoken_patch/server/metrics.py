"""Prometheus text exposition for `GET /metrics`: counters, gauges and histograms kept under
one lock (the event loop and the engine thread both write), plus the offload runtime's own
figures as the engine thread last read them (rt.stats() is a device sync point, so only the
thread that owns the model calls it), and with --draft the speculative decoder's counts as the
engine published them between sequences."""
from __future__ import annotations

import bisect
import math
import threading
from collections import defaultdict

PREFIX = "ftpatch_"
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPS_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        if not math.isfinite(v):
            return
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b:g}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out += [f"{name}_sum {self.sum:.6g}", f"{name}_count {self.n}"]
        return out


class Metrics:
    """What the server counts. `gauges` is a callable returning {name: value} read at scrape."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generated_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.decode_tps = Histogram(TPS_BUCKETS)
        self.runtime: dict = {}
        self.draft: dict | None = None     # SpecStats.as_dict() (None: --draft is off)
        self.gauges = lambda: {}
        # {name: (value, or {label value: value}, help)}: counters the engine keeps itself
        self.counters = lambda: {}

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def finished(self, n_prompt: int, n_cached: int, n_generated: int, ttft_s: float,
                 decode_tps: float) -> None:
        """One sequence done (called by the engine thread)."""
        with self._lock:
            self.prompt_tokens += n_prompt
            self.cached_prompt_tokens += n_cached
            self.generated_tokens += n_generated
            if n_generated:
                self.ttft.observe(ttft_s)
            if decode_tps > 0:
                self.decode_tps.observe(decode_tps)

    def set_runtime(self, stats: dict) -> None:
        with self._lock:
            self.runtime = dict(stats)

    def set_draft(self, stats: dict) -> None:
        """The speculative decoder's totals since start (SpecStats.as_dict())."""
        with self._lock:
            self.draft = dict(stats)

    def render(self) -> str:
        p = PREFIX
        with self._lock:
            lines = [f"# HELP {p}requests_total HTTP requests by endpoint and status.",
                     f"# TYPE {p}requests_total counter"]
            for (ep, st), n in sorted(self.requests.items()):
                lines.append(f'{p}requests_total{{endpoint="{ep}",status="{st}"}} {n}')
            for name, val, what in (
                    ("prompt_tokens_total", self.prompt_tokens,
                     "Prompt tokens of finished requests."),
                    ("prompt_tokens_cached_total", self.cached_prompt_tokens,
                     "Prompt tokens taken from a cached prefix instead of prefilled."),
                    ("generated_tokens_total", self.generated_tokens, "Tokens generated.")):
                lines += [f"# HELP {p}{name} {what}", f"# TYPE {p}{name} counter",
                          f"{p}{name} {val}"]
            lines += [f"# HELP {p}time_to_first_token_seconds Queue exit to first token.",
                      f"# TYPE {p}time_to_first_token_seconds histogram",
                      *self.ttft.lines(f"{p}time_to_first_token_seconds"),
                      f"# HELP {p}decode_tokens_per_second Decode rate of each request.",
                      f"# TYPE {p}decode_tokens_per_second histogram",
                      *self.decode_tps.lines(f"{p}decode_tokens_per_second")]
            runtime = dict(self.runtime)
            if self.draft is not None:
                lines += draft_lines(self.draft)
        for name, (val, what) in {**self.gauges(), **runtime}.items():
            lines += [f"# HELP {p}{name} {what}", f"# TYPE {p}{name} gauge",
                      f"{p}{name} {_number(val)}"]
        for name, (val, what) in self.counters().items():
            lines += [f"# HELP {p}{name} {what}", f"# TYPE {p}{name} counter"]
            if isinstance(val, dict):   # one label, `phase`
                lines += [f'{p}{name}{{phase="{k}"}} {_number(v)}' for k, v in val.items()]
            else:
                lines.append(f"{p}{name} {_number(val)}")
        return "\n".join(lines) + "\n"


def _number(v: float) -> str:
    """Whole numbers (byte counts) in full, others to 6 significant digits."""
    return str(int(v)) if float(v).is_integer() else f"{v:.6g}"


def draft_lines(d: dict) -> list[str]:
    """--draft's counters and gauges from SpecStats.as_dict(). A step gives its accepted drafts
    and one token more, less what a stop cut off: tokens_per_step <= 1 + accepted / steps."""
    p, out = PREFIX, []
    for name, kind, val, what in (
            ("draft_steps_total", "counter", d.get("steps", 0),
             "Speculative decode steps (one trunk forward checking 0..3 drafts each)."),
            ("draft_tokens_total", "counter", d.get("drafted", 0),
             "Tokens the MTP head drafted."),
            ("draft_accepted_total", "counter", d.get("accepted", 0),
             "Drafted tokens the trunk accepted."),
            ("draft_acceptance", "gauge", d.get("acceptance", 0.0),
             "Share of drafted tokens accepted since start."),
            ("draft_judged_acceptance", "gauge", d.get("judged_acceptance", 0.0),
             "Share of judged drafts accepted since start (a draft is judged when every one "
             "before it in its step was accepted): the per-draft rate."),
            ("draft_tokens_per_step", "gauge", d.get("tokens_per_step", 0.0),
             "Tokens a speculative step gave on average since start.")):
        out += [f"# HELP {p}{name} {what}", f"# TYPE {p}{name} {kind}",
                f"{p}{name} {_number(val)}"]
    return out


def runtime_gauges(stats: dict) -> dict:
    """The offload runtime's stats() (as a dict) -> the gauges /metrics shows."""
    out = {}
    if "hit_rate" in stats:
        out["expert_cache_hit_rate"] = (float(stats["hit_rate"]),
                                        "Expert cache hit rate of decode steps since start.")
    if "cache_bytes" in stats:
        out["expert_cache_bytes"] = (float(stats["cache_bytes"]), "VRAM held by the expert cache.")
    if "kv_bytes" in stats:
        out["kv_cache_bytes"] = (float(stats["kv_bytes"]), "VRAM the elastic KV cache maps now.")
    if "pcie_bytes" in stats:
        out["pcie_expert_bytes"] = (float(stats["pcie_bytes"]),
                                    "Expert bytes copied over PCIe since start.")
    return out
