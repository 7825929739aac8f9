"""One metric logger: every step, keyed by optimizer step, to TensorBoard and ``RUN/metrics.jsonl``.

Nothing here looks at a clock to decide what to average: a smoothed value is the mean of the
last ``smoothing_window`` logged steps, divided by the number of steps it actually covers.
On resume from a checkpoint at step S, lines past S are dropped from ``metrics.jsonl`` and
TensorBoard is told to purge events from step S+1 on, so the logs hold every step exactly once.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash_cache.runtime.schema import MetricsConfig

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tensorboard"
SMOOTHED = ("loss", "acceptance_length")  # keys that also get a "<key>_smooth" companion


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of ``RUN/metrics.jsonl`` in file order; a torn last line (crash) is ignored."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # only the last line can be torn by a crash; nothing after it is trusted
    return records


def truncate_metrics(run_dir: str | Path, last_step: int) -> list[dict[str, Any]]:
    """Keep only records with ``step <= last_step`` (rewritten atomically); return them."""
    path = Path(run_dir) / METRICS_FILE
    kept = [r for r in read_metrics(run_dir) if int(r["step"]) <= last_step]
    if path.is_file():
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, path)
    return kept


def _is_scalar(v: Any) -> bool:
    return isinstance(v, int | float)  # bools are ints: logged as 0/1


def tb_tag(key: str) -> str:
    """TensorBoard tag of a JSONL key: grouped keys ("acc/pos_1") as-is, others under "train/"."""
    return key if "/" in key else f"train/{key}"


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # "nan" / "inf": JSON has no such numbers
    return v


class MetricLogger:
    """Writes one record per optimizer step. Only rank 0 writes (``enabled=False`` elsewhere)."""

    def __init__(
        self, run_dir: str | Path, cfg: MetricsConfig, *, resume_step: int = 0, enabled: bool = True
    ) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.enabled = enabled
        self.last_step = resume_step
        self._windows: dict[str, deque[float]] = {k: deque(maxlen=cfg.smoothing_window) for k in SMOOTHED}
        self._tb = None
        self._file = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for rec in truncate_metrics(self.run_dir, resume_step):
            self._push_windows(rec)
        self._file = open(self.run_dir / METRICS_FILE, "a", buffering=1)  # noqa: SIM115 - closed in close()
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard drops events >= resume_step + 1 written by the interrupted run
            self._tb = SummaryWriter(str(self.run_dir / TB_DIR), purge_step=resume_step + 1)

    def _push_windows(self, rec: Mapping[str, Any]) -> None:
        for k, win in self._windows.items():
            v = rec.get(k)
            if isinstance(v, int | float) and math.isfinite(v) and not rec.get("skipped"):
                win.append(float(v))

    def log(self, step: int, values: Mapping[str, Any]) -> dict[str, Any]:
        """Log one step. Scalars go to TensorBoard under their key; everything goes to the JSONL."""
        if step <= self.last_step and self.enabled:
            raise ValueError(f"metrics step {step} logged after step {self.last_step}: steps must increase")
        self.last_step = step
        rec: dict[str, Any] = {"step": step, **values}
        self._push_windows(rec)
        for k, win in self._windows.items():
            if win:
                rec[f"{k}_smooth"] = sum(win) / len(win)  # divides by the steps actually covered
        if not self.enabled:
            return rec
        assert self._file is not None
        self._file.write(json.dumps({k: _jsonable(v) for k, v in rec.items()}) + "\n")
        if self._tb is not None:
            self._write_tb(step, rec)
        return rec

    def _write_tb(self, step: int, rec: Mapping[str, Any]) -> None:
        """All scalars of a step in one event (one Summary with many values: ~10x cheaper than add_scalar each)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tb_tag(k), simple_value=float(v))
                  for k, v in rec.items() if k != "step" and _is_scalar(v)]
        assert self._tb is not None
        self._tb._get_file_writer().add_summary(Summary(value=values), global_step=step)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        self.flush()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._file is not None:
            self._file.close()
            self._file = None
