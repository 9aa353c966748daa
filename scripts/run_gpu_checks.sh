#!/bin/bash
# Everything a lent GPU should run, in one go (GPUs are lent to some sessions only, for minutes):
# the GPU suite, the CUDA kernel benchmark, the attention benchmarks (dense and packed) and the
# mixers' (their gpu tests are in the suite: tests/mixers/test_kernel_apis.py runs fla's and
# mamba-ssm's APIs through cpcompose.mixers on CUDA, with their CUDA kernels where installed).
#
#   bash scripts/run_gpu_checks.sh [OUTDIR]     # default: gpu_results/ (or $OUT on the device tool)
#
# Writes env.txt, gpu_suite.log, junit.xml, cuda_kernels.json/.log, attention_cuda.json,
# attention_cuda_packed.json, mixers_cuda.json and bench*.log. Uses the machine's own torch (no network):
# cpcompose is installed without dependencies, or imported from the checkout. Each step has
# a time limit (SUITE_S, KERNELS_S, BENCH_S seconds) so one hung step cannot eat the lease;
# MAXFAIL caps the suite's failures, NO_BENCH=1 runs the suite only. Last, the longest sequence one GPU trains
# (scripts/gpu_longest.py: real steps against the plan and the rehearsal, longest_gpu.json/.log, LONGEST_S
# seconds, default 540; NO_LONGEST=1 skips it; alone: python3 scripts/gpu_longest.py --out "$OUT/longest_gpu.json").
set -o pipefail
out=${1:-${OUT:-gpu_results}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi
  python3 -c "import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.device_count(), torch.backends.cudnn.version())"
  python3 -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|tensorboard|pytest|pytest-timeout|flash.attn|torchtitan|flash.linear.attention|fla.core|mamba.ssm|causal.conv1d|triton) "
  # Which mixer kernels the mixer tests and benchmark ran: the CUDA libraries, or transformers' torch fallbacks.
  for m in fla mamba_ssm causal_conv1d; do
    python3 -c "import $m" 2>/dev/null && echo "mixer kernels: $m importable" || echo "mixer kernels: $m NOT importable (torch fallback)"
  done
  nproc
} > "$out/env.txt" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . >> "$out/env.txt" 2>&1 || echo "pip install failed: importing from the checkout" >> "$out/env.txt"
timeout_opt=""; python3 -c "import pytest_timeout" 2>/dev/null && timeout_opt="--timeout=150"
# transformers/torchtitan hold no gpu tests; ignoring them keeps a machine without them collecting.
timeout "${SUITE_S:-420}" python3 -m pytest -m gpu --ignore=tests/integrations/test_torchtitan.py \
  --ignore=tests/integrations/test_transformers.py -rfE --durations=20 --maxfail="${MAXFAIL:-300}" $timeout_opt \
  --junitxml="$out/junit.xml" 2>&1 | tee "$out/gpu_suite.log"
echo "suite exit: $?"
[ -n "$NO_BENCH" ] && exit 0
timeout "${KERNELS_S:-90}" python3 scripts/benchmarks/bench_cuda_kernels.py --out "$out/cuda_kernels.json" 2>&1 | tee "$out/cuda_kernels.log"
timeout "${BENCH_S:-150}" python3 scripts/benchmarks/bench_attention.py --device cuda --out "$out/attention_cuda.json" 2>&1 | tee "$out/bench.log"
timeout "${BENCH_S:-150}" python3 scripts/benchmarks/bench_attention.py --device cuda --packed --out "$out/attention_cuda_packed.json" 2>&1 | tee "$out/bench_packed.log"
timeout "${BENCH_S:-150}" python3 scripts/benchmarks/bench_mixers.py --device cuda --seq-lens 4096 16384 --kinds mamba2 mamba2_linear gdn \
  --repeats 3 --out "$out/mixers_cuda.json" 2>&1 | tee "$out/bench_mixers.log"
[ -n "$NO_LONGEST" ] && exit 0
timeout "${LONGEST_S:-540}" python3 scripts/gpu_longest.py --time-budget $(( ${LONGEST_S:-540} - 60 )) \
  --out "$out/longest_gpu.json" 2>&1 | tee "$out/longest_gpu.log"
