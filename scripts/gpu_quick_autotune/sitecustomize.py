"""Triton autotuning cut to the first config that compiles, for a short GPU lease (device checks only).

flash-linear-attention's and mamba-ssm's kernels autotune over many configs; on a fresh
machine compiling them all took longer than a lent GPU's minutes (the mixer tests ran out of
time in compilation, 2026-11-26). Put this folder on PYTHONPATH (Python imports
`sitecustomize` at start-up, in spawned ranks too): each autotuner then benchmarks its configs
in order until one compiles and runs, and keeps that one. Results are exact either way (the
config changes speed, not arithmetic); timings measured under it are of an untuned config.
Not part of cpcompose: nothing in the package or the suite imports it.
"""

import sys

try:
    from triton.runtime import autotuner as _autotuner
except ImportError:  # no triton here: nothing to cut
    pass
else:
    _run, _bench = _autotuner.Autotuner.run, _autotuner.Autotuner._bench

    def run(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._first_found = False
        return _run(self, *args, **kwargs)

    def bench(self, *args, config, **meta):  # type: ignore[no-untyped-def]
        if getattr(self, "_first_found", False):
            return [float("inf")] * 3
        timings = _bench(self, *args, config=config, **meta)
        self._first_found = timings[0] != float("inf")
        return timings

    _autotuner.Autotuner.run, _autotuner.Autotuner._bench = run, bench
    print("gpu_quick_autotune: Triton autotuning keeps the first config that runs", file=sys.stderr)
