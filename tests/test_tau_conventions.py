"""The two live tau conventions: the reference 44947fb's (``eval --live``'s ``tau``, ``spec_generate``'s) and the
``dflash`` 0.1.0 package's, which the published model cards quote (``eval --live --card-tau``).

The expected card counts below are worked out by hand from the package's ``dflash_generate`` rules (the prefill
gives the first token; a cycle runs while ``start + 1 < max_length``, i.e. while fewer than ``max_new_tokens``
tokens exist; it adds ``min(accepted + 1, max_length - start - 1)`` tokens, cut after the first stop token; no
cycle runs when the prefill's token stops)."""

from __future__ import annotations

import pytest

from train.cli_args import eval_parser
from train.tools.evaluate import CARD_TAU_CONVENTION, TAU_CONVENTION, card_cycles

STOP = 99


@pytest.mark.parametrize("full,generated,budget,card", [
    # 1 + 4 + 4 = 9 < 10: a third cycle runs and adds 1 (the budget's last token); 44947fb counts it as 4
    ([4, 4, 4], list(range(10)), 10, [4, 4, 1]),
    # 1 + 4 + 4 = 9 = the budget: the package runs no third cycle, 44947fb does (one cycle earlier)
    ([4, 4, 4], list(range(9)), 9, [4, 4]),
    # 1 + 4 + 3 = 8 = the budget
    ([4, 3, 4], list(range(8)), 8, [4, 3]),
    # the stop token is the 4th generated token: after 1 + 2 tokens the second cycle adds 1 (the stop), not 4
    ([2, 4], [0, 1, 2, STOP], 10, [2, 1]),
    # the prefill's token stops: no cycle at all (the prompt is left out of the card mean)
    ([4], [STOP], 10, []),
    # a budget of one token: the prefill fills it
    ([4], [0], 1, []),
    # whole cycles inside the budget count the same in both conventions
    ([3, 2, 1, 4], list(range(20)), 20, [3, 2, 1, 4]),
])
def test_card_cycles_clip_the_last_cycle_and_stop_one_cycle_earlier(full, generated, budget, card):
    assert card_cycles(full, generated, budget, {STOP}) == card


def test_both_conventions_are_named_and_the_flag_parses():
    assert "44947fb" in TAU_CONVENTION
    assert "0.1.0" in CARD_TAU_CONVENTION
    args = eval_parser().parse_args(["c.toml", "--cache", "x", "--checkpoint", "y", "--live", "--card-tau"])
    assert args.card_tau is True
    assert eval_parser().parse_args(["c.toml", "--cache", "x", "--checkpoint", "y"]).card_tau is False
