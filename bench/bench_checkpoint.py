"""Checkpoint cost seen by the training thread: async ``Checkpointer.save`` vs a synchronous save.

Same state in one run: a stack of fp32 linear layers (default ~1.2 GB of weights + AdamW moments),
one optimizer step so the moments exist. The synchronous save serializes and fsyncs the live
tensors on the calling thread (what a naive trainer does); the async save returns after the host
snapshot and writes in the background. Goal: blocking / synchronous <= 0.05.

    .venv/bin/python bench/bench_checkpoint.py [--params-m 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from train.components.checkpoint import Checkpointer, Snapshot, _Snapshotter, write_checkpoint
from train.config import CheckpointConfig

RESULTS = Path(__file__).resolve().parent / "results"


def build_state(params_m: int, device: str = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 4096
    n_layers = max(1, params_m * 1_000_000 // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(n_layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


class _LiveTensors(_Snapshotter):
    """Encodes the state without copying: the synchronous baseline serializes the live tensors."""

    def tensor(self, t: torch.Tensor, key: str) -> torch.Tensor:
        self.tensors[key] = t.detach().cpu()  # a GPU tensor must come to the host to be written
        return self.tensors[key]


def sync_save(root: Path, step: int, model, opt) -> float:
    """Serialize + fsync the live tensors on this thread (no host copy first)."""
    t0 = time.perf_counter()
    enc = _LiveTensors()
    state_json = enc.encode({"optimizer": opt.state_dict()}, "state")
    snap = Snapshot(step, {k: v.detach() for k, v in model.state_dict().items()}, state_json, enc.tensors, {}, None)
    write_checkpoint(root, snap)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params-m", type=int, default=100, help="millions of fp32 parameters")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    model, opt = build_state(args.params_m, args.device)
    n_params = sum(p.numel() for p in model.parameters())
    state_gb = n_params * 4 * 3 / 1e9  # weights + two AdamW moments
    tmp = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    try:
        sync_s, block_s, write_s = [], [], []
        ck = Checkpointer(tmp / "async", CheckpointConfig(keep_last=2))  # one per run, as in training
        for r in range(args.repeats):
            sync_s.append(sync_save(tmp / "sync" / "checkpoints", r + 1, model, opt))
            t0 = time.perf_counter()
            stats = ck.save(r + 1, model.state_dict(), {"optimizer": opt.state_dict()})
            block_s.append(time.perf_counter() - t0)
            assert abs(stats.blocking_ms / 1e3 - block_s[-1]) < 0.05
            ck.wait()
            write_s.extend(w for _, w in ck.pop_completed())
            shutil.rmtree(tmp / "sync", ignore_errors=True)
        # the first async save allocates its host buffers; later ones reuse them (steady state)
        sync_med, block_med = sorted(sync_s)[len(sync_s) // 2], sorted(block_s)[len(block_s) // 2]
        res = {
            "params_m": n_params / 1e6, "state_gb": state_gb, "device": args.device,
            "sync_save_s": sync_med, "async_blocking_s": block_med, "async_first_blocking_s": block_s[0],
            "async_background_write_s": sorted(write_s)[len(write_s) // 2],
            "blocking_over_sync": block_med / sync_med, "goal": 0.05,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for k, v in res.items():
        print(f"{k:>26}: {v:.4g}" if isinstance(v, float) else f"{k:>26}: {v}")
    RESULTS.mkdir(exist_ok=True)
    suffix = "" if args.device == "cpu" else f"_{args.device.split(':')[0]}"
    (RESULTS / f"bench_checkpoint{suffix}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
