"""The export loads the way DFlash users load a drafter: ``AutoModel.from_pretrained(dir, trust_remote_code=True)``.

The shipped ``dflash.py`` must compute what ``train/models/model.py`` computes (same block logits, both
within-block rules of sliding layers), and its ``spec_generate`` must decode losslessly against a
teacher loaded with ``from_pretrained``.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import torch
from fixtures.drafters import tiny_batch, tiny_drafter
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from dflash_cache.errors import ConfigError
from train.models.model import DFlashConfig, DFlashDrafter
from train.models.objective import FlatBatch, build_blocks
from train.tools.export import MODELING_FILE, cli_main, export_drafter, modeling_source

SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=12)


def _export(model: DFlashDrafter, out, dtype: str = "float32"):
    return export_drafter(model.state_dict(), model.config, out, dtype=dtype)


def _load(path, dtype=torch.float32):
    return AutoModel.from_pretrained(str(path), trust_remote_code=True, dtype=dtype).eval()


def test_modeling_file_imports_only_torch_and_transformers():
    tree = ast.parse(modeling_source().read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))  # no relative imports
    assert roots - set(sys.stdlib_module_names) == {"torch", "transformers"}


@pytest.mark.parametrize("overrides,hint", [
    ({}, None),
    (dict(SLIDING, sliding_within_block="bidirectional"), False),
    (dict(SLIDING, sliding_within_block="causal"), None),
])
def test_export_ships_the_modeling_file_and_the_engines_causality_switches(tmp_path, overrides, hint):
    model = tiny_drafter(seed=4, **overrides)
    out = _export(model, tmp_path / "e")
    assert (out / MODELING_FILE).read_bytes() == modeling_source().read_bytes()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    # SGLang and vLLM make sliding layers causal unless told: a bidirectional drafter tells them.
    assert cfg.get("is_causal") is hint and cfg["dflash_config"].get("causal") is hint
    draft = _load(out)
    assert (draft.block_size, draft.mask_token_id, draft.target_layer_ids) == (8, 95, [1, 2, 3])
    assert [layer.self_attn.causal for layer in draft.layers] == [
        model.config.within_block(i) == "causal" for i in range(model.config.num_hidden_layers)]
    loaded = draft.state_dict()
    assert set(loaded) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
    # re-exporting the export (a drafter directory) through the CLI gives the same directory
    assert cli_main([str(out), "--out", str(tmp_path / "again"), "--dtype", "float32"]) == 0
    for name in ("config.json", MODELING_FILE):
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes()


def _train_block_logits(model: DFlashDrafter, batch, anchors: list[int]) -> torch.Tensor:
    """[N, B, V] logits of train/models/model.py for blocks at ``anchors`` of row 0."""
    blocks = build_blocks(FlatBatch.of(batch), torch.tensor(anchors), model.block_size, model.mask_token_id)
    with torch.no_grad():
        h = model(batch.features, blocks.block_ids, blocks.block_positions, blocks.layout)
    return model.logits(h)  # [N, B, V]


@pytest.mark.parametrize("overrides", [
    {},
    dict(SLIDING, sliding_within_block="bidirectional"),
    dict(SLIDING, sliding_within_block="causal"),
    dict(layer_types=["sliding_attention", "sliding_attention"], sliding_window=8, sliding_within_block="causal",
         block_size=6),
    dict(num_hidden_layers=5, layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=12),
], ids=["full", "sliding-bidirectional", "sliding-causal", "all-sliding-causal", "27b-preset-layer-types"])
def test_block_logits_equal_the_training_model(tmp_path, overrides):
    model = tiny_drafter(seed=5, **overrides)
    draft = _load(_export(model, tmp_path / "e"))
    batch = tiny_batch(rows=1, length=48, seed=6)
    anchors = [9, 21, 22, 40]  # increasing: the cached path below feeds the context in pieces
    want = _train_block_logits(model, batch, anchors)  # [N, B, V]
    B = model.block_size

    def block_logits(a: int, ctx_from: int, cache) -> torch.Tensor:
        block = torch.full((1, B), model.mask_token_id)
        block[0, 0] = batch.input_ids[0, a]
        with torch.no_grad():
            h = draft(position_ids=torch.arange(ctx_from, a + B).unsqueeze(0), noise_embedding=model.embed(block),
                      target_hidden=batch.features[:, ctx_from:a], past_key_values=cache)  # [1, B, H]
        return model.logits(h)[0]  # [B, V]

    cache, seen = DynamicCache(), 0
    for n, a in enumerate(anchors):
        whole = block_logits(a, 0, None)  # the whole context in one forward
        torch.testing.assert_close(whole, want[n], rtol=1e-4, atol=1e-5)
        piecewise = block_logits(a, seen, cache)  # only the new context, the rest from the cache
        cache.crop(-(cache.get_seq_length() - a))  # drop the block, keep the context
        seen = a
        torch.testing.assert_close(piecewise, want[n], rtol=1e-4, atol=1e-5)


def test_the_within_block_rule_changes_sliding_layers_logits():
    """The two rules really differ on this config (so the equality above tells them apart)."""
    batch = tiny_batch(rows=1, length=48, seed=6)
    bi = _train_block_logits(tiny_drafter(seed=5, **SLIDING, sliding_within_block="bidirectional"), batch, [30])
    causal = _train_block_logits(tiny_drafter(seed=5, **SLIDING, sliding_within_block="causal"), batch, [30])
    assert (bi - causal).abs().max() > 1e-3


# ---- speculative decoding against the tiny teacher ----------------------------------------------


@pytest.fixture(scope="module")
def teacher(tiny_teacher_dir):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_teacher_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_teacher_dir))


def _teacher_drafter(teacher_model, **overrides) -> DFlashDrafter:
    from extract.tiny import TINY_MASK_TOKEN_ID

    torch.manual_seed(0)
    c = teacher_model.config
    kw = dict(hidden_size=c.hidden_size, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, intermediate_size=256, vocab_size=c.vocab_size, block_size=4,
              mask_token_id=TINY_MASK_TOKEN_ID, target_layer_ids=[1, 2, 3], num_target_layers=c.num_hidden_layers,
              rope_theta=10000.0, layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    kw.update(overrides)
    head = (teacher_model.get_input_embeddings().weight.detach(), teacher_model.get_output_embeddings().weight.detach())
    return DFlashDrafter(DFlashConfig(**kw), *head, attention="sdpa").eval()


def _prompts(tokenizer, n: int) -> list[torch.Tensor]:
    from extract.builtin_text import builtin_prompts

    out = []
    for text in builtin_prompts(n):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
        out.append(torch.tensor([ids]))
    return out


def _greedy(model, ids: torch.Tensor, max_new_tokens: int, eos: int) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_spec_generate_is_the_teachers_greedy_output(tmp_path, teacher, dtype):
    from extract.tiny import TINY_EOS_TOKEN_ID

    model, tokenizer = teacher
    src = _export(_teacher_drafter(model), tmp_path / "src")
    assert cli_main([str(src), "--out", str(tmp_path / "export"), "--dtype", dtype]) == 0
    draft = AutoModel.from_pretrained(str(tmp_path / "export"), trust_remote_code=True, dtype="auto").eval()
    assert draft.dtype == getattr(torch, dtype)
    for ids in _prompts(tokenizer, 3):
        want = _greedy(model, ids, 40, TINY_EOS_TOKEN_ID)
        got = draft.spec_generate(target=model, input_ids=ids, max_new_tokens=40, stop_token_ids=[TINY_EOS_TOKEN_ID],
                                  temperature=0.0, return_stats=True)
        assert torch.equal(got.output_ids, want)
        produced = 1 + sum(got.acceptance_lengths)  # the prefill's token + every cycle's
        if TINY_EOS_TOKEN_ID not in want[0, ids.shape[1]:]:
            assert got.num_output_tokens == 40 and produced > 40  # cycles run until the budget is passed
        assert torch.equal(draft.spec_generate(model, ids, 40, [TINY_EOS_TOKEN_ID], 0.0), want)  # positional


@pytest.mark.parametrize("wrong_at", [None, 1, 0])
def test_spec_generate_keeps_accepted_drafts_and_counts_cycles(tmp_path, teacher, wrong_at):
    """An oracle drafter (the teacher's own continuation, wrong at ``wrong_at`` of every block) gets
    exactly the acceptance lengths it earns, and the output stays the teacher's greedy output."""
    model, tokenizer = teacher
    B, new = 4, 14
    draft = _load(_export(_teacher_drafter(model, block_size=B), tmp_path / "e"))
    ids = _prompts(tokenizer, 1)[0]
    P = ids.shape[1]
    # [P + new + B]: an eos that never comes; the last cycle may draft past the budget
    full = _greedy(model, ids, new + B, eos=model.config.vocab_size)[0]
    starts: list[int] = []
    forward = draft.forward

    def spy(*args, **kwargs):  # records the block's position: the last B positions
        starts.append(int(kwargs["position_ids"][0, -B]))
        return forward(*args, **kwargs)

    class OracleHead(torch.nn.Module):
        """Logits whose argmax is the teacher's continuation of the block (one row wrong)."""

        def __init__(self):
            super().__init__()
            self.weight = model.get_output_embeddings().weight  # its dtype is what spec_generate reads

        def forward(self, hidden):  # [1, B-1, H] -> [1, B-1, V]
            s = starts[-1]
            tokens = torch.cat([full, full.new_zeros(B)])[s + 1:s + B].clone()
            if wrong_at is not None:
                tokens[wrong_at] = (tokens[wrong_at] + 1) % model.config.vocab_size
            return torch.nn.functional.one_hot(tokens, model.config.vocab_size).float().unsqueeze(0)

    oracle = OracleHead()
    draft.forward = spy
    model.get_output_embeddings = lambda: oracle  # the drafter's head; the teacher's forward uses lm_head
    try:
        got = draft.spec_generate(model, ids, new, None, 0.0, return_stats=True)
    finally:
        del model.get_output_embeddings
    assert torch.equal(got.output_ids[0], full[:P + new])
    per_cycle = B if wrong_at is None else wrong_at + 1
    # the prefill produced the first new token; cycles run until more than ``new`` tokens exist, the last
    # one counted in full (the reference's convention)
    assert got.acceptance_lengths == [per_cycle] * ((new - 1) // per_cycle + 1)
    assert starts == [P + i * per_cycle for i in range(len(got.acceptance_lengths))]
    assert got.tau == per_cycle


@pytest.mark.parametrize("nth", [0, 5])
def test_spec_generate_stops_after_the_first_stop_token(tmp_path, teacher, nth):
    model, tokenizer = teacher
    draft = _load(_export(_teacher_drafter(model), tmp_path / "e"))
    ids = _prompts(tokenizer, 1)[0]
    full = _greedy(model, ids, 20, eos=model.config.vocab_size)[0]
    stop = int(full[ids.shape[1] + nth])  # the (nth+1)-th generated token (0: the prefill's)
    first = ids.shape[1] + int((full[ids.shape[1]:] == stop).nonzero()[0, 0])
    got = draft.spec_generate(model, ids, 20, [stop], 0.0)
    assert torch.equal(got[0], full[:first + 1])


def _doc_snippet(heading: str) -> str:
    """The first ```python block after ``heading`` in docs/serving.md."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    rest = text[text.index(heading):]
    return rest[rest.index("```python\n") + len("```python\n"):rest.index("\n```", rest.index("```python\n"))]


def test_the_serving_doc_snippet_runs_as_written_on_the_tiny_teacher(tmp_path, teacher, tiny_teacher_dir, capsys):
    # docs/serving.md's transformers snippet, only its paths and device swapped for the demo's tiny teacher
    # (built by `make demo` into runs/demo/teacher's place: extract.tiny.build_tiny_teacher); the rest verbatim,
    # apply_chat_template(..., return_tensors="pt") returning a BatchEncoding included
    model, tokenizer = teacher
    export_dir = _export(_teacher_drafter(model), tmp_path / "e")
    code = _doc_snippet("## transformers")
    for old, new in (('"drafters/qwen3-8b-dflash"', repr(str(export_dir))), ('"Qwen/Qwen3-8B"', repr(str(tiny_teacher_dir))),
                     ('"cuda:0"', '"cpu"'), ("max_new_tokens=2048", "max_new_tokens=24")):
        assert old in code, f"docs/serving.md's snippet no longer contains {old}: update this test"
        code = code.replace(old, new)
    ns: dict = {}
    exec(compile(code, "docs/serving.md", "exec"), ns)  # noqa: S102 - the documented snippet itself
    ids = ns["input_ids"]["input_ids"]
    want = _greedy(model, ids, 24, eos=tokenizer.eos_token_id)
    assert torch.equal(ns["output"][0], want[0][:ns["output"].shape[1]])
    assert capsys.readouterr().out.strip() == tokenizer.decode(ns["output"][0]).strip()


def test_spec_generate_rejects_a_prompt_it_cannot_read(tmp_path, teacher):
    model, _ = teacher
    draft = _load(_export(_teacher_drafter(model), tmp_path / "e"))
    with pytest.raises(TypeError, match="tensor of token ids"):
        draft.spec_generate(model, [[1, 2, 3]], 4)


def test_a_stop_token_first_runs_the_first_cycle_like_eval_live(tmp_path, teacher, monkeypatch):
    """The prefill's token is a stop token: spec_generate still runs and counts the first cycle in full, as
    ``eval --live`` and the reference (44947fb) do. Both drafters propose the teacher's own continuation, so that
    cycle keeps every draft: [B], not [1]."""
    from train.tools import evaluate

    model, tokenizer = teacher
    B = 4
    trained = _teacher_drafter(model, block_size=B)
    draft = _load(_export(trained, tmp_path / "e"))
    ids = _prompts(tokenizer, 1)[0]
    P = ids.shape[1]
    full = _greedy(model, ids, 3 * B, eos=model.config.vocab_size)[0]  # never stops
    stop = int(full[P])  # the prefill's token

    class OracleHead(torch.nn.Module):  # the drafter's head: the teacher's continuation of the first block
        def __init__(self):
            super().__init__()
            self.weight = model.get_output_embeddings().weight

        def forward(self, hidden):  # [1, B-1, H] -> [1, B-1, V]
            return torch.nn.functional.one_hot(full[P + 1:P + B], model.config.vocab_size).float().unsqueeze(0)

    oracle = OracleHead()
    model.get_output_embeddings = lambda: oracle
    try:
        got = draft.spec_generate(model, ids, 20, [stop], 0.0, return_stats=True)
    finally:
        del model.get_output_embeddings
    monkeypatch.setattr(evaluate, "propose", lambda _m, feats, _last: full[feats.shape[0] + 1:feats.shape[0] + B].tolist())
    live = evaluate.speculative_decode(trained, model, ids[0].tolist(), 20, {stop}, [1, 2, 3])
    assert got.output_ids.shape[1] == P + 1 and live.generated == [stop]
    assert got.acceptance_lengths == live.accepted_per_cycle == [B] and got.tau == live.tau == B


def test_no_token_budget_is_refused_by_spec_generate_and_eval_live(tmp_path, teacher):
    from train.tools.evaluate import live_eval

    model, tokenizer = teacher
    trained = _teacher_drafter(model)
    draft = _load(_export(trained, tmp_path / "e"))
    ids = _prompts(tokenizer, 1)[0]
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        draft.spec_generate(model, ids, 0, None, 0.0, return_stats=True)
    with pytest.raises(ConfigError, match="max_new_tokens must be >= 1"):
        live_eval(trained, model, [ids[0].tolist()], max_new_tokens=0, eos=set(), layer_ids=[1, 2, 3])
