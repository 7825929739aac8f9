"""Cost of logging one training step's scalars to TensorBoard, and of the whole metric logger.

Each step writes ~45 scalars (a real step record of the tiny preset: losses, 15 block positions,
3 buckets, perf figures). Compared, interleaved over ``--repeats`` rounds:

- ``one_event_private``: one Summary with every scalar through ``SummaryWriter._get_file_writer()``
  (a private torch API; what the logger did before);
- ``one_event_public``: the same Summary through ``torch.utils.tensorboard.writer.FileWriter`` (public);
- ``add_scalar_each``: ``SummaryWriter.add_scalar`` once per scalar (public, one event each);
- ``metric_logger``: :class:`train.components.metrics.MetricLogger` ``log()`` per step (JSONL + TensorBoard).

Figures are ms per step, median of the per-round medians, with min/max over rounds; the load average
is recorded beside them (the machine is shared).

    .venv/bin/python bench/bench_metrics.py [--steps 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from train.components.metrics import MetricLogger
from train.config import MetricsConfig

RESULTS = Path(__file__).resolve().parent / "results"


def step_record(step: int) -> dict[str, float]:
    rec = {f"train/{k}": 1.0 / step for k in (
        "loss", "acceptance_length", "lr", "grad_norm", "skipped", "skipped_total", "loss_z", "grad_norm_z",
        "n_tokens", "n_blocks", "padding_fraction", "epoch", "batch_index", "bucket", "step_time_s",
        "tokens_per_s", "loss_smooth", "acceptance_length_smooth")}
    rec.update({f"acc/pos_{k}": 0.5 for k in range(1, 16)})
    rec.update({f"loss/bucket_{b}": 2.0 for b in range(3)})
    rec.update({f"perf/{k}": 3.0 for k in ("data_wait_ms", "step_cpu_s", "queue_depth", "queue_mb", "loader_wait_ms")})
    return rec


def _summary(rec: dict[str, float]):
    from tensorboard.compat.proto.summary_pb2 import Summary

    return Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in rec.items()])


def run_private(d: Path, steps: int) -> float:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(d))
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        w._get_file_writer().add_summary(_summary(step_record(s)), global_step=s)
    w.flush()
    dt = time.perf_counter() - t0
    w.close()
    return dt


def run_public(d: Path, steps: int) -> float:
    from torch.utils.tensorboard.writer import FileWriter

    w = FileWriter(str(d))
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        w.add_summary(_summary(step_record(s)), global_step=s)
    w.flush()
    dt = time.perf_counter() - t0
    w.close()
    return dt


def run_add_scalar(d: Path, steps: int) -> float:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(d))
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        for k, v in step_record(s).items():
            w.add_scalar(k, v, global_step=s)
    w.flush()
    dt = time.perf_counter() - t0
    w.close()
    return dt


def run_logger(d: Path, steps: int) -> float:
    m = MetricLogger(d, MetricsConfig())
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        m.log(s, step_record(s))
    m.flush()
    dt = time.perf_counter() - t0
    m.close()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    variants = {"one_event_private": run_private, "one_event_public": run_public,
                "add_scalar_each": run_add_scalar, "metric_logger": run_logger}
    per_round: dict[str, list[float]] = {k: [] for k in variants}
    loads = []
    tmp = Path(tempfile.mkdtemp(prefix="bench_metrics_"))
    try:
        for r in range(args.repeats):
            for name, fn in variants.items():
                loads.append(os.getloadavg()[0])
                per_round[name].append(fn(tmp / f"{name}{r}", args.steps) / args.steps * 1e3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = {
        "steps_per_round": args.steps, "scalars_per_step": len(step_record(1)), "repeats": args.repeats,
        "ms_per_step": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                        for k, v in per_round.items()},
        "loadavg_1min": {"min": min(loads), "max": max(loads)},
    }
    res["public_over_private"] = (res["ms_per_step"]["one_event_public"]["median"]
                                  / res["ms_per_step"]["one_event_private"]["median"])
    print(json.dumps(res, indent=1))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_metrics.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
