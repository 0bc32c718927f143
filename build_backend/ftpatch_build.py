"""The PEP 517 backend of ftpatch: scikit-build-core, plus a decision made before CMake runs: whether
to build the CUDA extension, for which GPUs, with which compiler. The build says what it decided
and about how long it will take.

  FTPATCH_CUDA=OFF                     -> CPU extension only
  FTPATCH_CUDA=AUTO (the default)      -> the CUDA extension only where an NVIDIA GPU is visible,
                                          compiled for that GPU (machine code and PTX); no GPU
                                          here: CPU extension only, nothing downloaded
  FTPATCH_CUDA=ON                      -> the CUDA extension whatever this machine has: for the
                                          visible GPU, or without one for CMakeLists.txt's list
  FTPATCH_CUDA_ARCHS=86;89-real;...    -> those architectures (CMake's syntax) instead

The compiler: nvcc on the PATH (or $CUDACXX); without one, NVIDIA's compiler wheels from the
package registry (`nvidia-cuda-nvcc`, `-crt`, `-cccl`, `nvidia-nvvm`, `nvidia-cuda-runtime`; ~100 MB
into pip's throwaway build environment; CUDA 13 and later, whose wheels carry nvcc itself), of a
CUDA version no newer than the driver's (FTPATCH_CUDA_VERSION=13.0 picks one by hand).

"Visible": the CUDA driver lists the GPU to this process (CUDA_VISIBLE_DEVICES applies); with the
kernel driver loaded but libcuda unusable, nvidia-smi is asked. `python build_backend/ftpatch_build.py`
prints the decision for this machine. The decision's one-line reason is passed to CMake, which
records it in native/_build.json for `ftpatch --version` and `ftpatch doctor`.
"""
from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

# The wheels nvcc needs, all of one CUDA version (nvidia-cuda-nvcc's own requirements are
# unpinned: left to pip they would mix versions).
COMPILER_WHEELS = ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-runtime",
                   "nvidia-cuda-cccl")
OLDEST_CUDA = (13, 0)   # the first CUDA whose wheels carry nvcc itself
MIN_CAPABILITY = (8, 0)  # cp.async (native/csrc/cuda/rows.cuh); CMakeLists.txt says the same
CUDA_ERROR_NO_DEVICE = 100   # cuInit's answer where CUDA_VISIBLE_DEVICES hides every GPU
# CMakeLists.txt's list when neither a GPU nor FTPATCH_CUDA_ARCHS names one, in words
DEFAULT_ARCHS_TEXT = "sm_86, sm_89, sm_90, sm_120 and PTX compute_80"
# Compile cost in core-seconds on the 2-core development machine (AMD EPYC, g++, nvcc 13.0; the
# time of each ninja step, summed), rounded down from a build beside other work there: the CPU
# extension (most of it the link, a single job), the CUDA bindings, and each CUDA architecture
# entry ("90": sm_90 and its PTX, each .cu compiled once per entry). The estimate divides by the
# cores: a rough figure, which the build states as one.
CPU_CORE_S = 200
CUDA_CORE_S_FIXED = 75
CUDA_CORE_S_PER_ARCH = 350


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int] | None   # None: present, capability unknown


@dataclass
class Plan:
    cuda: bool                 # build native._cuda
    reason: str                # one line: why it is (or is not) built, as --version repeats it
    archs: str = ""            # CMake list for FTPATCH_CUDA_ARCHS ("": CMakeLists.txt's default)
    nvcc: str | None = None    # the local compiler, or None: the registry's wheels
    requirements: list[str] = field(default_factory=list)


def _mode() -> str:
    mode = os.environ.get("FTPATCH_CUDA", "AUTO").strip().upper() or "AUTO"
    if mode not in ("AUTO", "ON", "OFF"):
        raise SystemExit(f"ftpatch build: FTPATCH_CUDA={mode!r}: give AUTO (the default: CUDA "
                         "where a GPU is visible), ON or OFF")
    return mode


def local_nvcc() -> str | None:
    """The CUDA compiler CMake would find without help: $CUDACXX, else nvcc on the PATH."""
    cxx = os.environ.get("CUDACXX")
    return cxx if cxx and os.path.exists(cxx) else shutil.which("nvcc")


def _libcuda():
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def driver_cuda_version() -> tuple[int, int] | None:
    """The CUDA version the installed driver supports (cuDriverGetVersion), None without one."""
    lib = _libcuda()
    if lib is None:
        return None
    v = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value > 0:
        return v.value // 1000, (v.value % 1000) // 10
    return None


def _gpus_from_driver() -> list[Gpu] | None:
    """The GPUs libcuda lists (None where it cannot be asked)."""
    lib = _libcuda()
    if lib is None:
        return None
    rc = lib.cuInit(0)
    if rc == CUDA_ERROR_NO_DEVICE:   # a driver, and no GPU this process may use
        return []
    if rc != 0:
        return None
    n = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(n)) != 0:
        return None
    out = []
    for i in range(n.value):
        dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
        name = ctypes.create_string_buffer(256)
        if lib.cuDeviceGet(ctypes.byref(dev), i) != 0:
            continue
        lib.cuDeviceGetName(name, 256, dev)
        ok = (lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) == 0      # ..._MAJOR
              and lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) == 0)  # ..._MINOR
        out.append(Gpu(name.value.decode(errors="replace") or f"GPU {i}",
                       (major.value, minor.value) if ok else None))
    return out


def _gpus_from_smi() -> list[Gpu] | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    out = []
    for line in r.stdout.splitlines():
        name, _, cap = line.rpartition(",")
        m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", cap)
        out.append(Gpu(name.strip() or "GPU", (int(m.group(1)), int(m.group(2))) if m else None))
    return out


def visible_gpus() -> list[Gpu]:
    """The NVIDIA GPUs this process can use, with their compute capability where it can be read."""
    gpus = _gpus_from_driver()
    if gpus is None:
        gpus = _gpus_from_smi()
    if gpus is None:
        # the kernel driver is loaded but neither libcuda nor nvidia-smi answers: a GPU of
        # unknown capability (CMakeLists.txt's list then)
        gpus = [Gpu("NVIDIA GPU", None)] if os.path.exists("/proc/driver/nvidia/version") else []
    return gpus


def gpu_present() -> bool:
    return bool(visible_gpus())


def wanted_cuda_version() -> tuple[int, int]:
    """The CUDA version of the compiler wheels: FTPATCH_CUDA_VERSION, else the driver's, else
    the oldest with nvcc in a wheel."""
    text = os.environ.get("FTPATCH_CUDA_VERSION", "")
    m = re.fullmatch(r"(\d+)\.(\d+)", text.strip())
    if text and not m:
        raise SystemExit(f"ftpatch build: FTPATCH_CUDA_VERSION={text!r}: expected MAJOR.MINOR, e.g. 13.0")
    if m:
        return int(m.group(1)), int(m.group(2))
    return driver_cuda_version() or OLDEST_CUDA


def _registry_wheels() -> list[str]:
    major, minor = wanted_cuda_version()
    if (major, minor) < OLDEST_CUDA:
        raise SystemExit(
            f"ftpatch build: this driver supports CUDA {major}.{minor}; the package registry's CUDA "
            f"compiler starts at {OLDEST_CUDA[0]}.{OLDEST_CUDA[1]}. Update the NVIDIA driver (580 or "
            f"later), or install a CUDA {major}.x toolkit so that nvcc is on the PATH, or build "
            f"for the CPU alone with FTPATCH_CUDA=OFF.")
    spec = f">={major}.0,<{major}.{minor + 1}"
    return [name + spec for name in COMPILER_WHEELS]


def _cap(g: Gpu) -> str:
    return f"{g.capability[0]}.{g.capability[1]}" if g.capability else "unknown"


def gpu_archs(gpus: list[Gpu]) -> str:
    """CMake's architecture list for these GPUs: machine code for each, PTX for the newest (so a
    later GPU still loads it); "" when a capability is unknown (CMakeLists.txt's list)."""
    if not gpus or any(g.capability is None for g in gpus):
        return ""
    caps = sorted({g.capability for g in gpus})
    tags = [f"{a}{b}" for a, b in caps]
    return ";".join([f"{t}-real" for t in tags[:-1]] + [tags[-1]])


def plan() -> Plan:
    """What this machine's build holds and why (the module docstring's table)."""
    mode = _mode()
    if mode == "OFF":
        return Plan(False, "FTPATCH_CUDA=OFF was set at build time")
    gpus = visible_gpus()
    usable = [g for g in gpus if g.capability is None or g.capability >= MIN_CAPABILITY]
    if mode == "AUTO":
        if not gpus:
            return Plan(False, "no NVIDIA GPU was visible at build time (FTPATCH_CUDA=ON builds "
                               "the CUDA extension without one)")
        if not usable:
            return Plan(False, ", ".join(f"{g.name} (compute capability {_cap(g)})" for g in gpus)
                        + " is older than the CUDA kernels support (8.0 and later)")
    asked = os.environ.get("FTPATCH_CUDA_ARCHS", "").strip()
    archs = asked or gpu_archs(usable)
    if mode == "ON":
        why = "FTPATCH_CUDA=ON was set at build time"
    else:
        why = "the GPU visible at build time: " + ", ".join(
            f"{g.name} (compute capability {_cap(g)})" for g in usable)
    if asked:
        why += f"; FTPATCH_CUDA_ARCHS={asked}"
    nvcc = local_nvcc()
    return Plan(True, why, archs, nvcc, [] if nvcc else _registry_wheels())


def compiler_requirements() -> list[str]:
    """The wheels to add to the build environment: empty unless the registry's compiler is
    needed (module docstring)."""
    p = plan()
    return p.requirements if p.cuda else []


def registry_toolkit() -> str | None:
    """The folder the compiler wheels installed into (nvidia/cuNN with bin/nvcc), if importable."""
    for entry in sys.path:
        for nvcc in sorted(glob.glob(os.path.join(entry or ".", "nvidia", "cu[0-9]*", "bin", "nvcc")),
                           reverse=True):
            if os.access(nvcc, os.X_OK):
                return os.path.dirname(os.path.dirname(os.path.abspath(nvcc)))
    return None


def _point_cmake_at_registry_compiler(p: Plan) -> str:
    """Make CMake use the compiler wheels: $CUDACXX for the compiler, $CUDAToolkit_ROOT for
    headers and the static runtime. Returns the nvcc path."""
    root = registry_toolkit()
    if root is None:
        raise SystemExit(
            "ftpatch build: the CUDA compiler wheels are not in the build environment ("
            + ", ".join(COMPILER_WHEELS) + "). With --no-build-isolation install them first, "
            "e.g. pip install '" + "' '".join(p.requirements) + "'")
    os.environ["CUDACXX"] = os.path.join(root, "bin", "nvcc")
    os.environ["CUDAToolkit_ROOT"] = root
    # nvcc.profile looks for the runtime in lib64; the wheels put it in lib (CMake's compiler
    # check links a test program; CMakeLists.txt finds libcudart_static.a there by itself)
    os.environ["CUDAFLAGS"] = f"{os.environ.get('CUDAFLAGS', '')} -L{os.path.join(root, 'lib')}".strip()
    return os.environ["CUDACXX"]


# ---- what the build says -------------------------------------------------------------------------

def archs_text(archs: str) -> str:
    """A CMake architecture list in words: "89" -> "sm_89 and PTX compute_89"."""
    if not archs:
        return DEFAULT_ARCHS_TEXT
    real, ptx, other = [], [], []
    for a in archs.replace(",", ";").split(";"):
        m = re.fullmatch(r"(\d+)([a-z]?)(-real|-virtual)?", a.strip())
        if not m:
            other.append(a.strip())
            continue
        if m.group(3) != "-virtual":
            real.append(f"sm_{m.group(1)}{m.group(2)}")
        if m.group(3) != "-real":
            ptx.append(f"compute_{m.group(1)}{m.group(2)}")
    words = ", ".join(real + other)
    if ptx:
        words += (" and " if words else "") + "PTX " + ", ".join(ptx)
    return words


def n_archs(archs: str) -> int:
    """How many architectures a CMake list compiles for (machine code or PTX counted once)."""
    if not archs:
        return 5
    return max(1, len([a for a in archs.replace(",", ";").split(";") if a.strip()]))


def build_cores() -> int:
    level = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "")
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    return max(1, min(int(level), usable)) if level.isdigit() and int(level) > 0 else usable


def estimate_s(p: Plan, cores: int) -> float:
    work = CPU_CORE_S
    if p.cuda:
        work += CUDA_CORE_S_FIXED + CUDA_CORE_S_PER_ARCH * n_archs(p.archs)
    return work / max(1, cores)


def _minutes(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min"


def announce_text(p: Plan, cores: int, nvcc: str | None) -> str:
    est = _minutes(estimate_s(p, cores))
    if not p.cuda:
        what = f"compiling the CPU extension only: {p.reason}"
    else:
        what = (f"compiling the CPU extension and the CUDA extension for {archs_text(p.archs)} "
                f"with {nvcc or 'the package registry compiler'} ({p.reason})")
    return (f"ftpatch build: {what}; expect about {est} on {cores} core{'s' * (cores != 1)} "
            f"(`pip install -v` shows the compiler's progress)")


def say(text: str) -> None:
    """One line that pip shows: pip keeps a build's output to itself unless -v, so the line goes
    to the terminal directly where there is one, else to stderr (pip -v and CI logs)."""
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(f"\n{text}\n")
            return
    except OSError:
        pass
    print(text, file=sys.stderr, flush=True)


def _prepare() -> float:
    """Decide, tell CMake (through the variables pyproject.toml maps to its cache) and the user."""
    p = plan()
    os.environ["FTPATCH_CUDA"] = "ON" if p.cuda else "OFF"
    os.environ["FTPATCH_BUILD_NOTE"] = p.reason
    nvcc = p.nvcc
    if p.cuda:
        os.environ["FTPATCH_CUDA_ARCHS"] = p.archs
        if p.requirements:
            nvcc = _point_cmake_at_registry_compiler(p)
    say(announce_text(p, build_cores(), nvcc))
    return time.monotonic()


def _done(t0: float) -> None:
    s = time.monotonic() - t0
    say(f"ftpatch build: compiled in {int(s // 60)} min {int(s % 60)} s")


# ---- the PEP 517 hooks: scikit-build-core's, the compiler added (imported when called, so that
# the decision above can be checked without scikit-build-core installed) ---------------------------

def _skb():
    from scikit_build_core import build
    return build


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
    return _skb().get_requires_for_build_wheel(config_settings) + compiler_requirements()


def get_requires_for_build_editable(config_settings=None) -> list[str]:
    return _skb().get_requires_for_build_editable(config_settings) + compiler_requirements()


def get_requires_for_build_sdist(config_settings=None) -> list[str]:
    return _skb().get_requires_for_build_sdist(config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    t0 = _prepare()
    out = _skb().build_wheel(wheel_directory, config_settings, metadata_directory)
    _done(t0)
    return out


def build_editable(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    t0 = _prepare()
    out = _skb().build_editable(wheel_directory, config_settings, metadata_directory)
    _done(t0)
    return out


def build_sdist(sdist_directory, config_settings=None) -> str:
    return _skb().build_sdist(sdist_directory, config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None) -> str:
    return _skb().prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None) -> str:
    return _skb().prepare_metadata_for_build_editable(metadata_directory, config_settings)


if __name__ == "__main__":
    decision = plan()
    gpus = visible_gpus()
    print(f"FTPATCH_CUDA={_mode()}  nvcc here: {local_nvcc() or 'none'}  GPUs: "
          + (", ".join(f"{g.name} ({_cap(g)})" for g in gpus) or "none")
          + "  driver: " + ("CUDA %d.%d" % driver_cuda_version() if driver_cuda_version() else "none"))
    print(announce_text(decision, build_cores(), decision.nvcc))
    print("compiler wheels: " + (" ".join(decision.requirements) if decision.requirements else "none"))
