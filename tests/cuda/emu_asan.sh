#!/usr/bin/env bash
# The AddressSanitizer build of the CUDA emulator (slower; not part of CI's test command):
# builds qcoll._cuda_emu with -fsanitize=address into a temporary directory, shows that ASan
# is live (a kernel storing one element past its buffer must be reported), then runs every
# cuda_emu test against it. Buffers are host allocations of exactly the bytes a kernel may
# touch, so any out-of-bounds global access lands in ASan's redzone.
#   usage: tests/cuda/emu_asan.sh [pytest args...]     (PYTHON=... to pick the interpreter)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-python}
build=$(mktemp -d /tmp/qcoll-emu-asan.XXXXXX)
trap 'rm -rf "$build"' EXIT

pybind11_dir=$("$python" -c "import pybind11; print(pybind11.get_cmake_dir())")
generator=()
command -v ninja > /dev/null && generator=(-G Ninja)
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DQCOLL_CUDA=OFF \
  -DQCOLL_EMU_ASAN=ON -DPython_EXECUTABLE="$(command -v "$python")" \
  -Dpybind11_DIR="$pybind11_dir" -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$build/out" > /dev/null
cmake --build "$build" --target _cuda_emu --parallel "${QCOLL_BUILD_JOBS:-2}"
module=$(ls "$build"/out/_cuda_emu*.so)
# libstdc++ preloaded too: ASan intercepts __cxa_throw only if it is there at start-up.
preload="$(${CXX:-c++} -print-file-name=libasan.so) $(${CXX:-c++} -print-file-name=libstdc++.so)"

export LD_PRELOAD=$preload QCOLL_EMU_MODULE=$module
export ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0:detect_stack_use_after_return=0
cd "$root"

echo "== sources: $("$python" tests/cuda/sources_stamp.py)"
echo "== ASan is live: a store one element past the buffer must be reported"
if out=$("$python" -c "from tests.support.cuda_emu import EMU; EMU.selftest('out_of_bounds')" 2>&1); then
  echo "FAIL: the out-of-bounds store was not reported"; exit 1
fi
grep -q "ERROR: AddressSanitizer: heap-buffer-overflow" <<< "$out" || { echo "$out"; exit 1; }
echo "reported: $(grep -m1 'ERROR: AddressSanitizer' <<< "$out")"

echo "== pytest -m cuda_emu on the ASan build"
"$python" -m pytest "$root/tests" -m cuda_emu -q -p no:cacheprovider "$@"
