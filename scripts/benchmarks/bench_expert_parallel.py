"""Benchmark: expert parallelism (ep = 4) against FSDP alone on 4 CPU ranks, an expert-heavy Qwen3-MoE.

The model: a Qwen3-MoE of `--layers` MoE layers (default 2), `--experts` experts (32), 2 per token, hidden
`--hidden` (256), expert intermediate `--moe-inter` (512), float32, a 128-token vocabulary; the experts hold
98% of the parameters. transformers zeroes the router at init (every token would pick experts 0 and 1): its
weight is drawn N(0, `--router-std`) here. The load-balancing loss is on (`router_aux_loss_coef` =
`--router-aux`, 0.01) and the learning rate low (`--lr`, 1e-4): at 1e-3 without it the router collapsed within
4 steps (one EP rank received 99% of the second layer's rows), which measures a broken router rather than EP.
The busiest EP rank's rows over the mean is recorded per layer and step. The folder is written with
`save_pretrained` and trained by cpcompose's Trainer (`python -m cpcompose.train`'s path: `parallelize_hf_model`,
FSDP2, the checkpoint reader), on the synthetic copy task, `--batch` sequences of `--seq-len` tokens a step
(4 x 1,024 by default), each of the 4 ranks its own sequence (`parallelism.dp_shard = 4`), in two settings on
the same ranks:

  fsdp   parallelism.ep = 1: every parameter FSDP-sharded 4 ways; each MoE layer's experts are gathered whole
         for its forward and again for its backward, and their gradients reduce-scattered.
  ep4    parallelism.ep = 4: each rank holds 8 of the 32 experts of each layer whole (the experts' FSDP axis
         efsdp = dp_shard / ep = 1), the routed (token, choice) rows travel to their expert's rank and back
         (an uneven all-to-all each way, and the same two in the backward); the dense weights as in fsdp.

Every measurement is a fresh set of 4 rank processes (this file with `--_rank`, so no memory of the launcher's
is counted); the settings take turns (fsdp, ep4, fsdp, ep4, ...) so that a machine that slows down slows both
alike, and the table gives medians over the repeats. Per rank and step:

* peak memory: the process's resident high-water mark (VmHWM), the most over the ranks (the median over the
  repeats);
* the expert state the rank holds at rest (its experts' parameters, gradients and the two AdamW moments,
  measured from the local tensors after the last step: FSDP's shards or EP's blocks), and the expert weights
  present while a layer's experts compute (a forward pre-hook on each experts module sums its parameters: under
  FSDP the unit has been gathered whole, under EP it is the rank's block; the backward holds as many gradient
  bytes again);
* the step's wall time (a barrier before each step; the slowest rank's; the median over the steps after
  `--warmup` and the repeats);
* bytes sent by this rank, by operation, in CommMeter's convention (`cpcompose/comm/meter.py`: an all-gather
  sends the rank's input to W - 1 peers, a reduce-scatter (W - 1)/W of its input, an all-to-all its rows for
  other ranks). cpcompose's own collectives (the token dispatch) feed the trainer's CommMeter; FSDP2's do not,
  so this benchmark wraps `torch.distributed.all_gather_single` / `reduce_scatter_single` (what FSDP2 posts)
  and `all_reduce` / `all_gather_into_tensor` (the gradient norm, the loss, the dispatch's agreement) and counts
  their tensors in the same convention.

The losses of the two settings are recorded per step: the same model, data and math, so they agree to float32
rounding (the experts' rows are summed in another order).

    python scripts/benchmarks/bench_expert_parallel.py --repeats 5 --out docs/bench/expert_parallel_2026-11-29.json
    python scripts/benchmarks/bench_expert_parallel.py --quick     # a small model, 1 repeat: a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import ROOT, fmt, machine, markdown_table, write_json

WORLD = 4
SETTINGS = {"fsdp": 1, "ep4": 4}  # name -> parallelism.ep


# --- the model ---


def make_model(folder: Path, *, hidden: int, experts: int, moe_inter: int, layers: int, seq_len: int,
               router_std: float, aux: float) -> tuple[Path, int, int]:
    """A float32 Qwen3-MoE, every layer MoE, 2 experts per token, its router drawn N(0, 1), saved in `folder`."""
    import torch
    import transformers as hf

    heads = max(1, hidden // 64)
    config = hf.Qwen3MoeConfig(
        vocab_size=128, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, head_dim=hidden // heads, intermediate_size=moe_inter,
        moe_intermediate_size=moe_inter, num_experts=experts, num_experts_per_tok=2, decoder_sparse_step=1,
        norm_topk_prob=True, output_router_logits=aux > 0, router_aux_loss_coef=aux, max_position_embeddings=seq_len,
        tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, router_std)
    model.save_pretrained(folder)
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return folder, total, expert


def trainer_argv(folder: Path, ep: int, *, seq_len: int, batch: int, steps: int, lr: float, dump: str) -> list[str]:
    return [
        "--model.name=hf", f"--model.path={folder}", "--data.source=synthetic", "--data.task=copy",
        "--data.num_symbols=64", f"--training.seq_len={seq_len}", f"--training.batch_size={batch}",
        f"--training.steps={steps}", "--training.device=cpu", "--training.mixed_precision=float32",
        "--parallelism.cp=1", f"--parallelism.dp_shard={WORLD}", f"--parallelism.ep={ep}",
        "--parallelism.cp_verify=false", "--checkpoint.enable=false", "--metrics.enable_tensorboard=false",
        "--metrics.plot_loss=false", "--metrics.log_freq=1000", "--lr_scheduler.warmup_steps=1",
        f"--optimizer.lr={lr}", f"--job.dump_folder={dump}",
    ]


# --- one rank (a fresh process) ---


class _Counted:
    """Bytes this rank sends through torch.distributed's collectives that cpcompose's meter does not see."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        for name, sent in (
            ("all_gather_single", lambda out, inp, w: (w - 1) * _nbytes(inp)),  # FSDP2's parameter all-gather
            ("reduce_scatter_single", lambda out, inp, w: _nbytes(inp) * (w - 1) // w),  # its gradient reduction
            ("all_reduce", lambda t, _unused, w: 2 * _nbytes(t) * (w - 1) // w),  # a ring all-reduce
            ("all_gather_into_tensor", lambda out, inp, w: (w - 1) * _nbytes(inp)),
        ):
            self._wrap(dist, name, sent)

    def _wrap(self, dist: Any, name: str, sent: Any) -> None:
        original = getattr(dist, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            world = dist.get_world_size(group)
            first = args[0] if args else kwargs.get("output_tensor", kwargs.get("output", kwargs.get("tensor")))
            second = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
            if not hasattr(second, "numel"):  # all_reduce's second argument is its op
                second = None
            key = name.replace("_single", "").replace("_into_tensor", "")
            self.bytes[key] = self.bytes.get(key, 0) + int(sent(first, second, world))
            self.calls[key] = self.calls.get(key, 0) + 1
            return original(*args, **kwargs)

        setattr(dist, name, wrapped)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


def _nbytes(t: Any) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def rank_main(rank: int, spec: dict[str, Any], out: str) -> None:
    """Build the Trainer, run its steps, write this rank's numbers to `out`."""
    import torch
    import torch.distributed as dist

    from cpcompose.config import load_config
    from cpcompose.training.loop.trainer import Trainer
    from cpcompose.training.memory.resources import peak_resident_bytes

    torch.set_num_threads(1)  # 4 ranks on this machine's cores: one thread each (common.py's rule gives 1 too)
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=spec["timeout"]))
    try:
        counted = _Counted()
        trainer = Trainer(load_config(spec["argv"]))
        built_mib = peak_resident_bytes() / 2**20
        routed: dict[str, list[int]] = {}  # this step's (token, choice) pairs per global expert, per MoE layer
        in_use = [0]  # the most expert weight bytes present on this rank while a layer's experts compute

        def count(name: str) -> Any:
            def hook(module: Any, args: Any, output: Any) -> None:
                routed[name] = torch.bincount(output[2].reshape(-1), minlength=module.weight.shape[0]).tolist()
            return hook

        def present(module: Any, args: Any) -> None:  # FSDP has gathered the unit: its parameters are whole
            in_use[0] = max(in_use[0], sum(_nbytes(p) for p in module.parameters()))

        for name, module in trainer.model.named_modules():
            if name.endswith("mlp.gate"):
                module.register_forward_hook(count(name))
            elif name.endswith("mlp.experts"):
                module.register_forward_pre_hook(present)
        walls, losses, meter, other, routing = [], [], [], [], []
        for _ in range(trainer.config.training.steps):
            trainer.meter.reset()
            counted.reset()
            dist.barrier()
            start = time.perf_counter()
            losses.append(trainer.train_step())
            walls.append(time.perf_counter() - start)
            meter.append(dict(trainer.meter.bytes_sent))
            other.append({k: v for k, v in counted.bytes.items()})
            routing.append([routed[k] for k in sorted(routed)])
            routed.clear()
        dist.barrier()
        experts = [(n, p) for n, p in trainer.model.named_parameters() if ".mlp.experts." in n]
        params = sum(_nbytes(_local(p)) for _, p in experts)
        grads = sum(_nbytes(_local(p.grad)) for _, p in experts if p.grad is not None)
        moments = sum(_nbytes(_local(v)) for _, p in experts for k, v in trainer.optimizer.state[p].items()
                      if k in ("exp_avg", "exp_avg_sq"))
        full = {n: tuple(p.shape) for n, p in experts}  # a DTensor's shape is the whole tensor's
        result = {
            "rank": rank, "peak_mib": peak_resident_bytes() / 2**20, "built_mib": built_mib, "step_s": walls,
            "losses": losses, "routed": routing, "meter_bytes": meter, "torch_bytes": other,
            "threads": torch.get_num_threads(),
            "expert_params_bytes": params, "expert_grads_bytes": grads, "expert_adam_bytes": moments,
            "expert_weights_in_use_bytes": in_use[0],
            "expert_full_shapes": full,
            "expert_kinds": sorted({type(m).__name__ for n, m in trainer.model.named_modules()
                                    if n.endswith("mlp.experts")}),
        }
        Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as common.exit_rank: no interpreter teardown racing gloo's threads


# --- the launcher ---


def trial(folder: Path, name: str, a: argparse.Namespace) -> dict[str, Any]:
    """One setting on 4 fresh rank processes; its per-rank numbers."""
    with tempfile.TemporaryDirectory(prefix="cpcompose-ep-") as tmp:
        argv = trainer_argv(folder, SETTINGS[name], seq_len=a.seq_len, batch=a.batch, steps=a.warmup + a.steps,
                            lr=a.lr, dump=os.path.join(tmp, "dump"))
        spec = json.dumps({"store": os.path.join(tmp, "store"), "timeout": a.timeout, "argv": argv})
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(WORLD)]
        start = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, __file__, "--_rank", str(r), "--_spec", spec, "--_out", outs[r]],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
                 for r in range(WORLD)]
        errors = [p.communicate(timeout=a.timeout)[1] for p in procs]
        if any(p.returncode for p in procs):
            tail = next((e for e in errors if e.strip()), "(no output)")
            raise RuntimeError(f"{name} failed:\n{tail[-3000:]}")
        ranks = [json.loads(Path(o).read_text()) for o in outs]
        return {"setting": name, "ep": SETTINGS[name], "wall_s": round(time.perf_counter() - start, 1),
                "routed": routed_over_ranks(ranks), "ranks": ranks}


def routed_over_ranks(ranks: list[dict[str, Any]]) -> list[list[list[int]]]:
    """Per step, per MoE layer, per expert: the (token, choice) pairs of every rank's tokens (the ranks' own
    histograms summed, and left out of their records)."""
    steps = zip(*(r["routed"] for r in ranks))
    routed = [[[sum(col) for col in zip(*layer)] for layer in zip(*step)] for step in steps]
    for r in ranks:
        del r["routed"]
    return routed


def summarise(trials: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """One setting over its repeats: medians of the step, the most of the peaks, the bytes of a measured step."""
    steps = [max(r["step_s"][i] for r in t["ranks"]) for t in trials
             for i in range(warmup, len(t["ranks"][0]["step_s"]))]
    ranks = trials[0]["ranks"]
    sent = []  # per rank: the bytes of its measured steps, by operation, averaged over them
    for r in ranks:
        ops: dict[str, float] = {}
        measured = list(zip(r["meter_bytes"], r["torch_bytes"]))[warmup:]
        for meter, other in measured:
            for k, v in meter.items():
                ops[f"cpcompose {k}"] = ops.get(f"cpcompose {k}", 0) + v / len(measured)
            for k, v in other.items():
                ops[f"torch {k}"] = ops.get(f"torch {k}", 0) + v / len(measured)
        sent.append(ops)
    held = [r["expert_params_bytes"] + r["expert_grads_bytes"] + r["expert_adam_bytes"] for r in ranks]
    ep = trials[0]["ep"]
    # per MoE layer and measured step: the rows the busiest of the 4 expert blocks receives (every rank's tokens)
    # over the mean; under EP that block's rank is the one the others wait for
    imbalance = []
    for t in trials:
        for step in t["routed"][warmup:]:
            for per_expert in step:
                block = len(per_expert) // WORLD
                loads = [sum(per_expert[b * block:(b + 1) * block]) for b in range(WORLD)]
                imbalance.append(max(loads) * WORLD / sum(loads))
    return {
        "ep": ep, "median_step_s": statistics.median(steps), "steps_s": steps,
        "min_step_s": min(steps),
        "peak_mib": statistics.median(max(r["peak_mib"] for r in t["ranks"]) for t in trials),
        "peak_mib_per_repeat": [max(r["peak_mib"] for r in t["ranks"]) for t in trials],
        "built_mib": max(r["built_mib"] for t in trials for r in t["ranks"]),
        "expert_params_bytes": max(r["expert_params_bytes"] for r in ranks),
        "expert_state_bytes": max(held),
        "expert_weights_in_use_bytes": max(r["expert_weights_in_use_bytes"] for r in ranks),
        "bytes_sent_per_step": max(sum(s.values()) for s in sent),
        "bytes_sent_by_op": {k: max(s.get(k, 0) for s in sent) for k in sorted({k for s in sent for k in s})},
        "busiest_block_over_mean": [round(x, 3) for x in imbalance],
        "busiest_block_over_mean_median": statistics.median(imbalance),
        "losses": trials[0]["ranks"][0]["losses"], "expert_kinds": ranks[0]["expert_kinds"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--moe-inter", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4, help="sequences a step, over the 4 ranks")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the times")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per trial")
    ap.add_argument("--repeats", type=int, default=3, help="trials per setting, interleaved")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--router-std", type=float, default=1.0, help="the router weight's initial N(0, std)")
    ap.add_argument("--router-aux", type=float, default=0.01, help="router_aux_loss_coef (0: no router loss)")
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--quick", action="store_true", help="a small model, 1 repeat, 2 steps: a smoke run")
    ap.add_argument("--out", type=Path, default=ROOT / "bench_results" / "expert_parallel.json")
    a = ap.parse_args()
    if a.quick:
        a.experts, a.hidden, a.moe_inter, a.seq_len, a.warmup, a.steps, a.repeats = 16, 64, 64, 128, 1, 1, 1
    with tempfile.TemporaryDirectory(prefix="cpcompose-ep-model-") as tmp:
        folder, total, expert = make_model(Path(tmp), hidden=a.hidden, experts=a.experts, moe_inter=a.moe_inter,
                                           layers=a.layers, seq_len=a.seq_len, router_std=a.router_std,
                                           aux=a.router_aux)
        print(f"Qwen3-MoE: {a.layers} layers, {a.experts} experts (2 per token), hidden {a.hidden}, expert "
              f"intermediate {a.moe_inter}: {total / 1e6:.1f} M parameters, {expert / 1e6:.1f} M in experts "
              f"({expert / total:.1%}); {a.batch} x {a.seq_len} tokens a step on {WORLD} ranks", flush=True)
        trials: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
        for repeat in range(a.repeats):
            for name in SETTINGS:
                got = trial(folder, name, a)
                trials[name].append(got)
                times = [max(r["step_s"][i] for r in got["ranks"]) for i in range(a.warmup, a.warmup + a.steps)]
                print(f"repeat {repeat + 1} {name:<5} steps {' '.join(f'{t:.2f}' for t in times)} s, peak "
                      f"{max(r['peak_mib'] for r in got['ranks']):,.0f} MiB ({got['wall_s']} s)", flush=True)
    table = {name: summarise(t, a.warmup) for name, t in trials.items()}
    rows = []
    for name, s in table.items():
        rows.append([
            name, str(s["ep"]), fmt(s["peak_mib"]), fmt(s["expert_state_bytes"] / 2**20, "{:,.1f}"),
            fmt(s["expert_weights_in_use_bytes"] / 2**20, "{:,.1f}"), fmt(s["median_step_s"], "{:.2f}"),
            fmt(s["bytes_sent_per_step"] / 2**20, "{:,.1f}"),
            ", ".join(f"{k.split()[-1]} {v / 2**20:,.1f}" for k, v in s["bytes_sent_by_op"].items() if v >= 2**16),
        ])
    print("\n" + markdown_table(
        ["setting", "ep", "peak RSS (MiB/rank)", "expert state held (MiB/rank)", "expert weights in use (MiB/rank)",
         "median step (s)", "sent (MiB/rank/step)", "by operation (MiB)"], rows,
        left=("setting", "by operation (MiB)")))
    f, e = table["fsdp"], table["ep4"]
    drift = max(abs(x - y) / abs(x) for x, y in zip(f["losses"], e["losses"]))
    print(f"\nep4 / fsdp: step {e['median_step_s'] / f['median_step_s']:.2f}, peak {e['peak_mib'] / f['peak_mib']:.2f},"
          f" bytes {e['bytes_sent_per_step'] / f['bytes_sent_per_step']:.3f}; losses agree to {drift:.1e} relative; "
          f"the busiest EP rank's rows over the mean: {e['busiest_block_over_mean_median']:.2f} (median over layers "
          f"and steps)")
    write_json(a.out, {
        "machine": machine(), "world": WORLD,
        "model": {"family": "qwen3_moe", "layers": a.layers, "experts": a.experts, "top_k": 2, "hidden": a.hidden,
                  "moe_intermediate": a.moe_inter, "vocab": 128, "dtype": "float32", "parameters": total,
                  "expert_parameters": expert},
        "batch": a.batch, "seq_len": a.seq_len, "warmup": a.warmup, "steps": a.steps, "repeats": a.repeats,
        "summary": table, "loss_max_rel_diff": drift, "trials": trials,
    })
    print(f"wrote {a.out}")


if __name__ == "__main__":
    if "--_rank" in sys.argv:  # a rank started by `trial`
        w = argparse.ArgumentParser()
        w.add_argument("--_rank", type=int)
        w.add_argument("--_spec")
        w.add_argument("--_out")
        r = w.parse_args()
        rank_main(r._rank, json.loads(r._spec), r._out)
    else:
        main()
