"""Caches on S3-compatible object storage, against a loopback moto server (127.0.0.1, a free port; no
network): set-up errors are one line (exit 2), a store that ignores create-if-absent is refused, run
dirs on object storage are refused, and the concurrency and kill tests of local disk hold on s3://."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

from dflash_cache import open_cache, verify_cache  # noqa: E402
from dflash_cache.cli import main as cache_main  # noqa: E402
from dflash_cache.errors import CacheError  # noqa: E402
from extract.cli import main as extract_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXE = str(Path(sys.executable).with_name("dflash-extract"))
N, UNIT = 24, 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on loopback; AWS_* variables point this process (and its children) at it."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's request log
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    # moto keeps its buckets in this process, not in the server: start every module from an empty store
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/reset", method="POST"),
                           timeout=60).close()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    fs.mkdir("dflash-test")
    try:
        yield fs
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3fs.S3FileSystem.clear_instance_cache()


def _args(teacher: Path, out: str) -> list[str]:
    return ["configs/tiny.toml", "--out", out, "--no-progress", "--set", f"teacher.path={teacher}",
            "--set", f"data.path=builtin:tiny-chat?n={N}", "--set", f"extract.unit_size={UNIT}",
            "--set", "extract.tokens_per_batch=1024"]


def _extract(args: list[str]) -> int:
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return extract_main(args)
    finally:
        os.chdir(cwd)


def _start(teacher: Path, out: str) -> subprocess.Popen:
    return subprocess.Popen([EXE, *_args(teacher, out)], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _snapshot(url: str) -> dict[int, bytes]:
    cache = open_cache(url)
    ids = cache.index().sample_ids.tolist()
    assert len(ids) == len(set(ids)), "a sample written twice"
    return {s.sample_id: s.input_ids.numpy().tobytes() + s.loss_mask.numpy().tobytes()
            + s.features.view(torch.int16).numpy().tobytes() for s in cache.read_samples(sorted(ids))}


@pytest.fixture(scope="module")
def reference(tiny_teacher_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("local") / "cache")
    assert _extract(_args(tiny_teacher_dir, out)) == 0
    snap = _snapshot(out)
    assert sorted(snap) == list(range(N))
    return snap


def test_extraction_on_s3_equals_local_and_verifies(s3, tiny_teacher_dir, reference, capsys):
    url = "s3://dflash-test/single"
    assert _extract(_args(tiny_teacher_dir, url)) == 0
    assert _snapshot(url) == reference
    assert verify_cache(url).ok
    assert cache_main(["info", url]) == 0
    # the start-up probe left nothing behind
    assert not [p for p in s3.ls("dflash-test/single") if ".dflash-probe" in p]


def test_two_concurrent_jobs_on_s3_end_with_the_single_run_samples(s3, tiny_teacher_dir, reference):
    url = "s3://dflash-test/concurrent"
    procs = [_start(tiny_teacher_dir, url) for _ in range(2)]
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    for o in outputs:
        assert re.search(rf"cache: {N} samples in {N // UNIT} complete units", o), o
    assert _snapshot(url) == reference
    assert verify_cache(url).ok


def test_a_job_killed_on_s3_is_finished_by_a_rerun(s3, tiny_teacher_dir, reference):
    url = "s3://dflash-test/killed"
    victim = _start(tiny_teacher_dir, url)
    deadline = time.time() + 300
    committed: list[str] = []
    while time.time() < deadline and victim.poll() is None and len(committed) < 2:
        s3.invalidate_cache()
        committed = [p for p in s3.find("dflash-test/killed/buckets") if p.endswith("/commit.json")]
        time.sleep(0.05)
    assert victim.poll() is None, "the job ended before it could be killed: the test proves nothing"
    victim.send_signal(signal.SIGKILL)
    victim.communicate()
    assert _extract(_args(tiny_teacher_dir, url)) == 0
    assert _snapshot(url) == reference
    assert verify_cache(url).ok


def test_missing_bucket_is_one_line(s3, capsys):
    assert cache_main(["info", "s3://no-such-bucket/cache"]) == 2
    err = capsys.readouterr().err.strip()
    assert "bucket 'no-such-bucket' does not exist" in err and "aws s3 mb" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_unreachable_endpoint_is_one_line():
    port = _free_port()  # nothing listens there
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing",
           "FSSPEC_S3": '{"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}'}
    got = subprocess.run([sys.executable, "-m", "dflash_cache.cli", "info", "s3://b-bucket/cache"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 2, got.stderr
    err = got.stderr.strip()
    assert "cannot reach the object store at endpoint http://127.0.0.1" in err and "Traceback" not in err, err


def test_missing_package_is_one_line():
    code = ("import sys; sys.modules['s3fs'] = None  # a fresh interpreter: as if it were not installed\n"
            "from dflash_cache.cli import main; sys.exit(main(['info', 's3://b-bucket/cache']))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 2, got.stderr
    assert "need the s3fs package" in got.stderr and "pip install 'dflash-pipeline[s3]'" in got.stderr
    assert "Traceback" not in got.stderr


def test_a_store_that_ignores_create_if_absent_is_refused(tmp_path):
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from dflash_cache import CacheSpec, TeacherInfo, create_cache

    class DropsMode(MemoryFileSystem):  # like an adapter that drops pipe_file's mode
        protocol = "dropsmode"

        def pipe_file(self, path, value, mode="overwrite", **kwargs):
            return super().pipe_file(path, value, **kwargs)

    fsspec.register_implementation("dropsmode", DropsMode, clobber=True)
    spec = CacheSpec(TeacherInfo("t", None, 4, 8, 32), (1,), "tok", 64, bucket_edges=(16,))
    with pytest.raises(CacheError, match="does not refuse a second create-if-absent"):
        create_cache("dropsmode://cache", spec, chunk_tokens=8, shard_tokens=64)
    assert not DropsMode().exists("/cache/zarr.json")  # refused before the cache was created


def test_run_dir_on_object_storage_is_refused(tmp_path, capsys):
    from fixtures.trainer import small_cache, train_argv

    from train.cli import main as train_main

    cache = small_cache(str(tmp_path / "cache"))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        rc = train_main(train_argv(["model.mask_token_id=511", "metrics.progress_bar=false"], cache,
                                   "s3://bucket/run", "train.max_steps=1"))  # type: ignore[arg-type]
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert rc == 2 and "--run-dir s3://bucket/run is a URL" in err, err
    assert not (tmp_path / "s3:").exists()


# A writer whose shard upload is a multipart upload (parts of PART bytes) that stops before its second part
# and reports the shard's key in a marker file; the test then SIGKILLs it there.
_STALLED_UPLOAD = """
import asyncio, sys
from pathlib import Path
import s3fs.core

marker, part = Path(sys.argv[1]), int(sys.argv[2])
pipe, call = s3fs.core.S3FileSystem._pipe_file, s3fs.core.S3FileSystem._call_s3

async def small_parts(self, path, data, chunksize=None, **kw):
    return await pipe(self, path, data, chunksize=part, **kw)

async def stall_second_part(self, method, *a, **kw):
    if method == "upload_part" and kw.get("PartNumber") == 2 and "/features/c/" in kw.get("Key", ""):
        marker.write_text(kw["Key"])
        while True:
            await asyncio.sleep(1)
    return await call(self, method, *a, **kw)

s3fs.core.S3FileSystem._pipe_file, s3fs.core.S3FileSystem._call_s3 = small_parts, stall_second_part
from extract.cli import main
sys.exit(main(sys.argv[3:]))
"""


def test_a_multipart_shard_upload_killed_midway_leaves_nothing_visible(s3, tiny_teacher_dir, reference, tmp_path,
                                                                        monkeypatch):
    """A shard uploaded in parts, its writer SIGKILLed after the first part: the shard is not an object (an
    unfinished multipart upload is invisible), readers see no part, verify reports the unit as not yet
    committed (never a torn shard), and a rerun finishes the cache equal to the single local run."""
    import moto.s3.models

    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 256)  # S3's is 5 MiB; the shards are small
    url, part = "s3://dflash-test/multipart", 1024
    script, marker = tmp_path / "stalled_upload.py", tmp_path / "uploading"
    script.write_text(_STALLED_UPLOAD)
    victim = subprocess.Popen([sys.executable, str(script), str(marker), str(part), *_args(tiny_teacher_dir, url)],
                              cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and victim.poll() is None and not marker.exists():
        time.sleep(0.05)
    assert victim.poll() is None and marker.exists(), f"no multipart shard upload was stalled: {victim.stdout.read()}"
    key = marker.read_text()
    uploads = s3.call_s3("list_multipart_uploads", Bucket="dflash-test").get("Uploads", [])
    assert key in [u["Key"] for u in uploads]  # the upload really is a multipart one, one part in
    os.killpg(victim.pid, signal.SIGKILL)
    victim.communicate()

    s3.invalidate_cache()
    assert not s3.exists(f"dflash-test/{key}")  # no partial object
    part_key = key.split("/g")[0].removeprefix("multipart/")  # buckets/<b>/<name>
    assert part_key not in [p.key for p in open_cache(url).parts()]
    report = verify_cache(url, raise_on_error=False)  # the unit is incomplete (no commit record), not torn:
    assert part_key in report.uncommitted, report.uncommitted  # an unfinished extraction, no damage
    assert report.ok and not report.finished and report.extraction.status == "unfinished", report.problems
    assert any(ln.startswith(f"{part_key}: ") and "incomplete" in ln for ln in report.unfinished), report.unfinished
    assert not any("features" in ln for ln in report.unfinished), report.unfinished
    assert _extract(_args(tiny_teacher_dir, url)) == 0
    assert _snapshot(url) == reference
    assert verify_cache(url).ok
