#!/bin/bash
# One short GPU lease (minutes, all tries together), in order of priority, each step under its own `timeout` and
# the whole under TOTAL_S seconds (default 420), so the lease's one call returns with everything:
#   a. env.txt: nvidia-smi, versions, which mixer kernels import (fla's GDN, mamba-ssm's Triton SSD);
#   b. the mixer gpu tests (tests/mixers -m gpu) on those kernels, printing which ran;
#   c. bench_mixers.py --device cuda at L = 4096, then 16384 (mamba2, gdn), few repeats;
#   d. the whole gpu-marked suite, less (b)'s file;
#   e. scripts/gpu_longest.py with the time left.
# (scripts/run_gpu_checks.sh runs the same and the kernel/attention benchmarks, for a longer lease.)
# Logs go to a work folder; after every step it is packed into ONE file, $OUT/gpu_results.tgz, with
# $OUT/summary.txt (env.txt and the last lines of each log): the device tool brings back 8 files at most.
# The missing packages travel as wheels (.whl, README's GPU notes):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site; bash scripts/gpu_session.sh
# STEPS (default "a b c d e") picks steps; RUN_ECHO=1 prints each step's command instead of running it (the
# plumbing, checked on a machine without a GPU).
set -o pipefail
out=${1:-${OUT:-gpu_results}}
work=$(mktemp -d /tmp/gpu_session.XXXX)
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
total=${TOTAL_S:-420}
steps=" ${STEPS:-a b c d e} "

left() { echo $(( total - SECONDS )); }

pack() {  # everything so far into the two files that come back
  tar czf "$out/gpu_results.tgz" -C "$work" . 2>/dev/null
  {
    echo "gpu_session: ${SECONDS}s of ${total}s"
    cat "$work/steps.txt" 2>/dev/null
    cat "$work/env.txt" 2>/dev/null
    for log in "$work"/*.log; do
      [ -f "$log" ] || continue
      echo "===== $(basename "$log") (last lines)"
      tail -n "${TAIL_LINES:-30}" "$log"
    done
  } > "$out/summary.txt"
}
trap pack EXIT

# step NAME SECONDS LOG COMMAND...: COMMAND under `timeout` (at most what the total leaves, less RESERVE_S for
# the steps after it), its output in LOG, its exit status and time in steps.txt.
step() {
  local name=$1 limit=$2 log=$3; shift 3
  case $steps in *" $name "*) ;; *) echo "step $name: not asked for" >> "$work/steps.txt"; return ;; esac
  local room=$(( $(left) - ${RESERVE_S:-10} ))
  [ "$limit" -gt "$room" ] && limit=$room
  if [ "$limit" -lt "${MIN_STEP_S:-20}" ]; then
    echo "step $name: skipped, ${limit}s left" >> "$work/steps.txt"; pack; return
  fi
  local start=$SECONDS
  if [ -n "$RUN_ECHO" ]; then
    echo "timeout $limit $*" > "$work/$log"
  else
    timeout "$limit" "$@" > "$work/$log" 2>&1
  fi
  local rc=$?
  local how="exit $rc"; [ $rc -eq 124 ] && how="$how (timed out)"
  echo "step $name: $how in $(( SECONDS - start ))s (limit ${limit}s): $log" >> "$work/steps.txt"
  pack
}

env_report() {
  nvidia-smi
  python3 -c "import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.device_count())"
  python3 -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|triton|pytest|pytest-timeout|regex|tokenizers) "
  python3 -m pip list 2>/dev/null | grep -i -E "^(flash.linear.attention|fla.core|mamba.ssm|causal.conv1d|huggingface.hub) "
  python3 -c "import transformers; print('transformers imported from', transformers.__file__, transformers.__version__)"
  # Which scan kernels the mixer tests and the benchmark run on CUDA.
  python3 -c "
from cpcompose.mixers.triton_scans import fla_chunk_gated_delta_rule, mamba_chunk_scan_combined
for found in (fla_chunk_gated_delta_rule(), mamba_chunk_scan_combined()):
    state = 'importable' if found.kernel else 'NOT importable (' + found.reason + '): torch fallback'
    print('mixer kernels:', found.name, state)
"
  nproc
}

export -f env_report
# pytest-timeout (on the device image) ends one hung test with its traceback before the step's `timeout` kills all.
has_timeout=""; python3 -c "import pytest_timeout" 2>/dev/null && has_timeout=1
step a 45 env.txt bash -c env_report
# Two tests (fla, mamba_ssm), each printing its kernel and every comparison's error; the first compiles the kernels.
step b "${MIXERS_S:-150}" mixer_tests.log python3 -m pytest tests/mixers -m gpu -s -rA --durations=10 \
  ${has_timeout:+--timeout=130} --junitxml="$work/mixer_tests.xml"
# One length a call, so a timeout at 16384 keeps 4096's table (the script prints it at its end).
for n in 4096 16384; do
  step c "${BENCH_S:-55}" "bench_mixers_$n.log" python3 scripts/benchmarks/bench_mixers.py --device cuda --seq-lens $n \
    --kinds mamba2 gdn --warmup 1 --repeats 3 --out "$work/mixers_cuda_$n.json"
done
# transformers/torchtitan hold no gpu tests; (b)'s file already ran.
step d "${SUITE_S:-170}" gpu_suite.log python3 -m pytest -m gpu --ignore=tests/integrations/test_torchtitan.py \
  --ignore=tests/integrations/test_transformers.py --ignore=tests/mixers/test_kernel_apis.py -rfE --durations=20 \
  --maxfail="${MAXFAIL:-300}" ${has_timeout:+--timeout=150} --junitxml="$work/junit.xml"
longest=$(( $(left) - 15 ))
step e "$longest" longest_gpu.log python3 scripts/gpu_longest.py --time-budget $(( longest > 90 ? longest - 45 : 45 )) \
  --out "$work/longest_gpu.json"
