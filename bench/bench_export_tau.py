"""The demo drafter's live acceptance length through the shipped modeling file against ``dflash-train eval
--live``: the exported directory loaded with ``AutoModel.from_pretrained(..., trust_remote_code=True)`` and
decoded with its ``spec_generate`` on the same held-out prompts, the same teacher and token budget.

    .venv/bin/python bench/bench_export_tau.py [--demo runs/demo] [--config configs/tiny.toml]

Needs a finished ``make demo`` (its cache and run dir). Prints τ both ways, per prompt, and whether the
outputs are identical; writes bench/results/bench_export_tau.json. fp32 on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from dflash_cache import open_cache
from dflash_cache.runtime.config import load_config
from dflash_cache.runtime.threads import budget_cpu_threads
from extract.teacher import load_teacher
from train.tools.evaluate import holdout_sample_ids, live_prompts, load_for_eval, run_live
from train.tools.export import cli_main as export_main

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "bench_export_tau.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", default="runs/demo", help="a finished demo's output directory")
    ap.add_argument("--config", default="configs/tiny.toml", help="the preset the demo ran")
    args = ap.parse_args()
    demo = Path(args.demo)
    if not (demo / "cache").is_dir() or not (demo / "run").is_dir():
        raise SystemExit(f"{demo} holds no finished demo (cache/ and run/): run `make demo` first, or pass --demo")
    cfg = load_config(args.config)
    budget_cpu_threads("cpu", cfg.loader.num_readers)
    cache = open_cache(str(demo / "cache"))
    ids = holdout_sample_ids(cache, cfg.loader.holdout_fraction)

    ours = run_live(load_for_eval(str(demo / "run"), cache, cfg.model.attention), cfg.eval, cfg.teacher, cache, ids)

    from transformers import AutoModel

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "export"
        assert export_main([str(demo / "run"), "--out", str(out), "--dtype", "float32"]) == 0
        draft = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
        teacher, tokenizer = load_teacher(cfg.teacher)
        eos = [int(t) for t in np.atleast_1d(teacher.generation_config.eos_token_id or tokenizer.eos_token_id)]
        prompts, _ = live_prompts(cache, ids, cfg.eval.live_prompts)
        shipped = []
        for (sid, prompt), mine in zip(prompts, ours["prompts"], strict=True):
            assert mine["sample_id"] == sid
            with torch.no_grad():
                gen = draft.spec_generate(teacher, torch.tensor([prompt]), cfg.eval.live_max_new_tokens, eos, 0.0,
                                          return_stats=True)
            shipped.append({"sample_id": sid, "tau": gen.tau, "cycles": len(gen.acceptance_lengths),
                            "acceptance_lengths": gen.acceptance_lengths,
                            "generated_tokens": gen.num_output_tokens,
                            "same_cycles_as_eval": gen.acceptance_lengths == mine["accepted_per_cycle"]})
    tau_shipped = sum(p["tau"] for p in shipped) / len(shipped)
    res = {"eval_live_tau": ours["tau"], "shipped_dflash_py_tau": tau_shipped,
           "per_prompt": [{"sample_id": p["sample_id"], "eval_live": m["tau"], "dflash_py": p["tau"],
                           "same_cycles": p["same_cycles_as_eval"]} for p, m in zip(shipped, ours["prompts"], strict=True)],
           "max_new_tokens": cfg.eval.live_max_new_tokens, "convention": ours["tau_convention"],
           "load_avg": os.getloadavg()[0]}
    print(f"live tau: dflash-train eval --live {ours['tau']:.3f}, shipped dflash.py {tau_shipped:.3f} over "
          f"{len(shipped)} held-out prompts")
    for p in res["per_prompt"]:
        print(f"  sample {p['sample_id']}: eval {p['eval_live']:.3f}  dflash.py {p['dflash_py']:.3f}  "
              f"same cycles: {p['same_cycles']}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
