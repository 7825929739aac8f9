"""``dflash-train report RUN [--png FILE]``: what happened in a run, read from ``RUN/metrics.jsonl``.

Lists loss spikes (robust z-score against a trailing window of earlier accepted steps) with their
step, bucket and grad norm; steps the guards skipped and why; gaps and duplicates in the step
sequence; checkpoint saves with their blocking and background write times; held-out evaluations;
where the wall time went (training steps, evaluation, checkpoint blocking); whether spikes coincide
with saves, epoch boundaries or particular buckets; and loader starvation (data wait, queue depth
trend). With ``--png`` one figure: loss, acceptance length (training and held-out), and the pre-clip
gradient norm with the guard's limit over steps, with spikes, skips, re-baselines and checkpoint saves
marked.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_cache.errors import DFlashError

from ..cli_args import report_parser as build_parser
from ..components.guards import robust_z
from ..components.metrics import METRICS_FILE, read_metrics


@dataclass
class Spike:
    step: int
    loss: float
    z: float
    bucket: int | None
    grad_norm: float | None
    skipped: bool
    near_checkpoint: bool
    epoch_boundary: bool


@dataclass
class Skip:
    step: int
    reason: str
    bucket: int | None
    grad_norm: Any
    sample_ids: list[int]


@dataclass
class RunReport:
    n_records: int
    first_step: int
    last_step: int
    missing_steps: list[int]
    duplicate_steps: list[int]
    spikes: list[Spike]
    skips: list[Skip]
    saves: list[tuple[int, float]]  # (step, blocking ms)
    commits: list[tuple[int, float]]  # (checkpoint step, background write s)
    epoch_boundaries: list[int]
    bucket_steps: dict[int, int]
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out acceptance length)
    seconds: dict[str, float] = field(default_factory=dict)  # training steps / eval / checkpoint blocking
    data_wait_ms: dict[str, float] = field(default_factory=dict)
    queue_depth: dict[str, float] = field(default_factory=dict)


def _num(v: Any) -> float:
    """JSONL numbers; non-finite values are stored as the strings "nan" / "inf"."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _step_sequence(steps: list[int]) -> tuple[list[int], list[int]]:
    counts = Counter(steps)
    dup = sorted(s for s, c in counts.items() if c > 1)
    missing = sorted(set(range(min(steps), max(steps) + 1)) - set(steps)) if steps else []
    return missing, dup


def find_spikes(records: list[dict[str, Any]], window: int, z_threshold: float, min_history: int,
                save_steps: set[int], boundaries: set[int]) -> list[Spike]:
    """Finite losses more than ``z_threshold`` robust sigmas above the trailing window of accepted steps."""
    history: list[float] = []
    spikes = []
    for r in records:
        loss = _num(r.get("train/loss"))
        if not math.isfinite(loss):
            continue
        if len(history) >= min_history:
            z, _ = robust_z(loss, history[-window:])
            if z > z_threshold:
                s = int(r["step"])
                spikes.append(Spike(
                    step=s, loss=loss, z=z, bucket=r.get("train/bucket"), grad_norm=_num(r.get("train/grad_norm")),
                    skipped=bool(r.get("train/skipped")), near_checkpoint=bool({s - 1, s, s + 1} & save_steps),
                    epoch_boundary=s in boundaries,
                ))
        if not r.get("train/skipped"):
            history.append(loss)
    return spikes


def _summary(values: list[float]) -> dict[str, float]:
    xs = sorted(v for v in values if math.isfinite(v))
    if not xs:
        return {}
    third = max(1, len(values) // 3)
    return {
        "mean": sum(xs) / len(xs),
        "p95": xs[min(len(xs) - 1, int(0.95 * len(xs)))],
        "max": xs[-1],
        "first_third_mean": sum(values[:third]) / third,
        "last_third_mean": sum(values[-third:]) / third,
    }


def _of_kind(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind", "train") == kind]


def analyze(all_records: list[dict[str, Any]], window: int = 64, z_threshold: float = 6.0,
            min_history: int = 8) -> RunReport:
    """Everything the report prints, computed from the records of ``metrics.jsonl`` (every kind)."""
    records = _of_kind(all_records, "train")
    steps = [int(r["step"]) for r in records]
    missing, dup = _step_sequence(steps)
    saves = [(int(r["step"]), _num(r.get("ckpt/blocking_ms"))) for r in _of_kind(all_records, "save")]
    commits = [(int(r["ckpt/committed_step"]), _num(r.get("ckpt/write_s"))) for r in _of_kind(all_records, "commit")]
    evals = [(int(r["step"]), _num(r.get("eval/acceptance_length"))) for r in _of_kind(all_records, "eval")]
    boundaries = [int(b["step"]) for a, b in zip(records, records[1:], strict=False)
                  if a.get("train/epoch") != b.get("train/epoch")]
    spikes = find_spikes(records, window, z_threshold, min_history, {s for s, _ in saves}, set(boundaries))
    skips = [Skip(int(r["step"]), str(r.get("train/skip_reason")), r.get("train/bucket"), r.get("train/grad_norm"),
                  list(r.get("train/skipped_sample_ids", []))) for r in records if r.get("train/skipped")]
    seconds = {"training steps": sum(_finite(_num(r.get("train/step_time_s"))) for r in records),
               "held-out eval": sum(_finite(_num(r.get("eval/seconds"))) for r in _of_kind(all_records, "eval")),
               "checkpoint blocking": sum(_finite(ms) for _, ms in saves) / 1e3}
    return RunReport(
        n_records=len(records), first_step=min(steps, default=0), last_step=max(steps, default=0),
        missing_steps=missing, duplicate_steps=dup, spikes=spikes, skips=skips, saves=saves, commits=commits,
        epoch_boundaries=boundaries, bucket_steps=dict(Counter(r.get("train/bucket") for r in records)),
        evals=evals, seconds=seconds,
        data_wait_ms=_summary([_num(r.get("perf/data_wait_ms")) for r in records]),
        queue_depth=_summary([_num(r.get("perf/queue_depth")) for r in records if "perf/queue_depth" in r]),
    )


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def _fmt_steps(steps: list[int], limit: int = 20) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")


def format_report(rep: RunReport, run_dir: str | Path) -> str:
    out = [f"run {run_dir}: {rep.n_records} logged steps, {rep.first_step}..{rep.last_step}"]
    if rep.missing_steps or rep.duplicate_steps:
        out.append(f"step sequence: MISSING {_fmt_steps(rep.missing_steps) or '-'}; "
                   f"DUPLICATED {_fmt_steps(rep.duplicate_steps) or '-'}")
    else:
        out.append("step sequence: no gaps, no duplicates")
    out.append(f"loss spikes: {len(rep.spikes)}")
    for s in rep.spikes:
        tags = [t for t, on in (("skipped by guards", s.skipped), ("next to a checkpoint save", s.near_checkpoint),
                                ("at an epoch boundary", s.epoch_boundary)) if on]
        out.append(f"  step {s.step}: loss {s.loss:.4g} (z {s.z:.1f}), bucket {s.bucket}, grad norm "
                   f"{s.grad_norm:.4g}" + (f" [{'; '.join(tags)}]" if tags else ""))
    if rep.spikes:
        out.append("  coincidences: " + _coincidences(rep))
    out.append(f"skipped steps: {len(rep.skips)}")
    for k in rep.skips:
        out.append(f"  step {k.step}: {k.reason}, bucket {k.bucket}, grad norm {k.grad_norm}, "
                   f"sample ids {_fmt_steps(k.sample_ids, 10)}")
    blocking = [ms for _, ms in rep.saves]
    out.append(f"checkpoint saves: {len(rep.saves)}" + (
        f", blocking ms mean {sum(blocking) / len(blocking):.1f} max {max(blocking):.1f}" if blocking else ""))
    written = dict(rep.commits)
    for step, ms in rep.saves:
        write = written.get(step)
        out.append(f"  step {step}: blocked {ms:.1f} ms" + (
            f", written in {write:.2f} s" if write is not None else ", commit not logged (run ended or killed)"))
    if rep.evals:
        best = max(rep.evals, key=lambda e: e[1])
        out.append(f"held-out eval: {len(rep.evals)} at steps {_fmt_steps([s for s, _ in rep.evals])}; acceptance "
                   f"length {rep.evals[0][1]:.3f} -> {rep.evals[-1][1]:.3f} (best {best[1]:.3f} at step {best[0]})")
    out.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in rep.seconds.items()))
    out.append(f"epoch boundaries at steps: {_fmt_steps(rep.epoch_boundaries) or '-'}")
    out.append(_loader_line(rep))
    return "\n".join(out)


def _coincidences(rep: RunReport) -> str:
    n = len(rep.spikes)
    near_ckpt = sum(s.near_checkpoint for s in rep.spikes)
    at_boundary = sum(s.epoch_boundary for s in rep.spikes)
    total = sum(rep.bucket_steps.values()) or 1
    by_bucket = Counter(s.bucket for s in rep.spikes)
    parts = [f"{near_ckpt}/{n} within one step of a checkpoint save", f"{at_boundary}/{n} at an epoch boundary"]
    for b, c in sorted(by_bucket.items(), key=lambda kv: -kv[1]):
        share = rep.bucket_steps.get(b, 0) / total
        parts.append(f"bucket {b}: {c}/{n} spikes vs {share:.0%} of steps")
    return "; ".join(parts)


def _loader_line(rep: RunReport) -> str:
    w, q = rep.data_wait_ms, rep.queue_depth
    if not w:
        return "loader: no data-wait figures logged"
    line = (f"loader: data wait ms mean {w['mean']:.2f}, p95 {w['p95']:.2f}, max {w['max']:.2f} "
            f"(first third {w['first_third_mean']:.2f} -> last third {w['last_third_mean']:.2f})")
    if q:
        trend = q["last_third_mean"] - q["first_third_mean"]
        line += (f"; queue depth mean {q['mean']:.1f} (first third {q['first_third_mean']:.1f} -> last third "
                 f"{q['last_third_mean']:.1f}{', drained: the loader is falling behind' if trend < 0 and q['last_third_mean'] < 1 else ''})")
    return line


def loss_ticks(lo: float, hi: float, most: int = 8) -> list[float]:
    """Round tick values for a log-scale axis over ``[lo, hi]``: the densest series of round numbers per
    decade that puts at most ``most`` ticks in range; every k-th power of ten over many decades; evenly
    spaced round numbers over a narrow range."""
    from matplotlib.ticker import MaxNLocator

    d0, d1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))

    def series(subs: tuple[float, ...]) -> list[float]:
        return [m * 10.0**d for d in range(d0, d1 + 1) for m in subs if lo <= m * 10.0**d <= hi]

    for subs in ((1, 1.5, 2, 3, 4, 5, 6, 8), (1, 2, 3, 5, 7), (1, 2, 5), (1,)):
        ticks = series(subs)
        if len(ticks) <= most:
            break
    else:
        k = math.ceil((d1 - d0 + 1) / most)
        return [10.0**d for d in range(d0, d1 + 1, k) if lo <= 10.0**d <= hi]
    if len(ticks) < 3:
        return [float(v) for v in MaxNLocator(5).tick_values(lo, hi) if lo <= v <= hi]
    return ticks


def plot_report(records: list[dict[str, Any]], rep: RunReport, path: str | Path, title: str = "") -> None:
    """One PNG: loss (log scale) and acceptance length (training and held-out) over steps; spikes, skips and
    saves marked. ``records``: every record of ``metrics.jsonl``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = report_figure(records, rep, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_figure(all_records: list[dict[str, Any]], rep: RunReport, title: str = "") -> Any:
    """The figure of :func:`plot_report` (a matplotlib Figure); legend entries only for what occurred."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    records = _of_kind(all_records, "train")
    steps = [int(r["step"]) for r in records]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, sharex=True, figsize=(11, 9))
    if title:
        fig.suptitle(title)
    ax1.plot(steps, [_num(r.get("train/loss")) for r in records], lw=0.8, label="loss")
    if any("train/loss_smooth" in r for r in records):
        ax1.plot(steps, [_num(r.get("train/loss_smooth")) for r in records], lw=1.2, label="loss (smoothed)")
    ax1.set_yscale("log")
    losses = [v for r in records for v in (_num(r.get("train/loss")),) if math.isfinite(v) and v > 0]
    if losses:  # plain round numbers (2, 3, 5 ...) instead of matplotlib's sparse 10^x labels
        ax1.yaxis.set_major_locator(FixedLocator(loss_ticks(min(losses), max(losses))))
        ax1.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax1.yaxis.set_minor_locator(NullLocator())
    if rep.spikes:
        ax1.scatter([s.step for s in rep.spikes], [s.loss for s in rep.spikes], color="red", marker="x", zorder=3,
                    label="loss spike")
    ax2.plot(steps, [_num(r.get("train/acceptance_length")) for r in records], lw=0.8, color="tab:green",
             label="acceptance length (training batches)")
    if rep.evals:
        ax2.plot([s for s, _ in rep.evals], [v for _, v in rep.evals], color="tab:purple", marker="o", ms=4, lw=1.2,
                 label="acceptance length (held-out eval)")
    _plot_grad_norm(ax3, records)
    for ax in (ax1, ax2, ax3):
        for i, k in enumerate(rep.skips):
            ax.axvline(k.step, color="orange", lw=1.0, alpha=0.8, label="skipped step" if i == 0 else None)
        for i, (s, _) in enumerate(rep.saves):
            ax.axvline(s, color="gray", ls=":", lw=0.8, label="checkpoint save" if i == 0 else None)
        ax.legend(loc="upper right", fontsize=8)
    ax1.set_ylabel("loss")
    ax2.set_ylabel("acceptance length")
    ax3.set_xlabel("optimizer step")
    fig.tight_layout()
    return fig


def _plot_grad_norm(ax: Any, records: list[dict[str, Any]]) -> None:
    """Pre-clip grad norm with the guard's limit (a step above it is a spike) and its re-baselines."""
    steps = [int(r["step"]) for r in records]
    ax.plot(steps, [_num(r.get("train/grad_norm")) for r in records], lw=0.8, color="tab:blue",
            label="pre-clip grad norm")
    limit = [(int(r["step"]), _num(r["train/grad_norm_limit"])) for r in records if "train/grad_norm_limit" in r]
    if limit:
        ax.plot([s for s, _ in limit], [v for _, v in limit], lw=1.0, ls="--", color="tab:red",
                label="guard limit (above: spike)")
    prev = 0
    first = True
    for r in records:  # the steps where the guard accepted a level shift and restarted its window
        n = int(_num(r.get("train/guard_rebaselines", prev)) or 0)
        if n > prev:
            ax.axvline(int(r["step"]), color="tab:red", lw=1.2, label="guard re-baselined" if first else None)
            first = False
        prev = n
    if any(math.isfinite(_num(r.get("train/grad_norm"))) and _num(r.get("train/grad_norm")) > 0 for r in records):
        ax.set_yscale("log")
    ax.set_ylabel("grad norm")


def cli_main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    records = read_metrics(args.run_dir, kind=None)
    if not records:
        raise DFlashError(f"{Path(args.run_dir) / METRICS_FILE} is missing or empty; is {args.run_dir} a "
                          "run directory written by dflash-train (--run-dir)?")
    rep = analyze(records, window=args.window, z_threshold=args.z)
    print(format_report(rep, args.run_dir))
    if args.png:
        plot_report(records, rep, args.png, title=f"dflash-train run {Path(args.run_dir)}")
        print(f"figure: {args.png}")
    return 0
