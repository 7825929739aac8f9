"""The training plan: exactly-once, equal batch counts, budgets, determinism, errors."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from dflash_cache.errors import ConfigError, DataError
from train.data.plan import (
    Planner,
    PlanSettings,
    build_plan,
    holdout_mask,
    plan_from_index,
    splitmix64,
    stable_hash,
)

EDGES = [256, 512, 1024, 2048]
BLOCKS = {"num_anchors": 512, "block_size": 16, "max_block_positions": 65536}  # the default budget


def _index(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.8, 0.9, n).astype(np.int64), 50, 3000)
    ids = rng.permutation(50 * n)[:n].astype(np.int64)
    buckets = np.searchsorted(EDGES, lengths, side="left")
    return ids, lengths, buckets


def _all_ranks(ids, lengths, buckets, s: PlanSettings, epoch: int):
    return [build_plan(ids, lengths, buckets, s, epoch=epoch, rank=r) for r in range(s.world_size)]


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_sample_exactly_once_per_epoch(world: int, packing: bool) -> None:
    ids, lengths, buckets = _index(3001)
    s = PlanSettings(**BLOCKS, seed=7, world_size=world, tokens_per_batch=8192, packing=packing,
                     row_tokens=4096 if packing else None, sort_window=8, holdout_fraction=0.05)
    held = holdout_mask(ids, 0.05)
    expected = np.sort(ids[~held])
    orders = []
    for epoch in range(3):
        plans = _all_ranks(ids, lengths, buckets, s, epoch)
        assert len({len(p) for p in plans}) == 1, "ranks must get the same number of batches"
        got = np.concatenate([ids[b.positions] for p in plans for b in p.batches])
        np.testing.assert_array_equal(np.sort(got), expected)
        for p in plans:
            assert [b.index for b in p.batches] == list(range(len(p)))
            for b in p.batches:
                assert b.num_rows * b.seq_len <= s.tokens_per_batch
                assert len(set(buckets[b.positions].tolist())) == 1 and buckets[b.positions[0]] == b.bucket
                fills = [int(lengths[r].sum()) for r in b.rows()]
                assert max(fills) == b.seq_len and sum(fills) == b.n_tokens
                if not packing:
                    assert b.num_rows == len(b.positions)
        orders.append(got)
    assert not np.array_equal(orders[0], orders[1]), "epochs must be shuffled differently"


def test_remainder_batches_are_split_not_dropped() -> None:
    ids, lengths, buckets = _index(500, seed=3)
    for world in (2, 3, 5, 7):
        s = PlanSettings(**BLOCKS, seed=1, world_size=world, tokens_per_batch=4096)
        plans = _all_ranks(ids, lengths, buckets, s, 0)
        one = build_plan(ids, lengths, buckets, PlanSettings(**BLOCKS, seed=1, tokens_per_batch=4096), epoch=0)
        assert plans[0].stats.n_batches == len(one) + plans[0].stats.n_split
        assert plans[0].stats.n_batches % world == 0
        assert sum(len(b.positions) for p in plans for b in p.batches) == 500


def test_plan_is_independent_of_index_order_and_deterministic() -> None:
    ids, lengths, buckets = _index(2000)
    s = PlanSettings(**BLOCKS, seed=5, tokens_per_batch=8192)
    a = build_plan(ids, lengths, buckets, s, epoch=2)
    perm = np.random.default_rng(9).permutation(len(ids))
    b = build_plan(ids[perm], lengths[perm], buckets[perm], s, epoch=2)
    assert a.identity == b.identity
    assert [ids[x.positions].tolist() for x in a.batches] == [ids[perm][x.positions].tolist() for x in b.batches]
    assert [x.seed for x in a.batches] == [x.seed for x in b.batches]
    assert build_plan(ids, lengths, buckets, s, epoch=3).identity != a.identity


_CHILD = """
import hashlib, numpy as np
from tests.test_plan import BLOCKS, _index
from train.data.plan import PlanSettings, build_plan
ids, lengths, buckets = _index(4000)
p = build_plan(ids, lengths, buckets, PlanSettings(**BLOCKS, seed=11, world_size=2, tokens_per_batch=8192,
               packing=True, row_tokens=4096, holdout_fraction=0.1), epoch=1, rank=1)
h = hashlib.sha256()
for b in p.batches:
    h.update(ids[b.positions].tobytes()); h.update(b.row_splits.tobytes()); h.update(str(b.seed).encode())
print(p.identity, h.hexdigest())
"""


def test_plan_is_identical_across_processes() -> None:
    outs = {subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout for seed in (1, 2)}
    assert len(outs) == 1 and len(outs.pop().split()) == 2


def test_padding_is_small_and_buckets_are_spread_over_the_epoch() -> None:
    ids, lengths, buckets = _index(20000)
    plan = build_plan(ids, lengths, buckets, PlanSettings(**BLOCKS, seed=0, tokens_per_batch=16384), epoch=0)
    assert plan.stats.padding_fraction < 0.02
    order = np.array([b.bucket for b in plan.batches])
    n = len(order)
    for b in np.unique(order):
        where = np.flatnonzero(order == b)
        expected_gap = n / len(where)
        assert np.diff(where).max() <= expected_gap + 2.5, f"bucket {b} is clumped"


def test_packed_rows_have_no_padding_beyond_row_tails() -> None:
    ids, lengths, buckets = _index(5000)
    s = PlanSettings(**BLOCKS, seed=0, tokens_per_batch=16384, packing=True, row_tokens=4096)
    plan = build_plan(ids, lengths, buckets, s, epoch=0)
    assert plan.stats.padding_fraction < 0.02
    assert all(b.num_rows <= 4 for b in plan.batches)


def test_errors_and_edge_cases() -> None:
    ids, lengths, buckets = _index(300)
    with pytest.raises(ConfigError, match="tokens_per_batch"):
        build_plan(ids, lengths, buckets, PlanSettings(**BLOCKS, seed=0, tokens_per_batch=int(lengths.max()) - 1), epoch=0)
    with pytest.raises(ConfigError, match="pack_row_tokens"):
        build_plan(ids, lengths, buckets, PlanSettings(**BLOCKS, seed=0, tokens_per_batch=8192, packing=True, row_tokens=100),
                   epoch=0)
    with pytest.raises(DataError, match="4 ranks"):
        build_plan(ids[:3], lengths[:3], buckets[:3], PlanSettings(**BLOCKS, seed=0, world_size=4, tokens_per_batch=4096),
                   epoch=0)
    with pytest.raises(DataError, match="0 training samples"):
        build_plan(ids[:0], lengths[:0], buckets[:0], PlanSettings(**BLOCKS, seed=0), epoch=0)
    with pytest.raises(DataError, match="duplicate"):
        build_plan(np.r_[ids, ids[:1]], np.r_[lengths, lengths[:1]], np.r_[buckets, buckets[:1]],
                   PlanSettings(**BLOCKS, seed=0, tokens_per_batch=4096), epoch=0)
    # a bucket with no sample contributes no batch
    keep = buckets != 1
    plan = build_plan(ids[keep], lengths[keep], buckets[keep], PlanSettings(**BLOCKS, seed=0, tokens_per_batch=4096), epoch=0)
    assert 1 not in plan.stats.batches_per_bucket and len(plan.stats.batches_per_bucket) == len(set(buckets[keep]))


def test_hashes_are_stable_and_holdout_fraction_is_respected() -> None:
    assert int(splitmix64(np.array([0]))[0]) == 0xE220A8397B1DCDAF  # the reference splitmix64 output
    assert stable_hash(1, 2, 3) == stable_hash(1, 2, 3) != stable_hash(1, 2, 4)
    assert 0 <= stable_hash(2**63, -1) < 2**63
    ids = np.arange(200_000, dtype=np.int64)
    assert abs(holdout_mask(ids, 0.1).mean() - 0.1) < 0.005
    assert not holdout_mask(ids, 0.0).any()
    np.testing.assert_array_equal(holdout_mask(ids[:100], 0.3), holdout_mask(ids, 0.3)[:100])


@pytest.mark.parametrize("packing", [False, True])
def test_block_position_budget_bounds_every_batch(packing: bool) -> None:
    ids, lengths, buckets = _index(4000, seed=2)
    kw = dict(seed=3, num_anchors=64, block_size=8, world_size=2, tokens_per_batch=8192, packing=packing,
              row_tokens=4096 if packing else None, sort_window=8)
    budget = 12_000  # binds: a full 8192-token batch of short documents holds up to ~30 x 63 x 8 block positions
    bound = np.minimum(64, lengths - 1) * 8
    plans = _all_ranks(ids, lengths, buckets, PlanSettings(**kw, max_block_positions=budget), 0)
    per_batch = []
    for p in plans:
        for b in p.batches:
            assert b.block_positions == int(bound[b.positions].sum()) <= budget
            assert b.num_rows * b.seq_len <= 8192
            per_batch.append(b.block_positions)
    np.testing.assert_array_equal(np.sort(np.concatenate([ids[b.positions] for p in plans for b in p.batches])),
                                  np.sort(ids))
    st = plans[0].stats
    assert (st.block_positions, st.block_positions_max) == (sum(per_batch), max(per_batch))
    assert st.block_positions_median == float(np.median(per_batch))
    free = _all_ranks(ids, lengths, buckets, PlanSettings(**kw), 0)[0].stats  # no block budget: the old plan
    assert free.block_positions_max > budget and free.n_batches < st.n_batches
    assert free.block_positions == st.block_positions == int(bound.sum())


def test_vectorised_cut_equals_the_greedy_loop() -> None:
    from train.data.plan import _cut_starts, _padded_token_end

    rng = np.random.default_rng(4)
    for trial in range(40):
        tpb, budget = int(rng.integers(3000, 9000)), [None, int(rng.integers(3000, 20000))][trial % 2]
        sizes = rng.integers(1, 60, size=int(rng.integers(1, 6)))
        wid = np.repeat(np.arange(len(sizes)), sizes)
        lens = np.concatenate([np.sort(rng.integers(1, 3000, n)) for n in sizes])
        bp = np.minimum(rng.integers(1, 400), lens - 1) * 8
        got = _cut_starts(_padded_token_end(lens, wid, tpb), bp, budget).tolist()
        expected, start = [0], 0  # a batch closes before a sample that breaks a budget or starts a new window
        for j in range(1, len(lens)):
            if (wid[j] != wid[start] or (j - start + 1) * lens[j] > tpb
                    or (budget is not None and bp[start:j + 1].sum() > budget)):
                expected.append(j)
                start = j
        assert got == expected, trial


def test_a_document_over_the_block_budget_is_a_config_error() -> None:
    ids, lengths, buckets = _index(300)
    longest = int(lengths.max())
    s = PlanSettings(seed=0, num_anchors=512, block_size=16, tokens_per_batch=4096, max_block_positions=4096)
    with pytest.raises(ConfigError, match="loader.max_block_positions") as err:
        build_plan(ids, lengths, buckets, s, epoch=0)
    need = min(512, longest - 1) * 16
    for words in ("train.num_anchors=512", "model.block_size=16", f"loader.max_block_positions >= {need}"):
        assert words in str(err.value)


@pytest.mark.parametrize("packing", [False, True])
def test_plan_equals_the_plan_built_again(packing: bool) -> None:
    ids, lengths, buckets = _index(3000, seed=5)
    s = PlanSettings(**BLOCKS, seed=2, world_size=2, tokens_per_batch=8192, packing=packing,
                     row_tokens=4096 if packing else None, holdout_fraction=0.1)
    planner = Planner(ids, lengths, buckets, s)  # one planner, several epochs (what the loader does)
    for epoch in range(3):
        a = planner.plan(epoch, rank=1, first_index=4)
        b = build_plan(ids.copy(), lengths.copy(), buckets.copy(), s, epoch=epoch, rank=1, first_index=4)
        assert a.identity == b.identity and a.stats == b.stats and len(a) == len(b) > 0
        for col in ("positions", "row_starts", "batch_rows", "bucket", "seq_len", "n_tokens", "block_positions",
                    "seed"):
            np.testing.assert_array_equal(getattr(a, col), getattr(b, col))
        assert [x.seed for x in a.batches] == [stable_hash(2, epoch, x.index, 1) for x in a.batches]
        assert [x.index for x in a.batches] == list(range(4, 4 + len(a)))


def test_plan_from_index_is_the_plan_of_the_loader_settings() -> None:
    from types import SimpleNamespace

    from train.config import LoaderConfig

    ids, lengths, buckets = _index(2000)
    cfg = LoaderConfig(tokens_per_batch=8192, max_block_positions=32768, holdout_fraction=0.05)
    got = plan_from_index(SimpleNamespace(sample_ids=ids, lengths=lengths, buckets=buckets), cfg, seed=1,
                          num_anchors=256, block_size=16, world_size=2, epoch=1)
    s = PlanSettings(seed=1, num_anchors=256, block_size=16, world_size=2, tokens_per_batch=8192,
                     max_block_positions=32768, holdout_fraction=0.05)
    assert got.identity == build_plan(ids, lengths, buckets, s, epoch=1).identity
    unbounded = build_plan(ids, lengths, buckets, dataclasses.replace(s, max_block_positions=None), epoch=1)
    assert got.stats.block_positions_max <= 32768 < unbounded.stats.block_positions_max
