"""``dflash-extract`` through the real command: fresh cache, resume (SIGKILL, disk full, other process
count), 2 gloo processes, bad outputs, fingerprint refusal, regenerate -> extract, estimate."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash_cache import open_cache, verify_cache
from extract.cli import main

ROOT = Path(__file__).resolve().parents[1]
N = 40


def _args(teacher: Path, out: Path, *extra: str, n: int = N) -> list[str]:
    return ["configs/tiny.toml", "--out", str(out), "--no-progress", "--set", f"teacher.path={teacher}",
            "--set", f"data.path=builtin:tiny-chat?n={n}", "--set", "extract.unit_size=8",
            "--set", "extract.tokens_per_batch=1024", *extra]


def _run(teacher, out, *extra, **kw) -> int:
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return main(_args(teacher, out, *extra, **kw))
    finally:
        os.chdir(cwd)


def _subprocess_cmd(teacher, out, nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "extract.cli", *_args(teacher, out)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "extract.cli", *_args(teacher, out)]


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def snapshot(url) -> dict:
    """Everything stored per sample, as bytes, plus each part's sample order."""
    cache = open_cache(str(url))
    idx = cache.index()
    ids = sorted(idx.sample_ids.tolist())
    assert len(ids) == len(set(ids)), "a sample was written twice"
    out = {s.sample_id: (s.input_ids.numpy().tobytes(), s.loss_mask.numpy().tobytes(),
                         s.features.view(torch.int16).numpy().tobytes()) for s in cache.read_samples(ids)}
    return out


@pytest.fixture(scope="module")
def reference(tiny_teacher_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "cache"
    assert _run(tiny_teacher_dir, out) == 0
    return out, snapshot(out)


def test_end_to_end_into_a_fresh_cache(tiny_teacher_dir, reference, capsys):
    out, snap = reference
    report = verify_cache(str(out))
    assert report is not None
    cache = open_cache(str(out))
    assert sorted(snap) == list(range(N))  # the tiny set keeps every sample
    assert cache.spec.target_layer_ids == (1, 2, 3) and cache.spec.teacher.hidden_size == 128
    assert cache.read_metadata("config")["teacher"]["path"] == str(tiny_teacher_dir)
    assert cache.read_metadata("extract_report")["samples_written"] == N
    embed, head = cache.load_head()
    assert embed.shape == (768, 128) and not torch.equal(embed, head)
    assert {p.name for p in cache.parts()} == {f"u{u:07d}" for u in range(N // 8)}
    # stored features are the teacher's layer outputs (bf16) for the sample's own tokens
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_teacher_dir)
    s = cache.read_sample(7)
    with torch.no_grad():
        hs = model(s.input_ids[None], output_hidden_states=True).hidden_states
    want = torch.cat([hs[k + 1][0] for k in (1, 2, 3)], -1).to(torch.bfloat16)
    torch.testing.assert_close(s.features.float(), want.float(), atol=0.05, rtol=0.02)
    # a rerun is a no-op
    capsys.readouterr()
    assert _run(tiny_teacher_dir, out) == 0
    out_text = capsys.readouterr().out
    assert f"units: {N // 8} ({N // 8} already complete," in out_text
    assert f"cache: {N} samples in {N // 8} complete units" in out_text
    assert snapshot(out) == snap


def _complete_units_of(url) -> int:
    """Units all of whose parts (by the unit's own ``unit_parts``) are committed, counted here."""
    by_unit: dict[int, list] = {}
    for p in open_cache(str(url)).parts():
        by_unit.setdefault(int(p.meta["unit"]), []).append(p)
    return sum(len(ps) == int(ps[0].meta["unit_parts"]) for ps in by_unit.values())


def _train_argv(out: Path, run: Path, *extra: str) -> list[str]:
    sets = ["train.max_steps=1", "train.epochs=1", "model.num_hidden_layers=1", "train.num_anchors=8",
            "loader.tokens_per_batch=1024", "metrics.progress_bar=false", "metrics.tensorboard=false", *extra]
    return [str(ROOT / "configs" / "tiny.toml"), "--cache", str(out), "--run-dir", str(run),
            *[a for o in sets for a in ("--set", o)]]


def test_an_unfinished_extraction_is_named_by_info_and_verify_and_refused_by_the_trainer(
        tiny_teacher_dir, reference, tmp_path, capsys):
    """SIGKILL mid-extraction, then gc: verify exits 3 ("extraction not finished: k of 5 units", no damage),
    info says the same, dflash-train refuses it naming the command that finishes it (unless
    loader.allow_unfinished), and the rerun finishes it (verify 0)."""
    from dflash_cache.cli import main as cache_main
    from train.cli import main as train_main

    out = tmp_path / "cache"
    # (each commit widened by the test hook, so that the kill lands between units on a busy machine too)
    proc = subprocess.Popen(_subprocess_cmd(tiny_teacher_dir, out), cwd=ROOT,
                            env={**_env(), "DFLASH_TEST_COMMIT_DELAY_S": "0.5"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while _complete_units_of(out) < 2 if (out / "zarr.json").exists() else True:  # two units committed
        assert proc.poll() is None and time.time() < deadline, "the extraction ended before its second unit"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert cache_main(["gc", str(out)]) == 0
    k = _complete_units_of(out)
    assert 2 <= k < N // 8, "the kill landed after the run finished"
    capsys.readouterr()
    assert cache_main(["verify", str(out)]) == 3
    said = capsys.readouterr()
    assert f"extraction not finished: {k} of {N // 8} units" in said.out and "no damage found" in said.err
    assert cache_main(["info", str(out)]) == 0
    assert f"extraction   extraction not finished: {k} of {N // 8} units" in capsys.readouterr().out
    report = verify_cache(str(out))  # not damage: nothing raised
    assert report.ok and not report.finished and report.extraction.units_complete == k
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert train_main(_train_argv(out, tmp_path / "run")) == 2
        err = capsys.readouterr().err
        assert f"extraction not finished: {k} of {N // 8} units" in err and "rerun the same dflash-extract" in err
        assert "loader.allow_unfinished=true" in err and not (tmp_path / "run" / "metrics.jsonl").exists()
        assert train_main(_train_argv(out, tmp_path / "run2", "loader.allow_unfinished=true")) == 0
    finally:
        os.chdir(cwd)
    assert _run(tiny_teacher_dir, out) == 0
    assert cache_main(["verify", str(out)]) == 0
    assert "extraction finished (5 units)" in capsys.readouterr().out
    assert snapshot(out) == reference[1]


def test_a_rerun_rewrites_a_part_whose_commit_record_names_a_missing_generation(tiny_teacher_dir, reference,
                                                                                tmp_path, capsys):
    """What a late writer left before generations carried their writer's token: a commit record naming a
    generation with no file left. verify names it (exit 2); the rerun reports it and writes the part
    again (never "complete" over it)."""
    import shutil

    out = tmp_path / "cache"
    shutil.copytree(reference[0], out)
    part = next(p for p in open_cache(str(out)).parts() if p.name == "u0000002")
    shutil.rmtree(out / part.data_key)
    with pytest.raises(Exception, match=part.key):
        verify_cache(str(out))
    capsys.readouterr()
    assert _run(tiny_teacher_dir, out) == 0
    said = capsys.readouterr()
    assert f"part {part.key}: its commit record names generation" in said.err
    assert "units: 5 (4 already complete" in said.out
    assert verify_cache(str(out)).ok and snapshot(out) == reference[1]


def test_sigkill_then_resume_is_bitwise_identical(tiny_teacher_dir, reference, tmp_path):
    out = tmp_path / "cache"
    proc = subprocess.Popen(_subprocess_cmd(tiny_teacher_dir, out), cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not list(out.glob("buckets/*/*/lease.*.json")):  # first part started
        assert proc.poll() is None and time.time() < deadline, "the extraction never started a part"
        time.sleep(0.01)
    time.sleep(random.Random(0).uniform(0.0, 0.15))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    n_before = len(open_cache(str(out)).parts())
    assert n_before < len(open_cache(str(reference[0])).parts()), "the kill landed after the run finished"
    assert _run(tiny_teacher_dir, out) == 0
    verify_cache(str(out))
    assert open_cache(str(out)).uncommitted() == []
    assert snapshot(out) == reference[1]


def test_two_gloo_processes_write_disjoint_parts_covering_the_dataset(tiny_teacher_dir, reference, tmp_path):
    out = tmp_path / "cache"
    subprocess.run(_subprocess_cmd(tiny_teacher_dir, out, nproc=2), cwd=ROOT, env=_env(), check=True,
                   capture_output=True, timeout=300)
    cache = open_cache(str(out))
    parts = cache.parts()
    by_rank = {r: {int(p.meta["unit"]) for p in parts if p.meta["rank"] == r} for r in (0, 1)}
    assert by_rank[0] == {0, 2, 4} and by_rank[1] == {1, 3}
    assert all(p.meta["world_size"] == 2 for p in parts)
    snap = snapshot(out)
    assert sorted(snap) == sorted(reference[1])
    for sid, (ids, mask, _feats) in snap.items():
        assert (ids, mask) == reference[1][sid][:2]


def test_disk_full_then_resume_with_two_processes(tiny_teacher_dir, reference, tmp_path, monkeypatch, capsys):
    from dflash_cache import writer as writer_mod

    real_flush, calls = writer_mod._ShardedArray.flush, []

    def flaky_flush(self):
        calls.append(1)
        if len(calls) >= 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_flush(self)

    out = tmp_path / "cache"
    monkeypatch.setattr(writer_mod._ShardedArray, "flush", flaky_flush)
    assert _run(tiny_teacher_dir, out) == 2
    assert "no space left on the device (or over quota) while writing part" in capsys.readouterr().err
    monkeypatch.setattr(writer_mod._ShardedArray, "flush", real_flush)
    cache = open_cache(str(out))
    committed = {(p.bucket, p.name) for p in cache.parts()}
    # whichever part the full disk hit first (a unit with 1 of its 2 parts committed, or none): no damage,
    # an unfinished extraction whose started units are resumable
    report = verify_cache(str(out))
    assert committed and report.ok and not report.finished and report.extraction.status == "unfinished"
    assert all("resumable" not in p.message for p in report.problems)
    assert all("the extraction has not finished" in line for line in report.unfinished)
    # resume with a different number of processes: every sample exactly once
    subprocess.run(_subprocess_cmd(tiny_teacher_dir, out, nproc=2), cwd=ROOT, env=_env(), check=True,
                   capture_output=True, timeout=300)
    assert committed <= {(p.bucket, p.name) for p in open_cache(str(out)).parts()}
    snap = snapshot(out)
    assert sorted(snap) == sorted(reference[1])
    for sid, (ids, mask, _feats) in snap.items():
        assert (ids, mask) == reference[1][sid][:2]


def test_fingerprint_mismatch_is_refused_naming_the_fields(tiny_teacher_dir, reference, capsys):
    out, snap = reference
    assert _run(tiny_teacher_dir, out, "--set", "cache.num_target_layers=2", "--set", "cache.codec=fp8-e4m3") == 2
    err = capsys.readouterr().err
    assert "target_layer_ids" in err and "codec" in err
    assert snapshot(out) == snap


def test_output_that_is_not_a_cache(tiny_teacher_dir, tmp_path, capsys):
    out = tmp_path / "notacache"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    assert _run(tiny_teacher_dir, out) == 2
    assert "not" in capsys.readouterr().err and (out / "precious.txt").read_text() == "keep me"


def test_layer_ids_out_of_range(tiny_teacher_dir, tmp_path, capsys):
    assert _run(tiny_teacher_dir, tmp_path / "c", "--set", "cache.target_layer_ids=[1, 9]") == 2
    assert "out of range" in capsys.readouterr().err


def test_regenerate_then_extract_and_estimate(tiny_teacher_dir, tmp_path, capsys):
    import json

    regen = tmp_path / "regen.jsonl"
    base = ["configs/tiny.toml", "--set", f"teacher.path={tiny_teacher_dir}", "--set", "data.path=builtin:tiny-chat?n=6",
            "--set", "regenerate.max_new_tokens=24"]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert main(["regenerate", *base, "--out", str(regen), "--no-progress"]) == 0
        convs = [json.loads(line)["messages"] for line in regen.read_text().splitlines()]
        assert len(convs) == 6
        assert main(["regenerate", *base, "--out", str(tmp_path / "again.jsonl"), "--no-progress"]) == 0
        assert (tmp_path / "again.jsonl").read_text() == regen.read_text()  # greedy is deterministic
        capsys.readouterr()
        assert main(["estimate", *base, "--data", str(regen)]) == 0
        est = capsys.readouterr().out
        out = tmp_path / "cache"
        assert main([*base[:1], "--out", str(out), "--data", str(regen), "--no-progress", *base[1:]]) == 0
    finally:
        os.chdir(cwd)
    cache = open_cache(str(out))
    n = len(cache.index())
    assert f"kept {n} samples" in est
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_teacher_dir)
    s = cache.read_sample(0)
    masked = tok.decode(s.input_ids[s.loss_mask].tolist())
    assert convs[0][-1]["content"] in masked  # the teacher's own reply is what the loss covers


@pytest.mark.parametrize("policy", ["skip", "error"])
def test_nonfinite_features_are_caught_at_write_time(tiny_teacher_dir, tmp_path, monkeypatch, capsys, policy):
    import extract.loop as run_mod

    real = run_mod.capture_features
    poisoned = []

    def poison(model, ids, mask, layer_ids, with_logits=False):
        feats, logits = real(model, ids, mask, layer_ids, with_logits)
        if not poisoned:
            feats = feats.clone()
            feats[0, 1, 5] = float("nan")  # row 0 of the first batch
            poisoned.append(1)
        return feats, logits

    monkeypatch.setattr(run_mod, "capture_features", poison)
    out = tmp_path / "cache"
    rc = _run(tiny_teacher_dir, out, "--set", f"extract.on_nonfinite={policy}", n=16)
    if policy == "error":
        assert rc == 2 and "NaN/Inf features" in capsys.readouterr().err
        return
    assert rc == 0 and "1 non-finite" in capsys.readouterr().out
    cache = open_cache(str(out))
    assert len(cache.index()) == 15 and cache.read_metadata("extract_report")["n_nonfinite"] == 1
    verify_cache(str(out))
