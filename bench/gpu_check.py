"""One prepared GPU check: whoever gets a GPU for a few minutes runs ``make gpu-check`` once.

Sections (each timed, each reported even when another fails; the whole run keeps to ``--budget-s``):

1. ``pytest_gpu``      the test suite's GPU tests (``pytest -m gpu``)
2. ``flex_vs_sdpa``    FlexAttention vs SDPA at the Qwen3.6-27B drafter's shape (4 sliding + 1 full layers):
                       max abs difference of logits and of every gradient, bf16 autocast
3. ``train_8b``        bf16-autocast training steps of the Qwen3-8B / Qwen3.6-27B-shaped drafters (and the
   ``train_27b``       DFlash2 27B preset's, ``train_27b_dflash2``, selector loss included) at the presets' worst step (8 documents x 2048 tokens, 512 anchors each: 65536 block
                       positions): tokens/s, MFU, the peak of each phase (forward, loss head, backward,
                       optimizer) against ``dflash-train estimate``'s, and the dtypes reaching FlexAttention
                       (q/k/v), the residual stream and the loss head (all bf16 expected)
   ``train_27b_plain`` the same without activation checkpointing (the H200 option of the 27B preset); skipped
                       where the estimate says it cannot fit the GPU
4. ``loader_27b``      the streaming loader feeding the 27B-shaped drafter from a synthetic 27B-width cache on
                       local disk: share of step time spent waiting for data, queue depth
5. ``h2d``             pinned host -> device copy bandwidth
6. ``extract_8b``      extraction with a random-initialised Qwen3-8B-shaped teacher (36 layers, hidden 4096;
                       no download): extraction loop / bare forward on the same batches, teacher tokens/s

``--dry`` runs every section on the CPU at tiny shapes through the same code (the test suite does, so the
script never rots); figures from a dry run mean nothing. Results: ``bench/results/gpu.json`` (``--out``).

    make gpu-check                                  # = python bench/gpu_check.py
    python bench/gpu_check.py --dry --out /tmp/gpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_cache.runtime.config import load_config  # noqa: E402
from dflash_cache.runtime.dist import Distributed  # noqa: E402
from train.components.guards import SpikeGuard  # noqa: E402
from train.components.memory import PHASES, measure_train_step  # noqa: E402
from train.config import GuardsConfig  # noqa: E402
from train.data.batch import Batch  # noqa: E402
from train.loop.build import (  # noqa: E402
    LossModule,
    build_optimizer,
    build_position_weighting,
    build_scheduler,
    build_selector_loss,
)
from train.loop.step import train_step  # noqa: E402
from train.models.dtypes import DtypeProbe, cuda_autocast_rules_on_cpu  # noqa: E402
from train.models.factory import drafter_class  # noqa: E402
from train.models.model import DFlashConfig, DFlashDrafter  # noqa: E402
from train.models.objective import FlatBatch, dflash_loss, sample_anchors  # noqa: E402
from train.tools.estimate import (  # noqa: E402
    DrafterShape,
    Precision,
    StepShape,
    flops_per_step,
    memory_estimate,
    with_dflash2_terms,
)

RESULTS = ROOT / "bench" / "results" / "gpu.json"
# dense bf16 peak TFLOP/s by device name (for MFU); unknown devices report no MFU
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0, "L40S": 362.0,
               "RTX PRO 6000": 503.0}


class Check:
    """Runs the sections within a time budget and collects their results."""

    def __init__(self, dry: bool, budget_s: float):
        self.dry, self.deadline = dry, time.monotonic() + budget_s
        self.device = torch.device("cpu" if dry else "cuda")
        self.results: dict[str, Any] = {}
        self.shared: dict[str, Any] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, fn: Callable[[], dict[str, Any]], needs_s: float) -> None:
        if not self.dry and self.left() < needs_s:
            self.results[name] = {"status": "skipped", "reason": f"{self.left():.0f} s left, needs ~{needs_s:.0f} s"}
            return
        t0 = time.perf_counter()
        try:
            out = {"status": "ok", **fn()}
        except Exception as err:  # each section reports for itself
            out = {"status": "error", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        out["seconds"] = round(time.perf_counter() - t0, 1)
        self.results[name] = out
        print(f"[{name}] {json.dumps({k: v for k, v in out.items() if k != 'traceback'})}", flush=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------------------


def preset_drafter(preset: str, dry: bool) -> tuple[DFlashConfig, Any]:
    """The preset's drafter config at its real shapes (tiny dimensions with --dry)."""
    cfg = load_config(ROOT / "configs" / f"{preset}.toml")
    t, m = cfg.teacher, cfg.model
    dims = dict(hidden_size=t.hidden_size, num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
                num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim, intermediate_size=m.intermediate_size,
                vocab_size=t.vocab_size, mask_token_id=m.mask_token_id, sliding_window=m.sliding_window)
    if dry:
        dims.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                    vocab_size=512, mask_token_id=511, sliding_window=min(m.sliding_window or 64, 64))
    dcfg = DFlashConfig(**dims, block_size=m.block_size, target_layer_ids=list(cfg.cache.target_layer_ids),
                        num_target_layers=t.num_layers, layer_types=m.layer_types, arch=m.arch,
                        conv_kernel_size=m.conv_kernel_size, conv_group_size=m.conv_group_size,
                        selector_top_k=m.selector_top_k, selector_rank=m.selector_rank)
    return dcfg, cfg


def make_drafter(dcfg: DFlashConfig, device: torch.device, attention: str, checkpointing: bool, seed: int = 0
                 ) -> DFlashDrafter:
    torch.manual_seed(seed)
    with torch.device(device):
        embed = torch.randn(dcfg.vocab_size, dcfg.hidden_size, dtype=torch.bfloat16)
        head = torch.randn(dcfg.vocab_size, dcfg.hidden_size, dtype=torch.bfloat16) * 0.02
        model = drafter_class(dcfg)(dcfg, embed, head, attention=attention, activation_checkpointing=checkpointing)
    for p in model.parameters():  # fp32 master weights, bf16 frozen head, as train.loop.build.build_model does
        p.data = p.data.float()
    return model.train()


def synthetic_batch(rows: int, length: int, docs: int, width: int, vocab: int, device: torch.device,
                    seed: int = 0) -> Batch:
    """Rows of ``docs`` equal documents; the first eighth of each document is prompt (off the loss mask)."""
    g = torch.Generator().manual_seed(seed)
    doc_len = length // docs
    doc_ids = (torch.arange(length) // doc_len).clamp(max=docs - 1).to(torch.int32)
    pos = torch.arange(length) - doc_ids.long() * doc_len
    batch = Batch(features=(torch.randn(rows, length, width, generator=g) * 0.5).to(torch.bfloat16),
                  input_ids=torch.randint(0, vocab - 1, (rows, length), generator=g),
                  loss_mask=(pos >= doc_len // 8).expand(rows, length).clone(),
                  doc_ids=doc_ids.expand(rows, length).clone(), position_ids=pos.expand(rows, length).clone(),
                  sample_ids=torch.arange(rows * docs), bucket=0, epoch=0, index=0, n_tokens=rows * length,
                  n_padded=0, seed=seed)
    return batch.to(device)


def device_peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


# ----------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------


def pytest_gpu(check: Check) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", str(ROOT / "tests")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(60, int(check.left() - 60)))
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return {"exit_code": proc.returncode, "summary": tail, "ok": proc.returncode in (0, 5)}  # 5: none collected


def flex_vs_sdpa(check: Check) -> dict[str, Any]:
    dcfg, _ = preset_drafter("qwen3.6-27b", check.dry)
    attn = "sdpa" if check.dry else "flex"  # FlexAttention runs eager (and without backward) on the CPU
    a = make_drafter(dcfg, check.device, "sdpa", False, seed=1)
    b = make_drafter(dcfg, check.device, attn, False, seed=1)
    rows, length = (1, 128) if check.dry else (2, 1024)
    batch = synthetic_batch(rows, length, 2, len(dcfg.target_layer_ids) * dcfg.hidden_size, dcfg.vocab_size,
                            check.device, seed=3)
    dtype = torch.bfloat16 if check.device.type == "cuda" else torch.float32
    out = {}
    for name, model in (("sdpa", a), ("flex", b)):
        with torch.autocast(check.device.type, dtype=torch.bfloat16, enabled=check.device.type == "cuda"):
            res = dflash_loss(model, batch, num_anchors=64, chunk_rows=1024)
        res.loss.backward()
        flat = FlatBatch.of(batch)
        anchors = sample_anchors(flat.eligible, flat.docs, 64, torch.Generator().manual_seed(3))[:16]
        from train.models.objective import forward_blocks

        with torch.no_grad(), torch.autocast(check.device.type, dtype=torch.bfloat16,
                                             enabled=check.device.type == "cuda"):
            hidden, _ = forward_blocks(model, batch, flat, anchors)
            logits = model.logits(hidden).float()
        out[name] = (res.loss.detach().float(), logits, {k: p.grad.float() for k, p in model.named_parameters()})
    (la, za, ga), (lb, zb, gb) = out["sdpa"], out["flex"]
    grad_diff = {k: float((ga[k] - gb[k]).abs().max()) for k in ga}
    worst = max(grad_diff, key=grad_diff.get)
    return {"layers": dcfg.layer_types, "compute_dtype": str(dtype), "loss_abs_diff": float((la - lb).abs()),
            "logits_max_abs_diff": float((za - zb).abs().max()), "logits_max_abs": float(za.abs().max()),
            "grad_max_abs_diff": grad_diff[worst], "grad_worst_param": worst,
            "grad_max_abs": float(ga[worst].abs().max()), "attention_compared": f"sdpa vs {attn}"}


def train_steps(check: Check, preset: str, checkpointing: bool | None = None) -> dict[str, Any]:
    """bf16 training steps at the preset's worst step: speed, MFU, the peak of each phase (forward, loss head,
    backward, optimizer) against ``dflash-train estimate``'s, and the dtypes reaching the attention kernel and
    the loss head. ``--dry``: the same in bf16 on the CPU under CUDA autocast's fp32-norm rule (emulated)."""
    dcfg, cfg = preset_drafter(preset, check.dry)
    attn = "sdpa" if check.dry else "flex"
    ckpt = cfg.model.activation_checkpointing if checkpointing is None else checkpointing
    # the presets' worst step: 8 documents of 2048 tokens, 512 anchors each (65536 block positions)
    rows, length, anchors = (2, 128, 16) if check.dry else (8, 2048, cfg.train.num_anchors)
    shape = DrafterShape(dcfg.hidden_size, dcfg.vocab_size, len(dcfg.target_layer_ids), dcfg.num_hidden_layers,
                         dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim, dcfg.intermediate_size,
                         dcfg.block_size, False, sum(t == "sliding_attention" for t in dcfg.layer_types or []))
    precision = Precision.for_device("cuda", "bf16")  # what a GPU run computes in (--dry: emulated on the CPU)
    est_kw = dict(precision=precision, attention="flex" if attn == "flex" else "sdpa", checkpointing=ckpt,
                  chunk_rows=cfg.train.logits_chunk_rows, foreach_optimizer=check.device.type == "cuda")
    if checkpointing is not None:  # a variant: the preset's drafter kept for the loader section goes first
        check.shared.pop("model_27b", None)
        gc.collect()
    if check.device.type == "cuda":  # a step the estimate says cannot fit is not attempted
        torch.cuda.empty_cache()
        worst = memory_estimate(shape, StepShape.worst(rows * length, rows * anchors * dcfg.block_size,
                                                       dcfg.block_size, length / 2), **est_kw)
        free = torch.cuda.mem_get_info(check.device)[0] + torch.cuda.memory_reserved(check.device)
        if worst.device_peak > free:
            return {"skipped": f"estimate {worst.device_peak / 2**30:.1f} GiB > {free / 2**30:.1f} GiB free",
                    "activation_checkpointing": ckpt, "estimate_peak_bytes": worst.device_peak}
    model = make_drafter(dcfg, check.device, attn, ckpt)
    batch = synthetic_batch(rows, length, 1, len(dcfg.target_layer_ids) * dcfg.hidden_size, dcfg.vocab_size,
                            check.device)
    tcfg = cfg.train.model_copy(update={"num_anchors": anchors, "precision": "bf16"})
    opt = build_optimizer(tcfg, model)
    sched = build_scheduler(tcfg, opt, total_steps=100)
    guard = SpikeGuard(GuardsConfig(window=16, min_history=4, max_consecutive_skips=100))
    lm = LossModule(model, anchors, build_position_weighting(tcfg, dcfg.block_size), tcfg.logits_chunk_rows)
    lm.selector = build_selector_loss(tcfg, model)  # DFlash2: the selector loss too
    d = Distributed(device=check.device)
    warmup, steps = (1, 2) if check.dry else (2, 4)
    emulate = cuda_autocast_rules_on_cpu() if check.dry else nullcontext()
    with emulate:
        t_first = time.perf_counter()
        for s in range(warmup):
            train_step(s + 1, [batch], lm, opt, sched, guard, tcfg, d)
        sync(check.device)
        compile_s = time.perf_counter() - t_first
        times = []
        for s in range(steps):
            t0 = time.perf_counter()
            res = train_step(warmup + s + 1, [batch], lm, opt, sched, guard, tcfg, d)
            sync(check.device)
            times.append(time.perf_counter() - t0)
        # one more step, measured per phase (allocator peaks; the CPU profiler with --dry) and probed for dtypes
        base = torch.cuda.memory_allocated(check.device) if check.device.type == "cuda" else None
        with DtypeProbe(model) as probe:
            measured, res = measure_train_step(
                lambda: train_step(warmup + steps + 1, [batch], lm, opt, sched, guard, tcfg, d), lm, model, opt,
                check.device)
    step_s = sorted(times)[len(times) // 2]
    blocks = res.metrics["n_blocks"]
    step_shape = StepShape(rows * length, blocks, blocks * (dcfg.block_size - 1), length / 2, rows=rows)
    est = memory_estimate(shape, step_shape, **est_kw)
    if dcfg.arch == "dflash2":
        est = with_dflash2_terms(est, shape, step_shape, cfg.model, precision=precision, checkpointing=ckpt,
                                 optimizer=tcfg.optimizer, chunk_rows=tcfg.logits_chunk_rows)
    phases = {name: {"measured_bytes": measured[name], "estimate_bytes": est.phases[name],
                     "estimate_over_measured": round(est.phases[name] / measured[name], 3) if measured[name] else None}
              for name in PHASES}
    peak = base + max(measured.values()) if base is not None else None
    flops = flops_per_step(shape, step_shape)
    peak_tflops = device_peak_tflops(check.device)
    if preset == "qwen3.6-27b" and checkpointing is None:  # the loader section feeds this drafter (no second compile)
        check.shared["model_27b"] = (model, lm, opt, sched, guard, tcfg, dcfg)
    return {
        "params": shape.params, "activation_checkpointing": ckpt, "block_positions": blocks * dcfg.block_size,
        "context_tokens": rows * length, "first_steps_s": round(compile_s, 2), "step_s_median": round(step_s, 4),
        "step_s_all": [round(t, 4) for t in times], "tokens_per_s": round(rows * length / step_s, 1),
        "block_positions_per_s": round(blocks * dcfg.block_size / step_s, 1),
        "peak_memory_bytes": peak, "estimate_peak_bytes": est.device_peak,
        "estimate_over_measured": round(est.device_peak / peak, 3) if peak else None,
        "static_bytes": base, "estimate_static_bytes": est.static,
        "phases_above_static": phases, "dtypes": probe.as_dict(), "precision": "bf16",
        "flops_per_step": flops, "mfu": round(flops / step_s / (peak_tflops * 1e12), 4) if peak_tflops else None,
        "device": torch.cuda.get_device_name(check.device) if check.device.type == "cuda" else "cpu",
        "loss": res.loss,
    }


def loader_feed(check: Check) -> dict[str, Any]:
    """The streaming loader over a synthetic 27B-width cache on local disk, feeding the 27B-shaped drafter."""
    from dflash_cache.synthetic import make_synthetic_cache
    from train.loop.build import build_loader

    dcfg, cfg = preset_drafter("qwen3.6-27b", check.dry)
    shared = check.shared.get("model_27b")
    if shared is None:
        raise RuntimeError("train_27b did not run; the loader section reuses its drafter")
    model, lm, opt, sched, guard, tcfg, dcfg = shared
    n, med = (48, 96) if check.dry else (160, 800)
    with tempfile.TemporaryDirectory(dir=os.environ.get("DFLASH_GPU_CHECK_TMP")) as tmp:
        url = str(Path(tmp) / "cache")
        t0 = time.perf_counter()
        make_synthetic_cache(url, n, hidden_size=dcfg.hidden_size, num_layers=64 if not check.dry else 8,
                             target_layer_ids=tuple(dcfg.target_layer_ids) if not check.dry else (1, 3, 5, 6, 7),
                             vocab_size=dcfg.vocab_size, max_length=3072 if not check.dry else 512,
                             median_length=med, bucket_edges=(256, 512, 1024, 2048) if not check.dry else (64, 128, 256),
                             samples_per_part=32, chunk_tokens=256 if not check.dry else 64,
                             shard_tokens=16384 if not check.dry else 1024, seed=5)
        build_s = time.perf_counter() - t0
        from dflash_cache import open_cache

        cache = open_cache(url)
        lcfg = cfg.loader.model_copy(update={"holdout_fraction": 0.0})
        if check.dry:
            lcfg = lcfg.model_copy(update={"tokens_per_batch": 1024, "num_readers": 2, "max_buffer_bytes": 1 << 26})
        d = Distributed(device=check.device)
        loader = build_loader(lcfg, cache, d, seed=0, epochs=1, num_anchors=tcfg.num_anchors,
                              block_size=dcfg.block_size)
        waits, steps, depths = [], [], []
        it = iter(loader)
        t_end = time.monotonic() + (20 if check.dry else min(45, check.left() - 30))
        step = 100
        while time.monotonic() < t_end and not (check.dry and len(steps) >= 4):
            t0 = time.perf_counter()
            batch = next(it, None)
            if batch is None:
                break
            t1 = time.perf_counter()
            step += 1
            train_step(step, [batch], lm, opt, sched, guard, tcfg, d)
            sync(check.device)
            waits.append(t1 - t0)
            steps.append(time.perf_counter() - t0)
            if loader.last_stats is not None:
                depths.append(loader.last_stats.queue_items)
        loader.close()
    warm = slice(1, None) if len(steps) > 2 else slice(None)
    total, wait = sum(steps[warm]), sum(waits[warm])
    return {"cache_samples": n, "cache_build_s": round(build_s, 1), "steps": len(steps),
            "data_wait_share": round(wait / total, 4) if total else None,
            "queue_depth_median": sorted(depths)[len(depths) // 2] if depths else None,
            "num_readers": lcfg.num_readers, "tokens_per_batch": lcfg.tokens_per_batch}


def h2d(check: Check) -> dict[str, Any]:
    n = (64 << 20) if check.dry else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, pin_memory=check.device.type == "cuda")
    src.fill_(1)
    dst = torch.empty(n, dtype=torch.uint8, device=check.device)
    rates = []
    for _ in range(5):
        sync(check.device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(check.device)
        rates.append(n / (time.perf_counter() - t0) / 1e9)
    return {"bytes": n, "pinned": check.device.type == "cuda", "gb_per_s_median": round(sorted(rates)[2], 2),
            "gb_per_s_all": [round(r, 2) for r in rates]}


def extract_teacher(check: Check) -> dict[str, Any]:
    """Extraction of synthetic chats with a random-initialised Qwen3-8B-shaped teacher (no download)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_extract
    from bench_extract import bare_forward_s, write_data
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import extract.loop as run_mod
    from extract.loop import run_extraction
    from extract.teacher import default_layer_ids
    from extract.tiny import build_tiny_teacher

    layers, hidden, inter, heads, kv = (36, 4096, 12288, 32, 8) if not check.dry else (8, 128, 384, 4, 2)
    n_samples = 16 if check.dry else 256
    with tempfile.TemporaryDirectory(dir=os.environ.get("DFLASH_GPU_CHECK_TMP")) as tmp:
        tmp = Path(tmp)
        tdir = build_tiny_teacher(tmp / "teacher")  # its tokenizer and chat template
        qcfg = Qwen3Config.from_pretrained(tdir)
        qcfg.update(dict(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=128 if not check.dry else 32,
                         vocab_size=151936 if not check.dry else qcfg.vocab_size,
                         layer_types=["full_attention"] * layers, max_window_layers=layers))
        dtype = torch.bfloat16 if check.device.type == "cuda" else torch.float32
        t0 = time.perf_counter()
        with torch.device(check.device):
            teacher = Qwen3ForCausalLM(qcfg).to(dtype).eval().requires_grad_(False)
        init_s = time.perf_counter() - t0
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tdir)
        data = write_data(tmp / "data.jsonl", n_samples)
        overrides = [f"teacher.path={tdir}", f"data.path={data}", "cache.num_target_layers=5",
                     "extract.tokens_per_batch=16384" if not check.dry else "extract.tokens_per_batch=2048",
                     f"extract.unit_size={n_samples}", "cache.bucket_edges=[256, 512]", "data.max_length=1024",
                     "teacher.dtype=" + ("bfloat16" if check.device.type == "cuda" else "float32"),
                     "model.mask_token_id=5"]
        cfg = load_config(ROOT / "configs" / "tiny.toml", overrides)
        originals = (run_mod.load_teacher, bench_extract.load_teacher)
        run_mod.load_teacher = bench_extract.load_teacher = lambda teacher_cfg: (teacher, tok)  # in memory
        try:
            layer_ids = default_layer_ids(layers, 5)
            bare_before = bare_forward_s(cfg, layer_ids)[0]
            report = run_extraction(cfg, str(tmp / "cache"), progress=False)
            bare_after = bare_forward_s(cfg, layer_ids)[0]
        finally:
            run_mod.load_teacher, bench_extract.load_teacher = originals
    bare = (bare_before + bare_after) / 2
    return {"teacher": f"qwen3 {layers} layers, hidden {hidden}, random init", "init_s": round(init_s, 1),
            "samples": report.samples_written, "tokens": report.tokens_written,
            "extract_loop_s": round(report.loop_s, 2), "bare_forward_s": round(bare, 2),
            "extract_over_bare": round(report.loop_s / bare, 3) if bare else None,
            "teacher_tokens_per_s": round(report.tokens_written / bare, 1) if bare else None,
            "padding_fraction": round(report.padding_fraction, 4), "writer_stall_s": round(report.stall_s, 2)}


# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="tiny shapes on the CPU (checks the script, not the GPU)")
    ap.add_argument("--out", default=str(RESULTS), help="where the JSON results go")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting sections after this long "
                    "(keeps the whole check within 8 minutes on one H200)")
    ap.add_argument("--only", action="append", default=[], help="run only these sections (repeatable)")
    args = ap.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or use --dry to check the script on the CPU", file=sys.stderr)
        return 2
    if args.dry:
        torch.set_num_threads(1)
    check = Check(args.dry, args.budget_s)
    sections: list[tuple[str, Callable[[], dict[str, Any]], float]] = [
        ("pytest_gpu", lambda: pytest_gpu(check), 60),
        ("flex_vs_sdpa", lambda: flex_vs_sdpa(check), 60),
        ("train_8b", lambda: train_steps(check, "qwen3-8b"), 90),
        ("train_27b", lambda: train_steps(check, "qwen3.6-27b"), 90),
        ("loader_27b", lambda: loader_feed(check), 60),
        ("train_27b_plain", lambda: train_steps(check, "qwen3.6-27b", checkpointing=False), 90),
        ("train_27b_dflash2", lambda: train_steps(check, "qwen3.6-27b-dflash2"), 90),
        ("h2d", lambda: h2d(check), 5),
        ("extract_8b", lambda: extract_teacher(check), 90),
    ]
    if args.dry:
        sections = [s for s in sections if s[0] != "pytest_gpu"]
    for name, fn, needs in sections:
        if not args.only or name in args.only:
            check.run(name, fn, needs)
    env = {"torch": torch.__version__, "python": platform.python_version(), "dry": args.dry,
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.dry else "cpu",
           "load_average": os.getloadavg()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env, "sections": check.results}, indent=1, default=str))
    print(f"results: {out}")
    return 0 if all(r.get("status") != "error" for r in check.results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
