"""What this build of the native extensions holds, and whether its CUDA code runs on a given GPU.

No torch and no CUDA call here: `ftpatch --version`, `ftpatch doctor` and the extension loader
(ops._load) ask, each with what it knows. The archs come from native._cuda.built_archs() (set by
CMakeLists.txt): "sm_XY" = machine code for compute capability X.Y, "compute_XY" = PTX, which the
driver compiles at load for any GPU of capability >= X.Y.
"""
from __future__ import annotations

import importlib
import re

REBUILD = "FTPATCH_CUDA_ARCHS={arch} pip install --force-reinstall ."
# The oldest GPUs the kernels compile for: cp.async (csrc/cuda/rows.cuh) is an sm_80 instruction.
# CMakeLists.txt's FTPATCH_CUDA_MIN_ARCH says the same.
MIN_CAPABILITY = (8, 0)
# Set by ops._load when the current GPU is one this build has no code for: the line it warned.
unusable: str | None = None


def extension(name: str):
    """native._cpu / native._cuda, or None where it was not built (or does not load)."""
    try:
        return importlib.import_module(f"native.{name}")
    except ImportError:
        return None


def built_archs(ext=None) -> list[str]:
    """The architectures the CUDA extension was compiled for ([] if it is not built)."""
    ext = ext if ext is not None else extension("_cuda")
    if ext is None:
        return []
    if not hasattr(ext, "built_archs"):   # built before the binding existed
        return ["unknown"]
    return list(ext.built_archs())


def _parse(arch: str) -> tuple[str, int, int] | None:
    m = re.fullmatch(r"(sm|compute)_(\d+?)(\d)[a-z]?", arch)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def runs_on(archs: list[str], capability: tuple[int, int]) -> bool:
    """Whether code built for `archs` runs on a GPU of `capability` (major, minor): machine code of
    the same major and a minor <= the GPU's, or PTX of a capability <= the GPU's. Lists holding an
    entry we cannot read ("all", "unknown") are taken to run."""
    parsed = [_parse(a) for a in archs]
    if not archs or any(p is None for p in parsed):
        return bool(archs)
    major, minor = capability
    for kind, a_major, a_minor in parsed:
        if kind == "sm" and a_major == major and a_minor <= minor:
            return True
        if kind == "compute" and (a_major, a_minor) <= (major, minor):
            return True
    return False


def mismatch(gpu_name: str, capability: tuple[int, int], archs: list[str]) -> str | None:
    """None when the build runs on this GPU; else the one line to show."""
    if runs_on(archs, capability):
        return None
    cc = f"{capability[0]}.{capability[1]}"
    if tuple(capability) < MIN_CAPABILITY:
        return (f"{gpu_name} (compute capability {cc}) is older than ftpatch's CUDA kernels support "
                f"({MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} and later): models run on the CPU here, "
                f"without --vram")
    return (f"the CUDA kernels were built for {', '.join(archs)}, not for {gpu_name} (compute "
            f"capability {cc}); rebuild for it: "
            + REBUILD.format(arch=f"{capability[0]}{capability[1]}"))


def summary() -> dict:
    """The build, for --version and doctor: CPU ISA paths, CUDA archs and compiler version."""
    cpu, cuda = extension("_cpu"), extension("_cuda")
    out: dict = {"cpu": None, "cuda": None}
    if cpu is not None:
        out["cpu"] = {"isa": cpu.isa(), "available": list(cpu.available_isas())}
    if cuda is not None:
        out["cuda"] = {"archs": built_archs(cuda),
                       "compiler": cuda.built_with() if hasattr(cuda, "built_with") else "unknown"}
    return out
