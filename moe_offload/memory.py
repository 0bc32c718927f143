"""Memory before it is taken: what this process may still take from host RAM, and the estimate of
what running a model needs beside its weights (delta-net state, KV cache, a prompt's workspace),
checked before anything is allocated. A refusal names the metadata key (or --ctx) responsible:
a small file whose `ssm.state_size` asks for gigabytes is refused up front, naming that key."""
from __future__ import annotations

import resource
from dataclasses import dataclass

from loaders.footprint import (Culprit, culprit, kv_bytes_per_position, recurrent_state_bytes,
                               gib as _gib)

from .config import PREFILL, OffloadPolicy
from .errors import OffloadError


def host_ram_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_ram_keeps(nbytes: int, keep: int) -> bool:
    """Whether host RAM keeps `keep` bytes available once `nbytes` more are taken (True where
    the available figure is unknown)."""
    avail = host_ram_available()
    return avail is None or avail - nbytes >= keep


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _cgroup_room() -> int | None:
    """The memory cgroup's limit less what it holds (reclaimable file pages not counted), or None
    without a limit. cgroup v2, else v1."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    paths = {}
    for line in lines:
        _, ctrl, path = line.split(":", 2)
        paths[ctrl] = path
    tries = []
    if "" in paths:
        tries += [(f"/sys/fs/cgroup{paths['']}".rstrip("/"), "memory.max", "memory.current",
                   "inactive_file")]
    if "memory" in paths:
        for base in (f"/sys/fs/cgroup/memory{paths['memory']}", "/sys/fs/cgroup/memory"):
            tries.append((base.rstrip("/"), "memory.limit_in_bytes", "memory.usage_in_bytes",
                          "total_inactive_file"))
    for base, lim, cur, inactive in tries:
        limit, used = _read_int(f"{base}/{lim}"), _read_int(f"{base}/{cur}")
        if limit is None or used is None:
            continue
        if limit >= 1 << 60:        # v1's "no limit"
            return None
        try:
            with open(f"{base}/memory.stat") as f:
                for line in f:
                    name, _, v = line.partition(" ")
                    if name == inactive:
                        used -= int(v)
        except (OSError, ValueError):
            pass
        return max(0, limit - used)
    return None


def host_room() -> tuple[int | None, str]:
    """(bytes this process may still take, what sets that figure): the least of RAM available,
    the memory cgroup's room, and the room under `ulimit -v` (RLIMIT_AS) and `ulimit -d`
    (RLIMIT_DATA). (None, "") where none is known."""
    best: tuple[int | None, str] = (None, "")

    def take(room: int | None, what: str) -> None:
        nonlocal best
        if room is not None and (best[0] is None or room < best[0]):
            best = (max(0, room), what)

    take(host_ram_available(), "RAM available")
    take(_cgroup_room(), "the memory cgroup's limit")
    for lim, field, what in ((resource.RLIMIT_AS, "VmSize", "ulimit -v"),
                             (resource.RLIMIT_DATA, "VmData", "ulimit -d")):
        soft = resource.getrlimit(lim)[0]
        used = _status_kib(field)
        if soft != resource.RLIM_INFINITY and used is not None:
            take(soft - used, f"the address-space limit ({what})")
    return best


# ---- the estimate ---------------------------------------------------------------------------

def delta_rule_workspace(c, n_tokens: int, chunked: bool) -> int:
    """A prompt chunk's delta-net tensors that grow with `ssm.state_size`: the conv's input and
    output rows, and with `chunked` (torch's chunked rule: CUDA prompts, a CPU without our
    kernels) the queries and keys per value head and their decayed copies, over the tokens
    padded to a chunk. Beside `placement.prefill_workspace_bytes`, which models a real model's
    shapes: this term only dominates where state_size is huge."""
    conv_dim = 2 * c.ssm_n_k_heads * c.ssm_d_state + c.ssm_d_inner
    rows = 2 * n_tokens * conv_dim * 4
    if not chunked:
        return rows
    tp = -(-n_tokens // PREFILL.delta_chunk) * PREFILL.delta_chunk
    return rows + 6 * tp * c.ssm_n_v_heads * c.ssm_d_state * 4


def cpu_chunked_rule() -> bool:
    """Whether a CPU prompt runs torch's chunked delta rule (no native CPU kernels here)."""
    from native import ops
    return ops._cpu is None


@dataclass(frozen=True)
class Estimate:
    """What running a model takes beside its weights, before any of it is allocated."""

    where: str                      # "host RAM" | "VRAM"
    n_ctx: int
    sequences: int                  # states held at once (each with its delta-net state)
    state: int                      # delta-net state, all sequences
    kv: int                         # KV cache for n_ctx positions (one sequence's, see kv_sequences)
    workspace: int                  # the largest prompt chunk's activations
    culprit: Culprit | None         # the key (or --ctx) most responsible for the total

    @property
    def total(self) -> int:
        return self.state + self.kv + self.workspace

    def parts(self) -> list[tuple[str, int]]:
        seq = f" ({self.sequences} sequences)" if self.sequences > 1 else ""
        return [(f"delta-net state{seq}", self.state), (f"KV cache at {self.n_ctx:,} positions", self.kv),
                ("prompt workspace", self.workspace)]

    def as_dict(self) -> dict:
        c = self.culprit
        return {"where": self.where, "n_ctx": self.n_ctx, "sequences": self.sequences,
                "state_bytes": self.state, "kv_bytes": self.kv, "workspace_bytes": self.workspace,
                "total_bytes": self.total,
                "largest_because": None if c is None else {"key": c.key, "value": c.value,
                                                           "reference": c.reference}}

    def fix(self, default: str = "free some memory, or use a smaller model") -> str:
        """What to do when it does not fit: the key responsible, named."""
        c = self.culprit
        if c is None:
            return default
        if c.key == "--ctx":
            return f"--ctx {c.value:,} is what makes it large; lower --ctx"
        return (f"{c.describe()} is what makes it large ({_gib(c.saves)} of it): the file's "
                "metadata asks for more than a real model of its kind; it is damaged or not "
                "meant to run")

    def summary(self) -> str:
        return ", ".join(f"{what} {_gib(n)}" for what, n in self.parts() if n)


def estimate(config, n_ctx: int, *, sequences: int = 1, kv_sequences: int = 1,
             kv_bytes: float = 4, prompt_chunk: int = PREFILL.default_chunk,
             logits_rows: int = 0, where: str = "host RAM", chunked: bool | None = None
             ) -> Estimate:
    """What `sequences` states (each with the delta-net state; `kv_sequences` of them with a KV
    cache that may fill n_ctx positions of `kv_bytes` values) and one prompt chunk of
    `prompt_chunk` tokens attending over the whole context need; `logits_rows` rows of logits
    kept (ftpatch logits keeps every position's); `chunked`: the prompt runs torch's chunked
    delta rule (default: on a GPU, or a CPU without our kernels). Python integers: no size
    overflows."""
    from .offload.placement import prefill_workspace_bytes
    if chunked is None:
        chunked = where != "host RAM" or cpu_chunked_rule()

    def parts(c, n: int) -> tuple[int, int, int]:
        t = max(1, min(prompt_chunk, n))
        return (recurrent_state_bytes(c) * sequences,
                kv_bytes_per_position(c, kv_bytes) * n * kv_sequences,
                max(prefill_workspace_bytes(c, t, n), delta_rule_workspace(c, t, chunked))
                + logits_rows * c.n_vocab * 4)

    state, kv, work = parts(config, n_ctx)
    who = culprit(lambda c, n: sum(parts(c, n)), config, n_ctx)
    return Estimate(where, n_ctx, sequences, state, kv, work, who)


def _refusal(est: Estimate, what: str, room: int, limit: str) -> OffloadError:
    head = (f"{what} needs {_gib(est.total)} of {est.where} to run at --ctx {est.n_ctx:,} "
            f"({est.summary()}) and {limit} leaves {_gib(room)}")
    return OffloadError(f"{head}; {est.fix()}")


def check_host(est: Estimate, what: str = "this model", room: tuple[int | None, str] | None = None
               ) -> None:
    """Refuse (OffloadError naming the key responsible) when `est` does not fit what this process
    may still take from host RAM (`room`: host_room() by default)."""
    avail, limit = room if room is not None else host_room()
    if avail is not None and est.total > avail:
        raise _refusal(est, what, avail, limit)


def check_vram(est: Estimate, room: int, limit: str, what: str = "this model") -> None:
    """The same against `room` bytes of GPU memory (the cap, or what the device has free)."""
    if est.total > room:
        raise _refusal(est, what, room, limit)


def check_state(config, batch: int, n_ctx: int, kv_row: int) -> None:
    """Before a State of `batch` sequences is allocated in host RAM: its delta-net state and a
    KV cache that may fill n_ctx positions (`kv_row` bytes a position and attention layer, K and
    V each) must fit what this process may still take."""
    def parts(c, n: int) -> tuple[int, int]:
        return (recurrent_state_bytes(c) * batch,
                2 * len(c.attention_layers) * batch * n * kv_row)

    state, kv = parts(config, n_ctx)
    avail, limit = host_room()
    if avail is not None and state + kv > avail:
        who = culprit(lambda c, n: sum(parts(c, n)), config, n_ctx)
        raise _refusal(Estimate("host RAM", n_ctx, batch, state, kv, 0, who),
                       "the KV cache and delta-net state", avail, limit)


def runtime_estimate(config, n_ctx: int, policy: OffloadPolicy = OffloadPolicy(),
                     sequences: int = 1, kv_bytes: float = 2) -> Estimate:
    """What the offload runtime puts under its cap for the context (its KV of kv_bytes a value,
    one chunk of the policy's prefill), before its weights and expert cache."""
    return estimate(config, n_ctx, sequences=sequences, kv_bytes=kv_bytes,
                    prompt_chunk=policy.prefill_chunk, where="VRAM")


def auto_context_host(n_ctx_train: int, kv_bytes_per_token: int, n_states: int,
                      available: int | None = None, resident: int = 0, *, floor: int,
                      keep: int | None = None, step: int | None = None) -> int:
    """--ctx auto without a VRAM cap: the largest context, up to `n_ctx_train`, whose KV for
    `n_states` sequences (each State allocates its whole KV) fits in `available` bytes (host
    RAM, or a plain GPU's free memory) once `resident` bytes (the weights) are taken and `keep`
    is left (default: CONTEXT.host_keep or CONTEXT.host_keep_share of `available`). A multiple
    of `step`, or the trained length; never below `floor` (min(trained, DEFAULT_N_CTX)) -- if
    that does not fit, the allocation says so. available None: host RAM's MemAvailable now
    (unknown: `floor`)."""
    from .config import CONTEXT
    step = step or CONTEXT.step
    if available is None:
        available = host_ram_available()
    if available is None:
        return floor
    if keep is None:
        keep = max(CONTEXT.host_keep, int(CONTEXT.host_keep_share * available))
    room = available - resident - keep
    per = max(1, kv_bytes_per_token * max(1, n_states))
    n = room // per if room > 0 else 0
    if n >= n_ctx_train:
        return n_ctx_train
    return max(floor, int(n // step * step))
