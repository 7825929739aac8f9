"""Teacher-forced acceptance over cache samples, live speculative decoding, and the eval CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dflash_cache.runtime.config import config_to_dict
from dflash_cache.runtime.schema import PipelineConfig
from extract.config import TeacherConfig
from train.components.checkpoint import Checkpointer
from train.config import CheckpointConfig, ModelConfig
from train.models.factory import build_drafter
from train.models.model import DFlashConfig, DFlashDrafter
from train.models.objective import FlatBatch, build_blocks
from train.tools.evaluate import (
    _sample_batch,
    cli_main,
    greedy_reference,
    holdout_sample_ids,
    live_eval,
    live_prompts,
    propose,
    speculative_decode,
    teacher_forced_eval,
)

VOCAB, HIDDEN = 512, 64
MODEL = dict(num_hidden_layers=1, block_size=8, mask_token_id=VOCAB - 1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=10000.0, attention="sdpa")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    from dflash_cache.synthetic import make_synthetic_cache

    url = str(tmp_path_factory.mktemp("cache") / "c")
    return make_synthetic_cache(url, n_samples=24, hidden_size=HIDDEN, vocab_size=VOCAB, min_length=12,
                                max_length=120, median_length=40, seed=1)


@pytest.fixture(scope="module")
def drafter(cache):
    torch.manual_seed(0)
    return build_drafter(ModelConfig(**MODEL), cache.spec, cache.load_head()).eval()


def _slow_tau(model, sample) -> tuple[int, int]:
    """One block per forward: (sum of leading correct rows, number of blocks)."""
    batch = _sample_batch(sample, torch.device("cpu"))
    flat = FlatBatch.of(batch)
    accepted, n = 0, 0
    for a in flat.eligible.nonzero().flatten().tolist():
        blocks = build_blocks(flat, torch.tensor([a]), 8, VOCAB - 1)
        with torch.no_grad():
            h = model(batch.features, blocks.block_ids, blocks.block_positions, blocks.layout)
        pred = model.logits(h)[0].argmax(-1)
        ok = (pred == blocks.targets[0]) & blocks.row_valid[0]
        k = 1
        while k < 8 and ok[k]:
            k += 1
        accepted += k - 1
        n += 1
    return accepted, n


def test_teacher_forced_eval_covers_every_eligible_anchor_exactly(cache, drafter):
    ids = np.sort(cache.index().sample_ids)[:3]
    res = teacher_forced_eval(drafter, cache, ids)
    samples = cache.read_samples(ids.tolist())
    slow = [_slow_tau(drafter, s) for s in samples]
    n_blocks = sum(n for _, n in slow)
    assert res.n_blocks == n_blocks and res.n_samples == 3
    assert res.acceptance_length == pytest.approx(1 + sum(a for a, _ in slow) / n_blocks)
    assert len(res.per_position_accuracy) == 7


def test_max_blocks_stops_early(cache, drafter):
    ids = np.sort(cache.index().sample_ids)
    res = teacher_forced_eval(drafter, cache, ids, max_blocks=10)
    assert res.n_blocks >= 10 and res.n_samples < len(ids)


def test_holdout_ids_follow_the_training_plan(cache):
    from train.data.plan import holdout_mask

    all_ids = cache.index().sample_ids
    held = holdout_sample_ids(cache, 0.3)
    assert set(held.tolist()) == set(all_ids[holdout_mask(all_ids, 0.3)].tolist())
    assert 0 < len(held) < len(all_ids)


def test_empty_holdout_is_a_clear_error(cache, drafter):
    from dflash_cache.errors import ConfigError

    with pytest.raises(ConfigError, match="holdout_fraction"):
        teacher_forced_eval(drafter, cache, np.array([], dtype=np.int64))


def _write_run(tmp_path, cache, drafter):
    cfg = PipelineConfig(model=ModelConfig(**MODEL))
    cfg.loader.holdout_fraction = 0.3
    ck = Checkpointer(tmp_path / "run", CheckpointConfig(), config=config_to_dict(cfg),
                      cache_fingerprint=cache.spec.fingerprint)
    ck.save(7, drafter.state_dict(), {"step": 7})
    ck.close()
    toml = tmp_path / "c.toml"
    toml.write_text("[model]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in MODEL.items())
                    + "[loader]\nholdout_fraction = 0.3\n")
    return toml


def test_eval_cli_json(tmp_path, cache, drafter, capsys):
    toml = _write_run(tmp_path, cache, drafter)
    assert cli_main([str(toml), "--cache", cache.url, "--checkpoint", str(tmp_path / "run"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"acceptance_length", "per_position_accuracy", "n_blocks"} <= set(out)
    direct = teacher_forced_eval(drafter, cache, holdout_sample_ids(cache, 0.3))
    assert out["n_blocks"] == direct.n_blocks
    assert out["acceptance_length"] == pytest.approx(direct.acceptance_length)


def test_eval_cli_rejects_a_checkpoint_for_another_cache(tmp_path, cache, drafter):
    from dflash_cache.errors import SpecMismatchError
    from dflash_cache.synthetic import make_synthetic_cache

    toml = _write_run(tmp_path, cache, drafter)
    other = make_synthetic_cache(str(tmp_path / "other"), n_samples=4, hidden_size=32, vocab_size=VOCAB,
                                 max_length=64, median_length=20)
    with pytest.raises(SpecMismatchError, match="hidden_size"):
        cli_main([str(toml), "--cache", other.url, "--checkpoint", str(tmp_path / "run")])


# ---- live speculative decoding with the tiny teacher ------------------------------------------


@pytest.fixture(scope="module")
def tiny_teacher():
    from extract.teacher import load_teacher
    from extract.tiny import resolve_tiny_teacher

    return load_teacher(TeacherConfig(path=str(resolve_tiny_teacher()), dtype="float32", device="cpu"))


def _live_drafter(teacher) -> DFlashDrafter:
    from extract.tiny import TINY_MASK_TOKEN_ID

    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=teacher.config.hidden_size, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, intermediate_size=128,
                       vocab_size=teacher.config.vocab_size, block_size=4, mask_token_id=TINY_MASK_TOKEN_ID,
                       target_layer_ids=[1, 2, 3], num_target_layers=teacher.config.num_hidden_layers)
    head = (teacher.get_input_embeddings().weight.detach(), teacher.get_output_embeddings().weight.detach())
    return DFlashDrafter(cfg, *head, attention="sdpa").eval()


def _prompts(tokenizer):
    from extract.builtin_text import builtin_prompts

    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for t in builtin_prompts(2)]


def test_live_decoding_is_lossless_with_an_untrained_drafter(tiny_teacher):
    from extract.tiny import TINY_EOS_TOKEN_ID

    teacher, tokenizer = tiny_teacher
    model = _live_drafter(teacher)
    res = live_eval(model, teacher, _prompts(tokenizer), max_new_tokens=10, eos={TINY_EOS_TOKEN_ID},
                    layer_ids=[1, 2, 3])
    assert len(res.prompts) == 2
    for p in res.prompts:
        assert 1.0 <= p.tau <= 4.0
        produced = 1 + sum(p.accepted_per_cycle)  # the prefill gives the first token
        assert produced >= len(p.generated)
        assert produced - p.accepted_per_cycle[-1] <= 10  # each cycle ran while at most 10 tokens existed


def _oracle(monkeypatch, prompt, want, hits=None):
    """A drafter proposing the teacher's own continuation ``want``, right for the first ``hits[cycle]``
    drafts of each cycle (all 3 when ``hits`` is None) and wrong after."""
    import train.tools.evaluate as ev

    cycles = []

    def oracle(model, ctx_features, last_token):
        done = ctx_features.shape[0] - len(prompt) + 1  # generated tokens up to and including last_token
        assert want[done - 1] == last_token
        k = 3 if hits is None else hits[len(cycles)]
        cycles.append(k)
        wrong = (want[done + k] + 1) % 700  # not the teacher's token
        return want[done:done + k] + [wrong] * (3 - k)

    monkeypatch.setattr(ev, "propose", oracle)


def test_live_decoding_accepts_whole_blocks_from_an_oracle_drafter(tiny_teacher, monkeypatch):
    """A drafter that proposes the teacher's own continuation gets every block accepted: tau = B, also
    when the budget cuts the last block (it counts in full, as in the DFlash reference loop)."""
    teacher, tokenizer = tiny_teacher
    model = _live_drafter(teacher)
    prompt = _prompts(tokenizer)[0]
    want = greedy_reference(teacher, prompt, 16, set())
    _oracle(monkeypatch, prompt, want)
    res = live_eval(model, teacher, [prompt], max_new_tokens=10, eos=set(), layer_ids=[1, 2, 3])
    assert res.prompts[0].generated == want[:10]
    # 1 (prefill) + 4 + 4 = 9 <= 10 tokens: a third cycle runs; its 4 tokens run past the budget, all count
    assert res.prompts[0].accepted_per_cycle == [4, 4, 4]
    assert res.tau == 4.0


def test_live_tau_counts_cycles_like_the_reference(tiny_teacher, monkeypatch):
    """Cycles run while at most max_new_tokens tokens exist (one more runs when the budget is met
    exactly); a stop token ends the loop after its cycle, which counts in full; the overall tau is the
    mean of the per-prompt taus."""
    from train.tools.evaluate import LiveResult

    teacher, tokenizer = tiny_teacher
    model = _live_drafter(teacher)
    p0, p1 = _prompts(tokenizer)
    want0, want1 = greedy_reference(teacher, p0, 16, set()), greedy_reference(teacher, p1, 16, set())

    _oracle(monkeypatch, p0, want0, hits=[3, 2, 3])
    got = speculative_decode(model, teacher, p0, 8, set(), [1, 2, 3])
    assert got.accepted_per_cycle == [4, 3, 4]  # 1 + 4 + 3 = 8 tokens = the budget: one more cycle runs
    assert got.generated == want0[:8]

    assert want0[3] not in want0[:3]
    _oracle(monkeypatch, p0, want0, hits=[1, 3])
    got = speculative_decode(model, teacher, p0, 10, {want0[3]}, [1, 2, 3])  # the stop token is the 4th
    assert got.accepted_per_cycle == [2, 4] and got.generated == want0[:4]

    _oracle(monkeypatch, p0, want0, hits=[3, 3, 3])
    a = speculative_decode(model, teacher, p0, 10, set(), [1, 2, 3])
    _oracle(monkeypatch, p1, want1, hits=[0] * 10)
    b = speculative_decode(model, teacher, p1, 10, set(), [1, 2, 3])
    assert a.accepted_per_cycle == [4, 4, 4] and b.accepted_per_cycle == [1] * 10
    assert LiveResult([a, b]).tau == 2.5  # (4 + 1) / 2, not the pooled 22 / 13


def test_live_prompts_are_the_tokens_before_the_first_loss_token(cache):
    held = holdout_sample_ids(cache, 0.3)
    prompts, skipped = live_prompts(cache, held, 3)
    assert [i for i, _ in prompts] == held[:3].tolist() and skipped == 0
    for (sid, ids), sample in zip(prompts, cache.read_samples(held[:3].tolist()), strict=True):
        first = int(sample.loss_mask.int().argmax())
        assert sid == sample.sample_id and first > 0 and ids == sample.input_ids[:first].tolist()
    assert [i for i, _ in live_prompts(cache, held, 100)[0]] == held.tolist()  # fewer samples than asked


def test_propose_drafts_block_size_minus_one_tokens(tiny_teacher):
    teacher, _ = tiny_teacher
    model = _live_drafter(teacher)
    feats = torch.randn(10, 3 * teacher.config.hidden_size)
    assert len(propose(model, feats, 7)) == 3
