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
