"""bench/gpu_check.py runs on the CPU at tiny shapes (--dry) through the same code as on a GPU, so that
whoever gets a GPU for a few minutes finds a script that works."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_reports_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    sections = res["sections"]
    assert set(sections) == {"flex_vs_sdpa", "train_8b", "train_27b", "train_27b_plain", "loader_27b",
                             "train_27b_dflash2", "h2d", "extract_8b"}
    assert all(s["status"] == "ok" for s in sections.values()), sections
    assert sections["flex_vs_sdpa"]["layers"] == ["sliding_attention"] * 4 + ["full_attention"]
    for name in ("train_8b", "train_27b", "train_27b_plain", "train_27b_dflash2"):
        t = sections[name]
        assert t["tokens_per_s"] > 0 and t["estimate_peak_bytes"] > 0
        assert t["activation_checkpointing"] == (name != "train_27b_plain")
        # every phase measured and estimated; the dry run is bf16 under CUDA autocast's norm rule (emulated)
        assert set(t["phases_above_static"]) == {"forward", "loss_head", "backward", "optimizer"}
        assert all(p["measured_bytes"] > 0 and p["estimate_bytes"] > 0 for p in t["phases_above_static"].values())
        dtypes = t["dtypes"]
        for place in ("attention_q", "attention_k", "attention_v", "residual", "loss_head_hidden", "loss_head_weight"):
            assert dtypes[place] == ["bfloat16"], (name, dtypes)
        assert dtypes["loss_head_weight_copied"] == ["False"]
    assert sections["loader_27b"]["steps"] >= 2 and 0 <= sections["loader_27b"]["data_wait_share"] <= 1
    assert sections["extract_8b"]["samples"] > 0 and sections["extract_8b"]["extract_over_bare"] > 0
    assert res["env"]["dry"] is True


def test_gpu_check_refuses_to_run_without_a_gpu_unless_dry():
    import torch

    if torch.cuda.is_available():
        return
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--dry" in proc.stderr
