"""Top-p and top-k in the shipped ``dflash.py``: its ``warp_probs`` gives exactly the distribution worked out by
hand here (temperature, then top-k, then the smallest prefix of the sorted tokens whose mass reaches top-p --
the token that crosses top-p is kept) and agrees with transformers' own warpers; and ``spec_generate`` with
``top_p < 1`` and ``top_k > 0`` samples the teacher's distribution under the same settings (chi-square)."""

from __future__ import annotations

import pytest
import test_sampling
import torch
from test_sampling import LAYERS, _shipped_module, chi_square_pvalue, exact_distribution

import train.tools.evaluate as ev
from train.tools.sampling import SamplingParams

tiny_teacher, prompt = test_sampling.tiny_teacher, test_sampling.prompt

# probabilities 0.4, 0.3, 0.2, 0.1 at the shuffled token ids 2, 0, 3, 1 (and a second row, reversed)
P = torch.tensor([[0.3, 0.1, 0.4, 0.2], [0.2, 0.4, 0.1, 0.3]])
LOGITS = P.log()


def _hand(row: list[float]) -> torch.Tensor:
    t = torch.tensor(row)
    return t / t.sum()


@pytest.mark.parametrize(("temperature", "top_p", "top_k", "want"), [
    (1.0, 1.0, 0, [P[0].tolist(), P[1].tolist()]),
    (1.0, 0.3, 0, [[0, 0, 1, 0], [0, 1, 0, 0]]),  # the first token already reaches 0.3: only it stays
    (1.0, 0.65, 0, [_hand([0.3, 0, 0.4, 0]).tolist(), _hand([0, 0.4, 0, 0.3]).tolist()]),  # 0.4 < 0.65 <= 0.7
    (1.0, 0.71, 0, [_hand([0.3, 0, 0.4, 0.2]).tolist(), _hand([0.2, 0.4, 0, 0.3]).tolist()]),  # 0.7 < 0.71
    (1.0, 1.0, 2, [_hand([0.3, 0, 0.4, 0]).tolist(), _hand([0, 0.4, 0, 0.3]).tolist()]),
    (1.0, 1.0, 3, [_hand([0.3, 0, 0.4, 0.2]).tolist(), _hand([0.2, 0.4, 0, 0.3]).tolist()]),
    # top-k 3 first (0.4, 0.3, 0.2 renormalised: cumulative 0.444, 0.778, 1), then top-p 0.75: two stay
    (1.0, 0.75, 3, [_hand([0.3, 0, 0.4, 0]).tolist(), _hand([0, 0.4, 0, 0.3]).tolist()]),
    (1.0, 0.8, 3, [_hand([0.3, 0, 0.4, 0.2]).tolist(), _hand([0.2, 0.4, 0, 0.3]).tolist()]),
    # temperature 0.5 squares the probabilities (0.16, 0.09, 0.04, 0.01 over 0.30: cumulative 0.533, 0.833 ...)
    (0.5, 0.8, 0, [_hand([0.09, 0, 0.16, 0]).tolist(), _hand([0, 0.16, 0, 0.09]).tolist()]),
    (0.5, 0.85, 0, [_hand([0.09, 0, 0.16, 0.04]).tolist(), _hand([0.04, 0.16, 0, 0.09]).tolist()]),
])
def test_shipped_warp_probs_is_the_distribution_worked_out_by_hand(temperature, top_p, top_k, want):
    got = _shipped_module().warp_probs(LOGITS, temperature, top_p, top_k)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1e-5, atol=1e-6)


def test_shipped_warp_probs_agrees_with_transformers_warpers():
    """Over random logits and settings: transformers' TemperatureLogitsWarper, TopKLogitsWarper and
    TopPLogitsWarper, applied in generate()'s order, then softmax."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    warp = _shipped_module().warp_probs
    for _ in range(50):
        logits = torch.randn(3, 40, generator=g) * 3
        temperature = float(torch.rand((), generator=g)) * 1.5 + 0.3
        top_k = int(torch.randint(0, 12, (), generator=g))
        top_p = float(torch.rand((), generator=g)) * 0.9 + 0.05
        z = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            z = TopKLogitsWarper(top_k)(None, z)
        want = TopPLogitsWarper(top_p)(None, z).softmax(-1)
        torch.testing.assert_close(warp(logits, temperature, top_p, top_k), want, rtol=1e-5, atol=1e-6,
                                   msg=f"T={temperature} top_p={top_p} top_k={top_k}")


def test_shipped_spec_generate_with_top_p_and_top_k_samples_the_teachers_distribution(tmp_path, tiny_teacher,
                                                                                     prompt):
    """The exported drafter's ``spec_generate`` at T=1, top-k 6 and a top-p that cuts inside the top-k set at the
    first token (so the token crossing it decides the support): the first two new tokens of 200 decodings follow
    the teacher's exact distribution under the same settings (the first from the prefill, the second through a
    drafted block's verification)."""
    from test_export_hf import _export, _load, _teacher_drafter

    teacher, _ = tiny_teacher
    draft = _load(_export(_teacher_drafter(teacher), tmp_path / "export"))
    first = torch.softmax(ev._teacher_logits_step(teacher, prompt, LAYERS)[1][-1], -1).topk(6).values
    first = first / first.sum()
    c = first.cumsum(0)
    top_p = float(c[1] + c[2]) / 2  # three tokens reach it, two do not: the third (the crossing one) is kept
    params = SamplingParams(1.0, top_p=top_p, top_k=6)
    want = exact_distribution(ev._teacher_logits_step, teacher, prompt, params, 2)
    assert len({k[0] for k in want}) == 3  # the cut at the first token: three of the six
    ids = torch.tensor([prompt])
    gen = torch.Generator().manual_seed(21)
    counts: dict[tuple, int] = {}
    n = 200
    for _ in range(n):
        out = draft.spec_generate(teacher, ids, 2, None, 1.0, top_p=top_p, top_k=6, generator=gen)
        key = tuple(out[0, len(prompt):].tolist())
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_pvalue(counts, want, n) > 1e-3
