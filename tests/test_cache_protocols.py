"""The interfaces the stages use of the cache (dflash_cache/protocols.py) are what the cache implements: every
member exists on FeatureCache / PartWriter with the same parameters, real objects pass the runtime checks, and
the module stays import-light."""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Protocol

import pytest

from dflash_cache import open_cache
from dflash_cache.protocols import CacheView, PartSink, ReadableCache, WritableCache
from dflash_cache.store import FeatureCache
from dflash_cache.synthetic import make_synthetic_cache
from dflash_cache.writer import PartWriter

IMPLEMENTATIONS = [(CacheView, FeatureCache), (ReadableCache, FeatureCache), (WritableCache, FeatureCache),
                   (PartSink, PartWriter)]


def _members(proto: type) -> tuple[dict[str, object], set[str]]:
    """``(methods and properties, data attributes)`` a protocol declares, its parent protocols' included."""
    methods: dict[str, object] = {}
    data: set[str] = set()
    for cls in reversed(proto.__mro__):
        if cls in (object, Protocol) or not getattr(cls, "_is_protocol", False):
            continue
        data |= set(cls.__dict__.get("__annotations__", {}))
        methods.update({k: v for k, v in cls.__dict__.items()
                        if not k.startswith("_") and (callable(v) or isinstance(v, property))})
    return methods, data


def _params(member: object) -> list[tuple[str, object, object]]:
    fn = member.fget if isinstance(member, property) else member
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def mismatches(proto: type, impl: type) -> list[str]:
    """Members of ``proto`` that ``impl`` lacks or declares with other parameters."""
    methods, _ = _members(proto)
    out = []
    for name, member in methods.items():
        have = getattr(impl, name, None)
        if have is None:
            out.append(f"{impl.__name__} has no {name}")
        elif isinstance(member, property) != isinstance(have, property):
            out.append(f"{impl.__name__}.{name}: property in one, method in the other")
        elif _params(member) != _params(have):
            out.append(f"{impl.__name__}.{name}{inspect.signature(have.fget if isinstance(have, property) else have)}"
                       f" differs from the protocol's")
    return out


@pytest.mark.parametrize("proto,impl", IMPLEMENTATIONS, ids=[p.__name__ for p, _ in IMPLEMENTATIONS])
def test_the_cache_implements_each_protocol_member_for_member(proto, impl):
    assert _members(proto)[0], proto
    assert mismatches(proto, impl) == []


def test_the_check_catches_a_drifted_implementation():
    class Drifted:
        def add(self, sample_id, ids, loss_mask, features, target_argmax=None): ...  # renamed parameter

        def commit(self): ...

    assert mismatches(PartSink, Drifted) == [
        "Drifted.add(self, sample_id, ids, loss_mask, features, target_argmax=None) differs from the protocol's",
        "Drifted has no abort"]


def test_a_real_cache_and_part_writer_pass_the_runtime_checks(tmp_path):
    url = str(tmp_path / "cache")
    make_synthetic_cache(url, n_samples=8, hidden_size=16, num_layers=4, target_layer_ids=(1, 2), vocab_size=64,
                         max_length=64, median_length=24, bucket_edges=(32,))
    cache = open_cache(url)
    assert isinstance(cache, ReadableCache) and isinstance(cache, WritableCache)
    for attr in _members(ReadableCache)[1]:
        assert hasattr(cache, attr), attr
    writer = cache.part_writer(0, "probe")
    try:
        assert isinstance(writer, PartSink)
    finally:
        writer.abort()
    assert not isinstance(object(), ReadableCache)


def test_importing_the_protocols_loads_no_torch():
    code = "import sys, dflash_cache.protocols; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
