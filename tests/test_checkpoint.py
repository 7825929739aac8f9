"""Checkpointer: layout, round trip, snapshot isolation, keep-last-K, torn checkpoints skipped."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch

from train.components.checkpoint import (
    MANIFEST_FILE,
    Checkpointer,
    CheckpointError,
    find_latest,
    read_checkpoint,
    read_checkpoint_model,
    validate_checkpoint,
)
from train.config import CheckpointConfig


def _model_and_opt(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    loss = model(torch.randn(3, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    return model, opt


def _state(opt):
    return {
        "step": 7,
        "optimizer": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        "guard": {"losses": [1.0, 2.0], "grad_norms": [0.5]},
        "loader": {"epoch": 1, "index": 3},
    }


def test_save_layout_and_round_trip(tmp_path):
    model, opt = _model_and_opt()
    ck = Checkpointer(tmp_path, CheckpointConfig(keep_last=2), config={"train": {"lr": 1.0}}, cache_fingerprint="abc")
    state = _state(opt)
    stats = ck.save(7, model.state_dict(), state)
    ck.close()
    assert stats.blocking_ms >= 0
    path = tmp_path / "checkpoints" / "step-00000007"
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json", "manifest.json", "model.safetensors", "state.json", "state.safetensors"
    ]
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert manifest["step"] == 7 and manifest["cache_fingerprint"] == "abc"
    assert set(manifest["files"]) == {"config.json", "model.safetensors", "state.json", "state.safetensors"}
    assert find_latest(tmp_path) == path

    sd, cfg, man = read_checkpoint_model(path)
    assert cfg == {"train": {"lr": 1.0}} and man["step"] == 7
    for k, v in model.state_dict().items():
        assert torch.equal(sd[k], v)

    loaded = read_checkpoint(path)
    model2, opt2 = _model_and_opt(seed=1)
    opt2.load_state_dict(loaded.state["optimizer"])
    for (_, a), (_, b) in zip(opt.state_dict()["state"].items(), opt2.state_dict()["state"].items(), strict=True):
        for k in a:
            assert torch.equal(a[k], b[k])
    assert opt2.state_dict()["param_groups"][0]["betas"] == (0.9, 0.95)
    rng = loaded.state["rng"]
    assert torch.equal(rng["torch"], state["rng"]["torch"])
    random.setstate(rng["python"])  # tuples survive the JSON round trip
    assert random.getstate() == state["rng"]["python"]
    np.random.set_state(rng["numpy"])
    assert np.array_equal(np.random.get_state()[1], state["rng"]["numpy"][1])
    assert loaded.state["loader"] == {"epoch": 1, "index": 3}


def test_snapshot_not_affected_by_next_step(tmp_path):
    model, opt = _model_and_opt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    ck = Checkpointer(tmp_path, CheckpointConfig(), cache_fingerprint=None)
    ck.save(1, model.state_dict(), {"optimizer": opt.state_dict()})
    # mutate everything in place right after save() returned, while the write may be in flight
    with torch.no_grad():
        for p in model.parameters():
            p.add_(100.0)
    for s in opt.state.values():
        s["exp_avg"].add_(5.0)
    ck.close()
    loaded = read_checkpoint(find_latest(tmp_path))
    for k, v in before.items():
        assert torch.equal(loaded.model[k], v)
    saved_state = loaded.state["optimizer"]["state"]
    for i, s in moments.items():
        assert torch.equal(saved_state[i]["exp_avg"], s["exp_avg"])


def test_keep_last_and_leftovers(tmp_path):
    model, opt = _model_and_opt()
    ck = Checkpointer(tmp_path, CheckpointConfig(keep_last=2))
    for step in (10, 20, 30):
        ck.save(step, model.state_dict(), {"step": step})
    ck.close()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000020", "step-00000030"]
    (tmp_path / "checkpoints" / "step-00000040.tmp").mkdir()
    Checkpointer(tmp_path, CheckpointConfig(keep_last=2)).close()
    assert not (tmp_path / "checkpoints" / "step-00000040.tmp").exists()


def test_torn_and_corrupt_checkpoints_are_skipped(tmp_path):
    model, _ = _model_and_opt()
    ck = Checkpointer(tmp_path, CheckpointConfig(keep_last=3))
    for step in (1, 2, 3):
        ck.save(step, model.state_dict(), {"step": step})
    ck.close()
    root = tmp_path / "checkpoints"
    (root / "step-00000003" / MANIFEST_FILE).unlink()  # as if renamed without a manifest
    data = bytearray((root / "step-00000002" / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (root / "step-00000002" / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="crc32c"):
        validate_checkpoint(root / "step-00000002")
    assert find_latest(tmp_path) == root / "step-00000001"
    assert ck.load_latest().step == 1


def test_non_writer_rank_writes_nothing(tmp_path):
    model, _ = _model_and_opt()
    ck = Checkpointer(tmp_path, CheckpointConfig(), is_writer=False)
    ck.save(5, model.state_dict(), {"step": 5})
    ck.close()
    assert not (tmp_path / "checkpoints").exists()


def test_background_failure_surfaces(tmp_path):
    model, _ = _model_and_opt()
    ck = Checkpointer(tmp_path, CheckpointConfig())
    ck.save(1, model.state_dict(), {"step": 1})
    ck.wait()
    shutil.rmtree(tmp_path / "checkpoints")
    (tmp_path / "checkpoints").write_text("not a directory")  # the next write cannot create its tmp dir
    ck.save(2, model.state_dict(), {"step": 2})
    with pytest.raises(CheckpointError, match="step 2"):
        ck.wait()
