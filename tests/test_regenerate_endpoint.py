"""``dflash-extract regenerate --endpoint`` against a real HTTP server on loopback (tests/openai_server.py)
backed by the tiny teacher: replies equal the in-process greedy path record by record; faults (500, 503,
429, timeouts, malformed bodies, missing or empty content, 400) are retried or listed; SIGKILL of the
real CLI, a torn last line and a second writer; the served-model check; request fields."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from extract.builtin_text import builtin_conversations
from extract.cli import main
from extract.endpoint import request_seed

sys.path.insert(0, str(Path(__file__).parent))
from openai_server import InstantBackend, OpenAIServer, TeacherBackend  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
N = 16
PROMPTS = [[m["content"] for m in c["messages"] if m["role"] == "user"] for c in builtin_conversations(N)]
# greedy, cut at a stop string, Qwen3 thinking switched off: each setting must reach the server
SETTINGS = ["regenerate.max_new_tokens=24", 'regenerate.stop=["storms"]', "data.enable_thinking=false"]
CLIENT = ["regenerate.max_concurrency=4", "regenerate.request_timeout_s=10", "regenerate.retry_backoff_s=0.01"]


def _args(teacher: Path, *sets: str, n: int = N) -> list[str]:
    out = ["configs/tiny.toml", "--no-progress"]
    for s in (f"teacher.path={teacher}", f"data.path=builtin:tiny-chat?n={n}", *SETTINGS, *sets):
        out += ["--set", s]
    return out


def _main(argv: list[str]) -> int:
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return main(argv)
    finally:
        os.chdir(cwd)


def _regen(url: str, teacher: Path, out: Path, *extra: str, n: int = N) -> int:
    sets = [a for s in CLIENT for a in ("--set", s)]
    return _main(["regenerate", *_args(teacher, n=n), *sets, "--endpoint", url, "--out", str(out), *extra])


def _records(path: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [r["id"] for r in lines]
    assert len(ids) == len(set(ids)), f"an id is written twice: {sorted(ids)}"
    return {r["id"]: r for r in lines}


@pytest.fixture(scope="module")
def backend(tiny_teacher_dir):
    return TeacherBackend(str(tiny_teacher_dir))


@pytest.fixture(scope="module")
def reference(tiny_teacher_dir, tmp_path_factory) -> dict[int, dict]:
    """The in-process HF generate path with the same settings."""
    out = tmp_path_factory.mktemp("ref") / "ref.jsonl"
    assert _main(["regenerate", *_args(tiny_teacher_dir), "--out", str(out)]) == 0
    ref = _records(out)
    assert sorted(ref) == list(range(N))
    assert sum(1 for r in ref.values() for m in r["messages"] if m["role"] == "assistant") > N  # multi-turn
    return ref


def test_endpoint_replies_equal_in_process_greedy_then_extract(tiny_teacher_dir, backend, reference, tmp_path,
                                                                 capsys):
    out = tmp_path / "regen.jsonl"
    with OpenAIServer(backend, str(tiny_teacher_dir)) as server:
        assert _regen(server.url, tiny_teacher_dir, out) == 0
    got = _records(out)
    assert sorted(got) == list(range(N))
    for i in range(N):
        assert got[i] == reference[i], f"conversation {i} differs from the in-process greedy reply"
    assert all("storms" not in m["content"] for r in got.values() for m in r["messages"] if m["role"] == "assistant")
    bodies = [r["body"] for r in server.requests]
    assert len(bodies) == sum(len(r["messages"]) - len(PROMPTS[i]) - (r["messages"][0]["role"] == "system")
                              for i, r in got.items())  # one request per reply, none repeated
    for b in bodies:
        assert b["model"] == str(tiny_teacher_dir) and b["max_tokens"] == 24 and b["temperature"] == 0.0
        assert b["stop"] == ["storms"] and b["chat_template_kwargs"] == {"enable_thinking": False}
        assert "seed" not in b
    assert "answered 16 conversations" in capsys.readouterr().out
    # the output feeds extraction directly: sample s of the cache is line s of the output
    cache = tmp_path / "cache"
    assert _main([*_args(tiny_teacher_dir, "data.min_loss_tokens=1"), "--data", str(out), "--out", str(cache)]) == 0
    from transformers import AutoTokenizer

    from dflash_cache import open_cache

    c = open_cache(str(cache))
    assert sorted(c.index().sample_ids.tolist()) == list(range(N))
    tok = AutoTokenizer.from_pretrained(tiny_teacher_dir)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    for s in (0, 7, 15):
        sample = c.read_sample(s)
        assert lines[s]["messages"][-1]["content"] in tok.decode(sample.input_ids[sample.loss_mask].tolist())


def test_faults_are_retried_or_listed_and_a_rerun_asks_only_the_failed(tiny_teacher_dir, backend, reference,
                                                                       tmp_path, capsys):
    faults = {PROMPTS[0][0]: ["500", "429", "503"], PROMPTS[2][0]: ["timeout"], PROMPTS[3][0]: ["malformed"],
              PROMPTS[4][0]: ["no-content"], PROMPTS[5][0]: ["400"], PROMPTS[6][0]: ["empty"],
              PROMPTS[7][1]: ["malformed"]}  # conversation 7 fails on its second reply
    out = tmp_path / "regen.jsonl"
    with OpenAIServer(backend, str(tiny_teacher_dir), faults=faults) as server:
        assert _regen(server.url, tiny_teacher_dir, out) == 3
        text = capsys.readouterr().out
        assert "retries: 429 x1, 5xx x2, timeout x1; failed conversations: 5" in text
        assert "12 of 16 missing" not in text and "5 of 16 missing" in text
        for line in ["id 3 (builtin:tiny-chat#3), reply 1: the response is not JSON",
                     "id 4 (builtin:tiny-chat#4), reply 1: the reply has no content",
                     "id 5 (builtin:tiny-chat#5), reply 1: HTTP 400: injected: prompt longer than the context",
                     "id 6 (builtin:tiny-chat#6), reply 1: the reply is empty",
                     "id 7 (builtin:tiny-chat#7), reply 2: the response is not JSON"]:
            assert line in text
        failed = [json.loads(x)["sample_id"] for x in (tmp_path / "regen.jsonl.failures.jsonl").read_text().splitlines()]
        assert failed == [3, 4, 5, 6, 7]
        assert sorted(_records(out)) == [i for i in range(N) if i not in failed]
        first = len(server.requests)
        assert _regen(server.url, tiny_teacher_dir, out) == 0
        asked = [r["key"] for r in server.requests[first:]]
    assert sorted(asked) == sorted([PROMPTS[i][0] for i in failed] + [PROMPTS[7][1]])
    assert not (tmp_path / "regen.jsonl.failures.jsonl").exists()
    got = _records(out)
    assert got == reference


def test_sigkill_rerun_torn_line_and_second_writer(tiny_teacher_dir, backend, reference, tmp_path, capsys):
    out = tmp_path / "regen.jsonl"
    with OpenAIServer(backend, str(tiny_teacher_dir), delay_s=0.1) as server:
        sets = [a for s in [*CLIENT, "regenerate.max_concurrency=2"] for a in ("--set", s)]
        cmd = [sys.executable, "-m", "extract.cli", "regenerate", *_args(tiny_teacher_dir), *sets,
               "--endpoint", server.url, "--out", str(out)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        lock = tmp_path / "regen.jsonl.lock"
        deadline = time.time() + 600
        while not (lock.exists() and f'"pid": {proc.pid}' in lock.read_text()):
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-2000:]
            time.sleep(0.01)
        # a second process on the same output is refused, naming the holder
        capsys.readouterr()
        assert _regen(server.url, tiny_teacher_dir, out) == 2
        assert f"is being written by another dflash-extract regenerate (pid {proc.pid} on " in capsys.readouterr().err
        while not (out.exists() and out.read_text().count("\n") >= 3):
            assert proc.poll() is None and time.time() < deadline, "the run ended before the kill"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        before = _records(out)
        assert 3 <= len(before) < N, "the kill landed after the run finished"
        with out.open("ab") as f:  # what a crash in the middle of a write leaves
            f.write(b'{"id": 15, "messages": [{"role": "user", "con')
        first = len(server.requests)
        assert _regen(server.url, tiny_teacher_dir, out) == 0
        asked = {r["key"] for r in server.requests[first:]}
    assert "cutting off a torn last line" in capsys.readouterr().err
    assert not asked & {PROMPTS[i][0] for i in before}, "an answered conversation was asked again"
    got = _records(out)
    assert sorted(got) == list(range(N))
    assert got == reference
    assert {i: got[i] for i in before} == before


def test_served_model_is_checked_against_the_teacher(tiny_teacher_dir, tmp_path, capsys):
    with OpenAIServer(InstantBackend(), "org/Other-Model-FP8") as server:
        assert _regen(server.url, tiny_teacher_dir, tmp_path / "a.jsonl", n=2) == 2
        err = capsys.readouterr().err
        assert f"serves ['org/Other-Model-FP8'], which is not the teacher (teacher.path = '{tiny_teacher_dir}')" in err
        assert not (tmp_path / "a.jsonl").exists()
        assert _regen(server.url, tiny_teacher_dir, tmp_path / "a.jsonl", "--served-model", "org/Other-Model-FP8",
                      n=2) == 0
        assert _regen(server.url, tiny_teacher_dir, tmp_path / "b.jsonl", "--served-model", "nope", n=2) == 2
        assert "regenerate.served_model = 'nope' is not served" in capsys.readouterr().err
    # the same checkpoint served from another directory (same last path component) is the teacher
    with OpenAIServer(InstantBackend(), f"/models/{tiny_teacher_dir.name}") as server:
        assert _regen(server.url, tiny_teacher_dir, tmp_path / "c.jsonl", n=2) == 0
    assert sorted(_records(tmp_path / "c.jsonl")) == [0, 1]
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert _regen(url, tiny_teacher_dir, tmp_path / "d.jsonl", "--set", "regenerate.max_retries=1", n=2) == 2
    assert f"cannot list the models of {url}" in capsys.readouterr().err


def test_a_failing_server_stops_the_run_after_consecutive_failures(tiny_teacher_dir, tmp_path, capsys):
    with OpenAIServer(InstantBackend(), str(tiny_teacher_dir), faults={"": ["503"] * 100}) as server:
        extra = ["--set", "regenerate.max_retries=1", "--set", "regenerate.max_consecutive_failures=3",
                 "--set", "regenerate.max_concurrency=1"]
        assert _regen(server.url, tiny_teacher_dir, tmp_path / "r.jsonl", *extra) == 3
    assert len(server.requests) == 6  # 3 conversations, each asked twice (one retry), then the run stops
    text = capsys.readouterr().out
    assert "retries: 5xx x3; failed conversations: 3" in text and "16 of 16 missing" in text
    assert "stopped early: 3 conversations in a row failed (last: HTTP 503: injected server error)" in text


@pytest.mark.parametrize("reasoning_field", [False, True], ids=["think-inline", "reasoning-parser"])
def test_sampling_fields_and_reasoning_replies(tiny_teacher_dir, tmp_path, reasoning_field, monkeypatch):
    reply = "<think>\nfirst a plan\n</think>\n\nThe answer."
    monkeypatch.setenv("TEST_SERVER_KEY", "sk-test")
    with OpenAIServer(InstantBackend(reply), str(tiny_teacher_dir), reasoning_field=reasoning_field) as server:
        extra = ["--set", "regenerate.temperature=0.7", "--set", "regenerate.seed=5",
                 "--set", "regenerate.extra_body={top_k = 20}", "--set", "data.enable_thinking=true",
                 "--set", "regenerate.api_key_env=TEST_SERVER_KEY"]
        assert _regen(server.url, tiny_teacher_dir, tmp_path / "r.jsonl", *extra, n=8) == 0
    assert {r["auth"] for r in server.requests} == {"Bearer sk-test"}
    got = _records(tmp_path / "r.jsonl")
    for r in got.values():
        for m in r["messages"][len(r["messages"]) - 1:]:
            assert m == {"role": "assistant", "content": "The answer.", "reasoning_content": "first a plan"}
    seeds = sorted(r["body"]["seed"] for r in server.requests)
    want = sorted(request_seed(5, i, k) for i in range(8) for k in range(len(PROMPTS[i])))
    assert seeds == want and len(set(seeds)) == len(seeds)
    for r in server.requests:
        b = r["body"]
        assert b["temperature"] == 0.7 and b["top_k"] == 20 and b["chat_template_kwargs"] == {"enable_thinking": True}


def test_the_in_process_path_takes_the_same_lock(tiny_teacher_dir, tmp_path, capsys):
    from extract.answer_log import OutputLock

    out = tmp_path / "x.jsonl"
    with OutputLock(out):
        assert _main(["regenerate", *_args(tiny_teacher_dir, n=2), "--out", str(out)]) == 2
    assert f"is being written by another dflash-extract regenerate (pid {os.getpid()} on " in capsys.readouterr().err
    assert not out.exists()
