"""Side by side with the DFlash reference's own code: released configs read as it reads them, and both τ conventions.

Not a test (the suite cannot depend on the reference package): it needs the ``dflash`` 0.1.0 package importable
(``pip download dflash==0.1.0 --no-deps`` and unzip it, then put that folder on PYTHONPATH after the repository)
and, for the 44947fb loop, that commit's ``dflash/model.py`` saved as a file:

    PYTHONPATH=$PWD:/tmp/dflash_pkg .venv/bin/python bench/bench_reference_parity.py \\
        --ref-44947fb /tmp/ref44947fb_model.py [--demo runs/demo] [--set eval.live_prompts=16 ...]

Part 1, released configs: a released-style drafter directory (one sliding + one full layer, tiny teacher shapes,
random weights) per case (``is_causal`` absent / true / false, ``dflash_config.input_embedding_scale`` 2.5) is
loaded by the reference's ``DFlashDraftModel.from_pretrained`` and by ``model.init_from`` (``build_drafter``);
block logits are compared (max |difference|, argmax agreement), also for the reading this product had before
(every layer bidirectional, no scale). Then our drafter trains a step, is exported, and the export is loaded by
the reference again: the same comparison.

Part 2, τ (needs a finished ``make demo``): the demo drafter exported, decoded greedily on the held-out prompts
by the reference 44947fb loop, by the 0.1.0 package's ``dflash_generate``, by the exported ``dflash.py``'s
``spec_generate`` and by ``eval --live``; per-prompt cycle counts compared (44947fb vs ours; 0.1.0 vs our
``--card-tau`` replay) and both τ printed. Writes bench/results/bench_reference_parity.json. fp32, CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "bench_reference_parity.json"
CASES = {
    "is_causal absent": {},
    "is_causal true": {"is_causal": True},
    "is_causal false": {"is_causal": False},
    "input_embedding_scale 2.5": {"dflash_config": {"input_embedding_scale": 2.5}},
}


def _released_dir(path: Path, top: dict, teacher_cfg, mask_id: int, seed: int) -> Path:
    from train.models.model import DFlashConfig, DFlashDrafter, save_drafter_weights

    torch.manual_seed(seed)
    cfg = DFlashConfig(hidden_size=teacher_cfg.hidden_size, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=teacher_cfg.vocab_size,
                       block_size=8, mask_token_id=mask_id, target_layer_ids=[1, 2, 3],
                       num_target_layers=teacher_cfg.num_hidden_layers, rope_theta=10000.0,
                       layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    head = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    model = DFlashDrafter(cfg, head, head)
    model.reset_parameters(std=0.1)
    path.mkdir(parents=True)
    save_drafter_weights(model, path / "model.safetensors")
    hf = cfg.to_hf_dict()
    hf.pop("is_causal", None)  # released style: no key of ours, causality only as the case says
    hf["dflash_config"] = {"mask_token_id": mask_id, "target_layer_ids": [1, 2, 3], **top.get("dflash_config", {})}
    hf.update({k: v for k, v in top.items() if k != "dflash_config"})
    hf["dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(hf))
    return path


def _ref_logits(ref_mod, directory: Path, teacher, features: torch.Tensor, ids: torch.Tensor, anchors) -> torch.Tensor:
    """The reference's block logits [N, B, V], its noise embedding built as its dflash_generate builds it."""
    model = ref_mod.DFlashDraftModel.from_pretrained(str(directory), dtype=torch.float32).eval()
    scale = float(ref_mod._draft_value(model.config, "input_embedding_scale", 1.0))
    B, out = model.block_size, []
    for a in anchors:
        block = torch.cat([ids[a:a + 1], torch.full((B - 1,), model.mask_token_id)]).unsqueeze(0)
        with torch.no_grad():
            h = model(position_ids=torch.arange(a + B).unsqueeze(0), target_hidden=features[:a].unsqueeze(0),
                      noise_embedding=ref_mod._raw_input_embeddings(teacher, block, scale))
            out.append(model.compute_logits(h, teacher.lm_head)[0])
    return torch.stack(out)


def _our_logits(model, features, ids, anchors) -> torch.Tensor:
    from train.models.attention import BlockLayout

    B, T = model.config.block_size, features.shape[0]
    out = []
    for a in anchors:
        block = torch.cat([ids[a:a + 1], torch.full((B - 1,), model.config.mask_token_id)]).unsqueeze(0)
        layout = BlockLayout(torch.tensor([a]), torch.zeros(T, dtype=torch.long), torch.arange(T), B)
        with torch.no_grad():
            out.append(model.logits(model(features.unsqueeze(0), block, (a + torch.arange(B)).unsqueeze(0), layout))[0])
    return torch.stack(out)


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    return {"max_abs_diff": float((a - b).abs().max()), "argmax_agree": int((a.argmax(-1) == b.argmax(-1)).sum()),
            "rows": int(a.shape[0] * a.shape[1])}


def released_configs(ref_mod) -> dict:
    from transformers import AutoModelForCausalLM

    from extract.teacher import capture_features
    from extract.tiny import TINY_MASK_TOKEN_ID, resolve_tiny_teacher
    from train.config import ModelConfig
    from train.models.factory import build_drafter
    from train.models.objective import dflash_loss
    from train.tools.export import export_drafter

    teacher = AutoModelForCausalLM.from_pretrained(str(resolve_tiny_teacher()), dtype=torch.float32).eval()
    c = teacher.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 700, (64,), generator=g)
    features = capture_features(teacher, ids.unsqueeze(0), None, [1, 2, 3])[0][0].float().clone()  # [T, 3H]
    anchors = list(range(9, 56, 3))
    spec = SimpleNamespace(teacher=SimpleNamespace(name_or_path="tiny", hidden_size=c.hidden_size,
                                                   vocab_size=c.vocab_size, num_layers=c.num_hidden_layers),
                           target_layer_ids=[1, 2, 3], fingerprint="fp")
    head = (teacher.get_input_embeddings().weight.detach(), teacher.lm_head.weight.detach())
    batch = SimpleNamespace(features=features.unsqueeze(0), input_ids=ids.unsqueeze(0),
                            loss_mask=torch.ones(1, 64, dtype=torch.bool), doc_ids=torch.zeros(1, 64, dtype=torch.int32),
                            position_ids=torch.arange(64).unsqueeze(0), seed=0)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, top) in enumerate(CASES.items()):
            d = _released_dir(Path(tmp) / f"r{i}", top, c, TINY_MASK_TOKEN_ID, seed=i)
            mc = ModelConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             intermediate_size=256, block_size=8, mask_token_id=TINY_MASK_TOKEN_ID, rope_theta=10000.0,
                             layer_types=["sliding_attention", "full_attention"], sliding_window=8, attention="sdpa",
                             init_from=str(d))  # a warm start's model section states the released drafter's shapes
            ours = build_drafter(mc, spec, head).eval()
            ref = _ref_logits(ref_mod, d, teacher, features, ids, anchors)
            before = build_drafter(mc.model_copy(update={"init_from": None}), spec, head).eval()
            before.load_state_dict(ours.state_dict())  # the old reading: every layer bidirectional, no scale
            row = {"loaded": _compare(_our_logits(ours, features, ids, anchors), ref),
                   "old_reading": _compare(_our_logits(before, features, ids, anchors), ref)}
            ours.train()
            opt = torch.optim.SGD(ours.parameters(), lr=0.5)
            dflash_loss(ours, batch, num_anchors=16).loss.backward()
            opt.step()
            ours.eval()
            exp = export_drafter(ours.state_dict(), ours.config, Path(tmp) / f"e{i}", dtype="float32")
            row["trained_and_exported"] = _compare(_our_logits(ours, features, ids, anchors),
                                                   _ref_logits(ref_mod, exp, teacher, features, ids, anchors))
            row["exported_causality"] = {k: json.loads((exp / "config.json").read_text()).get(k) for k in ("is_causal",)}
            out[name] = row
            print(f"{name:28s} loaded: max|d| {row['loaded']['max_abs_diff']:.2e} argmax {row['loaded']['argmax_agree']}"
                  f"/{row['loaded']['rows']}; old reading: max|d| {row['old_reading']['max_abs_diff']:.3f} argmax "
                  f"{row['old_reading']['argmax_agree']}/{row['old_reading']['rows']}; after a step + export: max|d| "
                  f"{row['trained_and_exported']['max_abs_diff']:.2e}; exported is_causal "
                  f"{row['exported_causality']['is_causal']}")
    return out


class _KeepFirstCache:
    """A DynamicCache whose ``crop(n)`` keeps the first ``n`` positions, as the transformers 44947fb was written for
    did (recent versions refuse a positive ``crop``)."""

    def __new__(cls):
        from transformers import DynamicCache

        class KeepFirst(DynamicCache):
            def crop(self, max_length: int) -> None:
                extra = self.get_seq_length() - max_length
                if extra > 0:
                    super().crop(-extra)

        return KeepFirst()


def tau_conventions(ref_mod, ref44947fb, demo: Path, config: str, overrides: list[str]) -> dict:
    from transformers import AutoModel

    from dflash_cache import open_cache
    from dflash_cache.runtime.config import load_config
    from extract.teacher import load_teacher
    from train.tools.evaluate import holdout_sample_ids, live_prompts, load_for_eval, run_live
    from train.tools.export import cli_main as export_main

    cfg = load_config(config, overrides)
    cache = open_cache(str(demo / "cache"))
    ids = holdout_sample_ids(cache, cfg.loader.holdout_fraction)
    live = run_live(load_for_eval(str(demo / "run"), cache, cfg.model.attention), cfg.eval, cfg.teacher, cache, ids,
                    card_tau=True)
    teacher, tokenizer = load_teacher(cfg.teacher)
    eos = [int(t) for t in np.atleast_1d(teacher.generation_config.eos_token_id or tokenizer.eos_token_id)]
    prompts, _ = live_prompts(cache, ids, cfg.eval.live_prompts)
    N = cfg.eval.live_max_new_tokens
    ref_mod._cuda_time = time.perf_counter  # its timers call torch.cuda.synchronize
    ref44947fb._cuda_time = time.perf_counter
    ref44947fb.DynamicCache = _KeepFirstCache  # 44947fb's crop(n) keeps the first n positions (older transformers)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "export"
        assert export_main([str(demo / "run"), "--out", str(out), "--dtype", "float32"]) == 0
        shipped = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
        r010 = ref_mod.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
        r449 = ref44947fb.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
        for (_sid, prompt), mine in zip(prompts, live["prompts"], strict=True):
            x = torch.tensor([prompt])
            a = ref44947fb.dflash_generate(r449, teacher, x, N, eos, 0.0, return_stats=True).acceptance_lengths
            b = ref_mod.dflash_generate(r010, teacher, x, N, eos, 0.0, return_stats=True).acceptance_lengths
            s = shipped.spec_generate(teacher, x, N, eos, 0.0, return_stats=True).acceptance_lengths
            card = live["card_cycles"][len(rows)]  # eval --live's cycles replayed in the card convention
            rows.append({"ref_44947fb": a, "ref_0_1_0": b, "spec_generate": s, "eval_live": mine["accepted_per_cycle"],
                         "eval_live_card": card})
    def mean_tau(key):
        taus = [sum(r[key]) / len(r[key]) for r in rows if r[key]]
        return sum(taus) / len(taus)

    res = {
        "prompts": len(rows), "max_new_tokens": N,
        "tau_44947fb": mean_tau("ref_44947fb"), "tau_eval_live": mean_tau("eval_live"),
        "tau_spec_generate": mean_tau("spec_generate"), "tau_0_1_0": mean_tau("ref_0_1_0"),
        "tau_card_eval_live": mean_tau("eval_live_card"),
        "cycles_equal_44947fb": sum(r["ref_44947fb"] == r["eval_live"] == r["spec_generate"] for r in rows),
        "cycles_equal_0_1_0": sum(r["ref_0_1_0"] == r["eval_live_card"] for r in rows),
        "per_prompt": rows,
    }
    print(f"tau over {len(rows)} held-out prompts, {N} new tokens: 44947fb {res['tau_44947fb']:.3f}, eval --live "
          f"{res['tau_eval_live']:.3f}, spec_generate {res['tau_spec_generate']:.3f} (cycle lists equal on "
          f"{res['cycles_equal_44947fb']}/{len(rows)}); dflash 0.1.0 {res['tau_0_1_0']:.3f}, eval --live --card-tau "
          f"{res['tau_card_eval_live']:.3f} (cycle lists equal on {res['cycles_equal_0_1_0']}/{len(rows)})")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref-44947fb", required=True, help="z-lab/dflash 44947fb's dflash/model.py, saved as a file")
    ap.add_argument("--demo", default="runs/demo", help="a finished demo's output directory (part 2)")
    ap.add_argument("--config", default="configs/tiny.toml", help="the preset the demo ran")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, e.g. eval.live_prompts=16 eval.live_max_new_tokens=128")
    args = ap.parse_args()
    torch.set_num_threads(2)
    import dflash.model as ref_mod

    spec = importlib.util.spec_from_file_location("ref44947fb_model", args.ref_44947fb)
    ref44947fb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref44947fb)
    result = {"released_configs": released_configs(ref_mod)}
    if (Path(args.demo) / "run").is_dir():
        result["tau"] = tau_conventions(ref_mod, ref44947fb, Path(args.demo), args.config, args.overrides)
    else:
        print(f"{args.demo}: no finished demo; part 2 (tau) skipped (run `make demo`)")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
