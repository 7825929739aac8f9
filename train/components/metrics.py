"""One metric logger: records keyed by optimizer step, to ``RUN/metrics.jsonl``, TensorBoard and (optionally)
Weights & Biases. Every tag is listed in docs/metrics.md (a test checks the page against a real run).

A record has a ``kind``: ``train`` (one per step, written and flushed before the eval and checkpoint work
that may follow it), ``eval`` (held-out evaluation at that step), ``save`` (a checkpoint snapshot taken at
that step) or ``commit`` (a background checkpoint write that finished by that step). JSONL keys are exactly
the TensorBoard / W&B tags; ``step`` and ``kind`` are the JSONL's own, and a few non-scalar values
(skip reasons, sample ids) are JSONL only.

Nothing here looks at a clock to decide what to average: a smoothed value is the mean of the last
``smoothing_window`` logged steps, divided by the number of steps it actually covers. On resume from a
checkpoint at step S, records past S are dropped from ``metrics.jsonl`` and TensorBoard is told to purge
events from step S+1 on, so the logs hold every step exactly once.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from dflash_cache.errors import ConfigError
from train.config import MetricsConfig

from .rundir import RunDirError, write_error

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"
KINDS = ("train", "eval", "save", "commit")
_TB_FILES = itertools.count()
SMOOTHED = ("train/loss", "train/acceptance_length")  # tags that also get a "<tag>_smooth" companion


def read_metrics(run_dir: str | Path, kind: str | None = "train") -> list[dict[str, Any]]:
    """Records of ``RUN/metrics.jsonl`` of one ``kind`` (None: all) in file order; a torn last line
    (crash) is ignored."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break  # only the last line can be torn by a crash; nothing after it is trusted
        if kind is None or rec.get("kind", "train") == kind:
            records.append(rec)
    return records


def truncate_metrics(run_dir: str | Path, last_step: int) -> list[dict[str, Any]]:
    """Keep only records with ``step <= last_step`` (rewritten atomically); return them."""
    path = Path(run_dir) / METRICS_FILE
    kept = [r for r in read_metrics(run_dir, kind=None) if int(r["step"]) <= last_step]
    if path.is_file():
        tmp = path.with_suffix(".jsonl.tmp")
        try:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, path)
        except OSError as err:
            raise write_error(path, err) from None
    return kept


def archive_metrics(run_dir: str | Path) -> Path | None:
    """Move ``metrics.jsonl`` aside (``metrics.before-<unix time>.jsonl``) when it holds records; returns the
    new path. For a run that restarts from step 0 in a directory whose earlier attempt saved no checkpoint."""
    path = Path(run_dir) / METRICS_FILE
    if not read_metrics(run_dir, kind=None):
        return None
    target = path.with_name(f"metrics.before-{int(time.time())}.jsonl")
    os.replace(path, target)
    return target


def _is_scalar(v: Any) -> bool:
    return isinstance(v, int | float)  # bools are ints: logged as 0/1


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # "nan" / "inf": JSON has no such numbers
    return v


class ScalarSink(Protocol):
    """A destination of the scalars of each record (TensorBoard, W&B)."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """All scalars of a record in one event: one Summary with many values, written synchronously on the calling
    thread as TensorBoard records (tensorboard's ``RecordWriter``) into this process's own event file.

    Not torch's ``FileWriter``: its writes happen on a daemon thread, so a full disk printed that thread's
    traceback before the run's one-line error. Here a failed write is an ``OSError`` on the training thread,
    reported like any other write into the run dir. bench/bench_metrics.py, 41 scalars per step: the whole
    ``MetricLogger.log`` (JSONL + this sink) 0.62 ms per step, as with ``FileWriter`` before (the same protobuf
    and checksum work, which its thread did under the same GIL); ``add_scalar`` for each: 4.6 ms (2 vCPU, load
    average 9)."""

    def __init__(self, log_dir: Path, purge_step: int | None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.record_writer import RecordWriter

        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        # TensorBoard reads every file whose name holds "tfevents", in name order; its own naming scheme, with
        # a per-process counter as the last field (two loggers of one process in one second stay in order)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_TB_FILES)}"
        self._file = open(log_dir / name, "wb")  # noqa: SIM115 - closed in close()
        self._writer = RecordWriter(self._file)
        self._write(Event(file_version="brain.Event:2"))
        if purge_step is not None:
            # TensorBoard drops the events >= purge_step that an interrupted run wrote before this one
            self._write(Event(step=purge_step, file_version="brain.Event:2"))
            self._write(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def _write(self, event: Any) -> None:
        event.wall_time = time.time()
        self._writer.write(event.SerializeToString())

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._write(Event(step=step, summary=Summary(
            value=[Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()])))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class WandbSink:
    """Weights & Biases: the same scalars keyed by the same step, the resolved config, and one W&B run per
    run dir (its id is kept in ``RUN/wandb_run_id``, so a resume continues it)."""

    def __init__(self, run_dir: Path, cfg: MetricsConfig, run_config: Mapping[str, Any] | None) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError("metrics.wandb = true needs the wandb package: pip install wandb (or, in the checkout, "
                              "pip install -e '.[wandb]'); or set metrics.wandb = false") from None
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(6)  # W&B ids: [a-z0-9]
        if not id_file.is_file():
            try:
                id_file.write_text(run_id + "\n")  # before init: a crash during init still resumes this id
            except OSError as err:
                raise write_error(id_file, err) from None
        self.run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity,
                              name=cfg.wandb_run_name or run_dir.resolve().name, id=run_id, resume="allow",
                              dir=str(run_dir), config=dict(run_config or {}))
        # W&B cannot delete logged points: steps the interrupted attempt already logged past the checkpoint keep
        # those values there (metrics.jsonl and TensorBoard hold the recomputed ones)
        self._first_step = int(getattr(self.run, "step", 0) or 0)
        if self._first_step:
            log.info("W&B run %s continues at step %d", run_id, self._first_step)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        if step >= self._first_step:
            self.run.log(dict(scalars), step=step)

    def flush(self) -> None:
        pass  # the W&B service process writes on its own

    def close(self) -> None:
        self.run.finish()


class MetricLogger:
    """Writes records to the JSONL and fans their scalars out to the sinks. Only rank 0 writes
    (``enabled=False`` elsewhere). ``run_config``: the resolved config, for W&B."""

    def __init__(self, run_dir: str | Path, cfg: MetricsConfig, *, resume_step: int = 0, enabled: bool = True,
                 run_config: Mapping[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.enabled = enabled
        self.last_step = resume_step
        self._windows: dict[str, deque[float]] = {k: deque(maxlen=cfg.smoothing_window) for k in SMOOTHED}
        self._sinks: list[ScalarSink] = []
        self._file = None
        self._path = self.run_dir / METRICS_FILE
        if not enabled:
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise write_error(self.run_dir, err, "create") from None
        for rec in truncate_metrics(self.run_dir, resume_step):
            if rec.get("kind", "train") == "train":
                self._push_windows(rec)
        try:
            self._file = open(self._path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        except OSError as err:
            raise write_error(self._path, err) from None
        try:
            if cfg.tensorboard:
                self._sinks.append(TensorBoardSink(self.run_dir / TB_DIR, purge_step=resume_step + 1))
            if cfg.wandb:
                self._sinks.append(WandbSink(self.run_dir, cfg, run_config))
        except OSError as err:
            self.close()
            raise write_error(self.run_dir, err, "write metrics into") from None
        except BaseException:
            self.close()
            raise

    def _push_windows(self, rec: Mapping[str, Any]) -> None:
        for k, win in self._windows.items():
            v = rec.get(k)
            if isinstance(v, int | float) and math.isfinite(v) and not rec.get("train/skipped"):
                win.append(float(v))

    def log(self, step: int, values: Mapping[str, Any], kind: str = "train") -> dict[str, Any]:
        """Log one record: training records strictly increase in step; the others belong to the last step."""
        if kind not in KINDS:
            raise ValueError(f"unknown metrics record kind {kind!r}; one of {KINDS}")
        if kind == "train":
            if step <= self.last_step and self.enabled:
                raise ValueError(f"metrics step {step} logged after step {self.last_step}: steps must increase")
            self.last_step = step
        elif step > self.last_step:
            raise ValueError(f"a {kind} record at step {step} before the training record of that step")
        rec: dict[str, Any] = {"step": step, "kind": kind, **values}
        if kind == "train":
            self._push_windows(rec)
            for k, win in self._windows.items():
                if win:
                    rec[f"{k}_smooth"] = sum(win) / len(win)  # divides by the steps actually covered
        if not self.enabled:
            return rec
        assert self._file is not None
        try:
            self._file.write(json.dumps({k: _jsonable(v) for k, v in rec.items()}) + "\n")  # line-buffered
        except OSError as err:
            raise write_error(self._path, err) from None
        scalars = {k: float(v) for k, v in rec.items() if k not in ("step", "kind") and _is_scalar(v)}
        for sink in self._sinks:
            self._call(sink.log, step, scalars)
        return rec

    def _call(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except OSError as err:
            raise write_error(self.run_dir, err, "write metrics into") from None

    def flush(self) -> None:
        """Make everything logged so far durable (before a checkpoint commits past it)."""
        if self._file is not None:
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError as err:
                raise write_error(self._path, err) from None
        for sink in self._sinks:
            self._call(sink.flush)

    def close(self) -> None:
        """Flush and close; after a write error (already raised), closes what it can and logs the rest."""
        try:
            self.flush()
        except RunDirError as err:
            log.warning("%s", err)
        sinks, self._sinks = self._sinks, []
        f, self._file = self._file, None
        for close in [*(s.close for s in sinks), *([f.close] if f is not None else [])]:
            try:
                close()
            except OSError as err:
                log.warning("closing the metrics of %s: %s", self.run_dir, err)


class StepTimer:
    """Wall and training-thread CPU seconds of each step since the previous lap, minus the time spent in
    :meth:`excluded` blocks (evaluation and checkpoint saves, which are logged as their own scalars)."""

    def __init__(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()
        self._skip_wall = self._skip_cpu = 0.0

    @contextmanager
    def excluded(self) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self._skip_wall += time.perf_counter() - wall
            self._skip_cpu += time.thread_time() - cpu

    def lap(self) -> tuple[float, float]:
        """``(wall_s, cpu_s)`` since the previous lap, excluded blocks left out."""
        wall, cpu = time.perf_counter(), time.thread_time()
        out = (wall - self._wall - self._skip_wall, cpu - self._cpu - self._skip_cpu)
        self._wall, self._cpu, self._skip_wall, self._skip_cpu = wall, cpu, 0.0, 0.0
        return out
