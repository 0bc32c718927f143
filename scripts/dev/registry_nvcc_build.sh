#!/usr/bin/env bash
# On the GPU machine (no internet): build the extensions through the project's build backend with
# NVIDIA's compiler wheels from the package registry and the system nvcc hidden from the PATH, as
# on a laptop with a driver and no toolkit; then run scripts/gpu_session.sh (GPU tests, kernel
# bench, and with STAGES="tests offload" the 8 GiB benchmark) on that build.
#
# Carry: .whl, holding in .whl/nvcc/ either the compiler wheels (nvidia-cuda-nvcc, -crt, -cccl,
# -runtime, nvidia-nvvm, all 13.0.x, the driver's CUDA: 104.5 MB, over a call's 64 MiB) or
# nvtc-13.0.tar.xz, the files those wheels install less the two the build never runs (libnvvm.so,
# __nvcc_device_query). A .gpubin folder is set aside (gpu_session.sh would copy its prebuilt
# modules over the ones built here).
#   ARCHS=90 (default), or "" for CMakeLists.txt's list (sm_86, 89, 90, 120 + compute_80 PTX)
#   STAGES="tests" / "tests offload" / none (see gpu_session.sh)
set -u -o pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
PY=$(command -v "${PYTHON:-python3}")
t0=$SECONDS

# 1. the wheels, unpacked where the backend finds them (it searches sys.path for nvidia/cu*/bin/nvcc)
rm -rf /tmp/nvtc && mkdir -p /tmp/nvtc
if compgen -G "$ROOT/.whl/nvcc/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/nvtc "$ROOT"/.whl/nvcc/*.whl \
    > "$OUT/registry_build.log" 2>&1 || { echo "wheel install failed"; exit 1; }
else
  tar -xJf "$ROOT"/.whl/nvcc/nvtc-*.tar.xz -C /tmp/nvtc || { echo "no compiler in .whl/nvcc"; exit 1; }
fi
ls /tmp/nvtc/nvidia/cu13/bin
# 2. nvcc hidden: PATH entries holding one are dropped, the other programs there (cmake, ...)
#    linked from /tmp/no_nvcc_bin; no CUDACXX
rm -rf /tmp/no_nvcc_bin && mkdir -p /tmp/no_nvcc_bin
NO_NVCC=$(echo "$PATH" | tr : '\n' | while read -r d; do
  if [ -x "$d/nvcc" ]; then
    for f in "$d"/*; do [ "${f##*/}" = nvcc ] || [ -e "/tmp/no_nvcc_bin/${f##*/}" ] || ln -s "$f" /tmp/no_nvcc_bin/; done
  else echo "$d"; fi; done | paste -sd:):/tmp/no_nvcc_bin
unset CUDACXX
PATH=$NO_NVCC command -v nvcc && { echo "nvcc still on the PATH"; exit 1; }
# the backend's decision here, with no hint: it must see the driver and ask for the wheels
decision=$(PATH=$NO_NVCC $PY build_backend/ftpatch_build.py 2>&1)
echo "$decision" | tee -a "$OUT/registry_build.log"
[[ $decision == *"wheels: nvidia"* ]] || { echo "the backend did not ask for the registry compiler"; exit 1; }
# 3. the build: no isolation (nothing to download here; the image has scikit-build-core,
#    pybind11, cmake, ninja); the backend sees the driver and no nvcc, and uses /tmp/nvtc
rm -rf /tmp/regwh /tmp/regbuild
PATH=$NO_NVCC PYTHONPATH=/tmp/nvtc FTPATCH_CUDA_ARCHS=${ARCHS-90} CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  $PY -m pip wheel -v --no-build-isolation --no-deps -w /tmp/regwh -C build-dir=/tmp/regbuild . \
  >> "$OUT/registry_build.log" 2>&1 || { tail -30 "$OUT/registry_build.log"; echo "build failed"; exit 1; }
grep -E "ftpatch build:|ftpatch: building" "$OUT/registry_build.log"
echo "registry-compiler build: $((SECONDS - t0)) s"
# 4. the built modules into native/ (where gpu_session.sh and the tests import them from)
rm -rf /tmp/regsite && $PY -m zipfile -e /tmp/regwh/*.whl /tmp/regsite
rm -f "$ROOT"/native/_c*.so && cp /tmp/regsite/native/_c*.so "$ROOT/native/"
# prebuilt modules left by an earlier call on this machine would be copied over these by
# gpu_session.sh: set them aside
[ -d "$ROOT/.gpubin" ] && rm -rf /tmp/gpubin.aside && mv "$ROOT/.gpubin" /tmp/gpubin.aside
ls -l "$ROOT"/native/_c*.so
# the bare machine's missing packages (gguf, prompt_toolkit) as gpu_session.sh installs them
if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site "$ROOT"/.whl/*.whl > /dev/null 2>&1
fi
PYTHONPATH=$ROOT:/tmp/site $PY -c "import native._cuda as c; print('native._cuda: nvcc', c.built_with(), c.built_archs())"
PYTHONPATH=$ROOT:/tmp/site $PY -m freetoken_patch.cli --version
t1=$SECONDS; PYTHONPATH=$ROOT:/tmp/site $PY -m freetoken_patch.cli doctor; echo "doctor rc=$? in $((SECONDS - t1)) s"
# 5. tests and benchmarks on this build (STAGES as gpu_session.sh's; STAGES=none: the build alone)
[ "${STAGES-}" = none ] && exit 0
OUT=$OUT bash scripts/gpu_session.sh
if [ -f /tmp/35b.gguf ]; then   # made by the offload stage: doctor's plan for it on this GPU
  PYTHONPATH=$ROOT:/tmp/site $PY -m freetoken_patch.cli doctor /tmp/35b.gguf; echo "doctor 35b rc=$?"
fi
