"""Host memory: what is available, and whether a plan leaves enough of it."""
from __future__ import annotations


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
