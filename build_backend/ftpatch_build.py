"""The PEP 517 backend of ftpatch: scikit-build-core, plus NVIDIA's compiler from the package
registry when this machine has an NVIDIA GPU and no CUDA toolkit.

The CUDA extension needs nvcc. Most machines with an NVIDIA GPU have the driver (and a CUDA build
of torch) but no toolkit; NVIDIA publishes nvcc, its front ends and the CUDA runtime as wheels
(`nvidia-cuda-nvcc`, `-crt`, `-cccl`, `nvidia-nvvm`, `nvidia-cuda-runtime`; CUDA 13 and later: the CUDA 12
wheels hold ptxas but no nvcc). So:

  FTPATCH_CUDA=OFF                    -> CPU extension only, nothing extra
  nvcc on the PATH (or $CUDACXX)      -> that compiler, nothing extra (the build as before)
  a GPU here, or FTPATCH_CUDA=ON      -> the compiler wheels become build requirements (~100 MB
                                         download, into pip's throwaway build environment) and
                                         CMake is pointed at them
  otherwise (no GPU, no hint)         -> CPU extension only, nothing downloaded

"A GPU here": the NVIDIA kernel driver is loaded (/proc/driver/nvidia/version) or libcuda loads.
The wheels' CUDA version never exceeds the driver's (code built by a newer CUDA than the driver
does not load): FTPATCH_CUDA_VERSION=13.0 picks one by hand. `python -m build_backend.ftpatch_build`
prints the decision.
"""
from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import sys

# The wheels nvcc needs, all of one CUDA version (nvidia-cuda-nvcc's own requirements are
# unpinned: left to pip they would mix versions).
COMPILER_WHEELS = ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-runtime",
                   "nvidia-cuda-cccl")
OLDEST_CUDA = (13, 0)   # the first CUDA whose wheels carry nvcc itself


def _mode() -> str:
    return os.environ.get("FTPATCH_CUDA", "AUTO").upper()


def local_nvcc() -> str | None:
    """The CUDA compiler CMake would find without help: $CUDACXX, else nvcc on the PATH."""
    cxx = os.environ.get("CUDACXX")
    return cxx if cxx and os.path.exists(cxx) else shutil.which("nvcc")


def driver_cuda_version() -> tuple[int, int] | None:
    """The CUDA version the installed driver supports (cuDriverGetVersion), None without one."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value > 0:
            return v.value // 1000, (v.value % 1000) // 10
    return None


def gpu_present() -> bool:
    return os.path.exists("/proc/driver/nvidia/version") or driver_cuda_version() is not None


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


def compiler_requirements() -> list[str]:
    """The wheels to add to the build environment: empty unless the registry's compiler is
    needed (module docstring)."""
    mode = _mode()
    if mode == "OFF" or local_nvcc():
        return []
    if mode != "ON" and not gpu_present():
        return []
    major, minor = wanted_cuda_version()
    if (major, minor) < OLDEST_CUDA:
        raise SystemExit(
            f"ftpatch build: this driver supports CUDA {major}.{minor}; the package registry's CUDA "
            f"compiler starts at {OLDEST_CUDA[0]}.{OLDEST_CUDA[1]}. Update the NVIDIA driver (580 or "
            f"later), or install a CUDA {major}.x toolkit so that nvcc is on the PATH, or build "
            f"for the CPU alone with FTPATCH_CUDA=OFF.")
    spec = f">={major}.0,<{major}.{minor + 1}"
    return [name + spec for name in COMPILER_WHEELS]


def registry_toolkit() -> str | None:
    """The folder the compiler wheels installed into (nvidia/cuNN with bin/nvcc), if importable."""
    for entry in sys.path:
        for nvcc in sorted(glob.glob(os.path.join(entry or ".", "nvidia", "cu[0-9]*", "bin", "nvcc")),
                           reverse=True):
            if os.access(nvcc, os.X_OK):
                return os.path.dirname(os.path.dirname(os.path.abspath(nvcc)))
    return None


def _point_cmake_at_registry_compiler() -> None:
    """When the registry's compiler is wanted (and installed), make CMake use it: $CUDACXX for
    the compiler, $CUDAToolkit_ROOT for headers and the static runtime."""
    if not compiler_requirements():
        return
    root = registry_toolkit()
    if root is None:
        raise SystemExit(
            "ftpatch build: the CUDA compiler wheels are not in the build environment ("
            + ", ".join(COMPILER_WHEELS) + "). With --no-build-isolation install them first, "
            "e.g. pip install '" + "' '".join(compiler_requirements()) + "'")
    os.environ["CUDACXX"] = os.path.join(root, "bin", "nvcc")
    os.environ["CUDAToolkit_ROOT"] = root
    # nvcc.profile looks for the runtime in lib64; the wheels put it in lib (CMake's compiler
    # check links a test program; CMakeLists.txt finds libcudart_static.a there by itself)
    os.environ["CUDAFLAGS"] = f"{os.environ.get('CUDAFLAGS', '')} -L{os.path.join(root, 'lib')}".strip()
    os.environ["FTPATCH_CUDA"] = "ON"
    print(f"ftpatch build: CUDA compiler from the package registry: {os.environ['CUDACXX']}",
          flush=True)


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
    _point_cmake_at_registry_compiler()
    return _skb().build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    _point_cmake_at_registry_compiler()
    return _skb().build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None) -> str:
    return _skb().build_sdist(sdist_directory, config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None) -> str:
    return _skb().prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None) -> str:
    return _skb().prepare_metadata_for_build_editable(metadata_directory, config_settings)


if __name__ == "__main__":
    reqs = compiler_requirements()
    nvcc = local_nvcc()
    print(f"FTPATCH_CUDA={_mode()}  nvcc here: {nvcc or 'none'}  GPU driver: "
          f"{'CUDA %d.%d' % driver_cuda_version() if driver_cuda_version() else 'none'}")
    print("compiler wheels: " + (" ".join(reqs) if reqs else "none"))
