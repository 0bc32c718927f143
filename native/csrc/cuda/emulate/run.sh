#!/usr/bin/env bash
# Build native._cuda's kernels for the host emulator (shim.h, runtime.cpp) and run the CUDA tests
# on the CPU: tests/native/test_cuda_*.py with DEVICE = "cpu" and the emulated module. Slow (one
# thread per CUDA thread): select tests with pytest args, e.g.
#   native/csrc/cuda/emulate/run.sh -k "matmul_tokens and IQ3_S"
# Needs g++, the CUDA headers (/usr/local/cuda/include or $CUDA_HOME/include), pybind11, pytest.
# Tests that need a real device (graphs, cuBLAS) skip themselves.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../../.." && pwd)
SRC=$ROOT/native/csrc
WORK=${FTPATCH_EMU_DIR:-${TMPDIR:-/tmp}/ftpatch-cuda-emu}
PY=${PYTHON:-python3}
CUDA_INC=${CUDA_HOME:-/usr/local/cuda}/include
mkdir -p "$WORK/obj" "$WORK/tests"
EXT=$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
FLAGS="-std=c++17 -O1 -fPIC -w -DFT_CUDA_EMULATE -DFT_CUDA_ARCHS=\"emulated\" -DFT_CUDA_VERSION=\"emulated\"
       -include $HERE/shim.h -I$SRC -I$CUDA_INC
       -I$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])")
       -I$($PY -c "import pybind11; print(pybind11.get_include())")"
pids=()
for f in "$SRC"/cuda/*.cu; do
    name=$(basename "$f" .cu)
    grep -q "FT_LAUNCH\|ft::cuda" "$f" || continue  # kernel files of this family only
    [[ "$name" == offload || "$name" == step || "$name" == float_rows ]] && continue
                                                     # bindings resolve lazily (never called);
                                                     # step.cu and float_rows.cu are tested
                                                     # against torch on a GPU
    g++ $FLAGS -x c++ -c "$f" -o "$WORK/obj/$name.o" & pids+=($!)
done
g++ $FLAGS -c "$SRC/bindings_cuda.cpp" -o "$WORK/obj/bindings.o" & pids+=($!)
g++ $FLAGS -c "$HERE/runtime.cpp" -o "$WORK/obj/runtime.o" & pids+=($!)
for p in "${pids[@]}"; do wait "$p"; done
g++ -shared -o "$WORK/_cuda$EXT" "$WORK"/obj/*.o -lpthread -Wl,--unresolved-symbols=ignore-all
for f in "$ROOT"/tests/native/test_cuda_*.py; do
    sed -e 's/^DEVICE = "cuda"/DEVICE = "cpu"/' -e 's/^pytestmark = pytest.mark.gpu/pytestmark = []/' \
        -e "s#^    import native._cuda as ext#    import importlib.util, os, sys; sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_GLOBAL); spec = importlib.util.spec_from_file_location('_cuda', '$WORK/_cuda$EXT'); ext = importlib.util.module_from_spec(spec); spec.loader.exec_module(ext)#" \
        "$f" > "$WORK/tests/emu_$(basename "$f")"
done
cd "$WORK/tests"
PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} $PY -m pytest -q -p no:cacheprovider "$@" emu_test_cuda_*.py
