#!/usr/bin/env bash
# Everything qcoll needs a GPU for, in one call on a lent GPU machine (expected there:
# Python 3.12, torch with CUDA, nvcc, pytest-timeout, no package registry, no .git, sm_90):
#
#   bash bench/gpu/run.sh [OUT_DIR]        (OUT_DIR defaults to $OUT, else ./gpu-out)
#
# Steps: machine facts; build qcoll with its CUDA kernels; how its modules linked the C++
# runtime (bench/gpu/link_report.py); import; a 2-rank NCCL smoke test
# (60 s); every test marked gpu (pytest -m gpu: the kernels, the NCCL transport, streams,
# CUDA graphs, failure detection); compute-sanitizer
# memcheck and racecheck over the CUDA kernel tests; the `kernels` suite on CUDA (its ladder,
# then 256 MB and 1 GB inputs); where a kernel call's fixed cost goes (bench/gpu/trace_calls.py); the
# `collectives` suite with 4 NCCL ranks sharing GPU 0 (correctness and bytes only: ranks
# time-slice one GPU, so its times mean little); the two training examples on 4 NCCL ranks
# sharing GPU 0; Nsight Compute over the slowest kernels (ncu-kernels.ncu-rep and
# ncu-details.txt in OUT_DIR); last, the rest of the test suite. Every
# step runs even if an earlier one failed (after a failed build the later ones fail fast
# and say so). Every pytest step has a per-test timeout (pytest-timeout) well under the
# step's limit, so a hang names its test. QCOLL_EXPECT_GPU=1 is exported: a GPU test that
# skips fails. Each step's exit code, duration and log tail go into ONE results file:
#
#   OUT_DIR/gpu-results.json   {"steps": [...], "failed_steps": [...], "kernels_cuda": ..., "kernels_cuda_large": ..., "trace_calls": ..., "collectives_nccl": ...}
#   OUT_DIR/gpu-run.log        the full `set -x` log
#   OUT_DIR/steps/NAME.log     each step's whole log, written as it runs
#   OUT_DIR/kernels-cuda.png   the kernels chart
#
# QCOLL_GPU_STEPS="import kernels_cuda" runs only the named steps (default: all).
# The whole script keeps within QCOLL_GPU_BUDGET_S seconds (default 560: the device tool
# gives one command 600 s), cutting each step's time limit to what is left.
# QCOLL_GPU_DRY_RUN=1 runs the same step machinery on a fake step list (no GPU, no build):
# tests/cuda/test_gpu_run_script.py checks it on CPU. QCOLL_GPU_DRY_RUN=list prints the tests the
# GPU step selects (pytest --collect-only, same arguments) and exits.
set -u -o pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT_DIR=${1:-${OUT:-$PWD/gpu-out}}
mkdir -p "$OUT_DIR/steps"
WORK=$(mktemp -d /tmp/qcoll-gpu.XXXXXX)
LOG="$OUT_DIR/gpu-run.log"
STEPS="$WORK/steps.jsonl"
: >"$STEPS"
exec > >(tee -a "$LOG") 2>&1
set -x
START=$(date +%s)
BUDGET=${QCOLL_GPU_BUDGET_S:-560}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 QCOLL_EXPECT_GPU=1
export QCOLL_CUDA=ON QCOLL_CUDA_ARCHS=${QCOLL_CUDA_ARCHS:-90} QCOLL_BUILD_JOBS=${QCOLL_BUILD_JOBS:-$(nproc)}

ONLY=${QCOLL_GPU_STEPS:-}  # e.g. "import kernels_cuda": run only these steps

# step NAME MAX_SECONDS CMD...: run CMD with a time limit, record rc/duration/log tail.
step() {
  local name=$1 max=$2
  shift 2
  if [[ -n "$ONLY" && " $ONLY " != *" $name "* ]]; then return 0; fi
  local left=$((BUDGET - ($(date +%s) - START)))
  local limit=$((max < left ? max : left))
  local slog="$OUT_DIR/steps/$name.log" t0 rc
  t0=$(date +%s)
  if ((limit < 5)); then
    echo "skipped: out of time budget" >"$slog"
    rc=124
  else
    timeout --kill-after=10 "$limit" "$@" >"$slog" 2>&1
    rc=$?
  fi
  cat "$slog"
  python3 - "$name" "$rc" "$(($(date +%s) - t0))" "$limit" "$slog" "$*" >>"$STEPS" <<'EOF'
import json, sys
name, rc, secs, limit, log, cmd = sys.argv[1:]
tail = open(log, errors="replace").read()[-4000:]
print(json.dumps({"step": name, "rc": int(rc), "seconds": int(secs), "limit_s": int(limit),
                  "timed_out": rc in ("124", "137"), "command": cmd, "log_tail": tail}))
EOF
  echo "=== step $name: rc=$rc"
  return 0
}

# pytest_step NAME MAX_SECONDS PER_TEST_SECONDS ARGS...: pytest with a per-test timeout
# (pytest-timeout dumps the hung test's stacks and fails it; the step goes on).
pytest_step() {
  local name=$1 max=$2 per_test=$3
  shift 3
  step "$name" "$max" python3 -m pytest -q -rs -p no:cacheprovider --timeout="$per_test" "$@"
}

KERNEL_TESTS=(tests/cuda/test_quantize_cuda.py tests/cuda/test_wire_cuda.py)
# Every test marked gpu but the smoke test (its own step, first).
GPU_TESTS=(tests -m gpu -k "not smoke")

if [[ ${QCOLL_GPU_DRY_RUN:-0} == list ]]; then
  python3 -m pytest --collect-only -q -p no:cacheprovider "${GPU_TESTS[@]}"
  rc=$?
  rm -rf "$WORK"
  exit $rc
fi
# Under the sanitizers kernels run 10-100x slower: the small cases only.
SANITIZE_K="not large and not big and not past_grid_cap and not second_device"

if [[ ${QCOLL_GPU_DRY_RUN:-0} == 1 ]]; then
  # The machinery on a fake list: a pass, a failure, a hang past its limit, a step left
  # without time, and a pytest step whose one test hangs past its per-test timeout.
  step passes 10 bash -c 'echo hello from passes'
  step fails 10 bash -c 'echo about to fail; exit 3'
  pytest_step pytest_hang 20 "${QCOLL_GPU_DRY_TIMEOUT:-2}" "$QCOLL_GPU_DRY_TEST"
  step hangs "${QCOLL_GPU_DRY_HANG_S:-2}" sleep 60
  step late 60 bash -c 'echo should not run'
else
  step machine 60 bash -c 'nvidia-smi; nvcc --version; python3 -V; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.nccl.version())"; nproc; compute-sanitizer --version | tail -1'
  step build 300 python3 -m pip install --no-build-isolation --no-deps -e . -q
  # How the modules linked the C++ runtime (compilers, NEEDED, the linker's libstdc++ files):
  # the first GPU build's module carried a static libstdc++ and crashed in iostreams.
  step link_report 60 python3 bench/gpu/link_report.py
  step import 60 python3 -c "import json, qcoll; i = qcoll.build_info(); print(json.dumps(i)); assert i['cuda_available'], 'no CUDA in this build'; assert i['nccl'], 'qcoll cannot load NCCL'"
  pytest_step smoke_nccl 60 50 tests/cuda/test_nccl.py -k smoke
  pytest_step tests_gpu 300 120 "${GPU_TESTS[@]}"
  step memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 20 \
    python3 -m pytest -q -x -p no:cacheprovider --timeout=80 "${KERNEL_TESTS[@]}" -k "$SANITIZE_K"
  step racecheck 90 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 1 \
    --print-limit 20 python3 -m pytest -q -x -p no:cacheprovider --timeout=80 \
    "${KERNEL_TESTS[@]}" -k "$SANITIZE_K"
  step kernels_cuda 150 python3 bench/run.py kernels --device cuda --json "$WORK/kernels-cuda.json" --plot "$OUT_DIR/kernels-cuda.png"
  # The issue's sizes for the kernel targets: 256 MB and 1 GB inputs (the ladder stops at 256 MB).
  step kernels_cuda_large 120 python3 bench/run.py kernels --device cuda --sizes 256M,1G --json "$WORK/kernels-cuda-large.json"
  # Where a kernel call's fixed ~32 us goes (host work before the launch, extra kernels, the tail).
  step trace_calls 90 python3 bench/gpu/trace_calls.py "$WORK/trace-calls.json"
  step collectives_nccl 150 python3 bench/run.py collectives --device cuda --quick --json "$WORK/collectives-nccl.json"
  # Training on NCCL ranks: 4 ranks as 2 nodes x 2 sharing GPU 0 over loopback sockets
  # (correctness: the loss falls and ZeRO++ tracks ZeRO-3 / FSDP2's default; times mean little).
  step train_zero3_nccl 120 python3 examples/train_zero3.py --backend nccl --qcoll-backend nccl \
    --ranks 4 --node-size 2 --steps 30 --log-every 10
  step train_fsdp2_nccl 120 python3 examples/train_fsdp2.py --backend nccl \
    --ranks 4 --node-size 2 --steps 30 --log-every 10
  # Hardware counters of the kernels that miss their targets most (bench/gpu/profile_kernels.py):
  # the report (tens of MB: read it on the machine) and its details page.
  step ncu_kernels 150 bash -c "ncu --clock-control none --set full --import-source no \
      -k 'regex:team_kernel|elementwise_kernel' -f -o '$OUT_DIR/ncu-kernels' \
      python3 bench/gpu/profile_kernels.py \
    && ncu -i '$OUT_DIR/ncu-kernels.ncu-rep' --page details > '$OUT_DIR/ncu-details.txt'"
  # Last: the CPU tests (CI runs them too), with whatever time is left.
  pytest_step tests_rest 240 120 --continue-on-collection-errors tests -m "not gpu"
fi

# One results file: the steps and every suite's JSON.
python3 - "$STEPS" "$WORK" "$OUT_DIR/gpu-results.json" "$BUDGET" <<'EOF'
import datetime, json, os, sys
steps_path, work, out, budget = sys.argv[1:]
steps = [json.loads(line) for line in open(steps_path)]
result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "command": "bash bench/gpu/run.sh", "budget_s": int(budget), "steps": steps,
          "failed_steps": [s["step"] for s in steps if s["rc"] != 0]}
for name in ("kernels-cuda", "kernels-cuda-large", "trace-calls", "collectives-nccl"):
    path = os.path.join(work, name + ".json")
    result[name.replace("-", "_")] = json.load(open(path)) if os.path.exists(path) else None
json.dump(result, open(out, "w"), indent=1)
print("steps:", {s["step"]: s["rc"] for s in steps})
EOF
rm -rf "$WORK"
