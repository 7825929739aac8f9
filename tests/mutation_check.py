"""Mutation check of the safety primitives: each edit below breaks one safety claim in a temporary copy
of the repository, and the named tests must fail there (and pass on an unedited copy).

    .venv/bin/python tests/mutation_check.py            # every mutant (a few minutes on 2 cores)
    .venv/bin/python tests/mutation_check.py --list     # names only
    .venv/bin/python tests/mutation_check.py NAME ...   # some of them

Exit status 0 when every mutant is killed; 1 otherwise (the survivors are listed). A mutant's edit that no
longer applies (its text is gone from the source) is an error too: update the edit with the code.
``tests/test_mutation_check.py`` checks, in the normal suite, that every edit still applies once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".venv", ".git", "runs", "__pycache__", ".pytest_cache", "*.egg-info", ".ruff_cache")


@dataclass(frozen=True)
class Mutant:
    name: str
    claim: str
    path: str  # file to edit, relative to the repository root
    edits: tuple[tuple[str, str], ...]  # (old, new): old must occur exactly once
    tests: tuple[str, ...]  # pytest node ids that must fail


MUTANTS = [
    Mutant("create-exclusive-replace", "one writer per part: exclusive create is a hard link",
           "dflash_cache/storage.py", (("                os.link(tmp, path)\n",
                                        "                os.replace(tmp, path)\n"),),
           ("tests/test_cache_safety.py::test_exclusive_create_raced_by_processes_at_a_barrier_has_one_winner",
            "tests/test_cache_safety.py::test_part_leases_raced_by_processes_at_a_barrier_have_one_holder",
            "tests/test_locks.py::test_exclusive_create_raced_by_processes_at_one_barrier_has_one_winner")),
    Mutant("create-exclusive-check-then-replace", "one writer per part: no check-then-write window",
           "dflash_cache/storage.py", (("                os.link(tmp, path)\n",
                                        "                if path.exists():\n"
                                        "                    return False\n"
                                        "                os.replace(tmp, path)\n"),),
           ("tests/test_cache_safety.py::test_part_leases_raced_by_processes_at_a_barrier_have_one_holder",
            "tests/test_cache_safety.py::test_exclusive_create_raced_by_processes_at_a_barrier_has_one_winner")),
    Mutant("lock-ignores-pid-reuse", "a dead holder whose pid was reused is not alive (start time compared)",
           "dflash_cache/locks.py", (('return start is None or (start != "" and start == self.start)',
                                      'return start is None or start != ""'),),
           ("tests/test_locks.py::test_a_holder_on_this_host_is_alive_while_its_process_runs_with_the_recorded_start",
            "tests/test_cache_leases.py::test_a_reused_pid_does_not_keep_a_dead_lease")),
    Mutant("fsspec-create-overwrites", "one writer per part on fsspec storage: a conditional create",
           "dflash_cache/storage.py", (('self.fs.pipe_file(self._p(key), data, mode="create")',
                                        "self.fs.pipe_file(self._p(key), data)"),),
           ("tests/test_cache_safety.py::test_exclusive_create_raced_by_threads_on_memory_storage_has_one_winner",)),
    Mutant("fsspec-create-unlocked", "one writer per part on memory://: threads take turns at the create",
           "dflash_cache/storage.py", (("        with _CREATE_LOCK:\n", "        with contextlib.nullcontext():\n"),),
           ("tests/test_cache_safety.py::test_exclusive_create_raced_by_threads_on_memory_storage_has_one_winner",)),
    Mutant("verify-skips-whole-array-checksum", "verify catches corruption, also a valid shard of another part",
           "dflash_cache/verify.py", (('        if value != part.arrays[name]["crc32c"]:\n',
                                       "        if False:\n"),),
           ("tests/test_cache_safety.py::test_verify_catches_a_shard_of_another_part_whose_index_is_the_same[no_chunk_tables]",)),
    Mutant("reader-ignores-recorded-chunk-checksums", "training reads only the part's own chunks: each chunk "
           "read is checked against the commit record's chunk table",
           "dflash_cache/reader.py", (("        if int.from_bytes(stored.tobytes(), \"little\") != want:\n",
                                       "        if False:\n"),),
           ("tests/test_cache_safety.py::test_verify_catches_a_shard_of_another_part_whose_index_is_the_same"
            "[chunk_tables]",)),
    Mutant("read-ahead-reuses-a-buffer-being-read", "read-ahead never hands a fetch buffer to another request "
           "while a decode thread still reads it", "dflash_cache/readahead.py",
           (("            b.dropped = True\n            if b.readers == 0:\n",
             "            b.dropped = True\n            if True:\n"),),
           ("tests/test_readahead.py::test_fetch_buffers_are_reused_and_not_while_a_decode_thread_reads_them",)),
    Mutant("commit-without-fsync", "commits are durable: the tree is fsynced before the commit record",
           "dflash_cache/writer.py", (("        st.sync_tree(self.data_key)\n", ""),),
           ("tests/test_cache_safety.py::test_commit_makes_the_tree_durable_then_creates_the_record_exclusively",)),
    Mutant("commit-record-plain-put", "commits are exclusive: the commit record is created exclusively",
           "dflash_cache/writer.py", (('if not st.create_exclusive(f"{self.key}/{COMMIT}", record, durable=True):',
                                       'if st.put(f"{self.key}/{COMMIT}", record, durable=True):'),),
           ("tests/test_cache_safety.py::test_commit_makes_the_tree_durable_then_creates_the_record_exclusively",)),
    Mutant("checkpoint-written-in-place", "checkpoints are atomic: written aside, then renamed",
           "train/components/checkpoint.py", (('    tmp = root / (final.name + ".tmp")\n', "    tmp = final\n"),
                                              ("    if final.exists():  # a torn leftover of a lost future (we resumed from an "
                                               "earlier step)\n        shutil.rmtree(final)\n    os.replace(tmp, final)\n", "")),
           ("tests/test_resume_state.py::test_a_checkpoint_killed_before_its_rename_leaves_no_step_directory",)),
    Mutant("resume-forgets-guard-window", "bitwise resume: the guard's window is restored",
           "train/components/stateful.py", (("            part.load_state_dict(saved[name])\n",
                                             "            if name != \"guard\":\n"
                                             "                part.load_state_dict(saved[name])\n"),),
           ("tests/test_resume_state.py::test_resume_restores_every_piece_of_saved_state",)),
    Mutant("estimate-drops-sdpa-mask", "estimate: the dense path's additive masks are counted",
           "train/tools/estimate.py", (("sdpa_mask=mask,", "sdpa_mask=0,"),),
           ("tests/test_estimate_terms.py",)),
    Mutant("estimate-drops-rope", "estimate: RoPE's cos/sin tables are counted",
           "train/tools/estimate.py", (("rope=rope,", "rope=0,"),),
           ("tests/test_estimate_terms.py",)),
    Mutant("rank-watch-exit-under-store-call", "a finished rank exits cleanly: its alive thread has left the store",
           "train/components/multinode.py", (("        thread.join(timeout=2 * self.interval_s + 5)\n", ""),),
           ("tests/test_multinode.py::test_a_rank_exiting_while_its_alive_thread_is_in_a_store_call_exits_cleanly",)),
    Mutant("json-array-no-refill", "a JSON array record larger than the read window is read, not called broken",
           "extract/data.py", (('                if at_end and self.fill():\n', '                if False:\n'),),
           ("tests/test_sharegpt_input.py::test_the_stream_matches_one_json_load_across_window_edges",)),
    Mutant("sharegpt-keeps-leading-assistant", "turns before the first user turn are dropped, as the peers do",
           "extract/data.py", (("    body = msgs[first_user:]\n", "    body = msgs[n_sys:]\n"),),
           ("tests/test_sharegpt_input.py::test_the_turns_kept_are_the_ones_the_peers_keep",)),
    Mutant("json-array-offset-from-window", "a broken array names its byte offset in the file",
           "extract/data.py", (("        off += len(self.buf[at:pos].encode(\"utf-8\", \"surrogatepass\"))\n",
                                "        off += pos - at\n"),),
           ("tests/test_sharegpt_input.py::test_a_truncated_array_names_the_byte_and_the_complete_records",)),
]


def apply(root: Path, m: Mutant) -> None:
    path = root / m.path
    text = path.read_text()
    for old, new in m.edits:
        n = text.count(old)
        if n != 1:
            raise SystemExit(f"mutant {m.name}: the text to edit occurs {n} times in {m.path} (expected once); "
                             f"update tests/mutation_check.py with the code:\n{old}")
        text = text.replace(old, new)
    path.write_text(text)


def run_tests(root: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return -1, "timed out"
    return proc.returncode, proc.stdout[-2000:] + proc.stderr[-2000:]


def check(m: Mutant, baseline: bool, timeout_s: float) -> bool:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, ignore=SKIP, symlinks=True)
        if baseline:
            rc, out = run_tests(copy, m.tests, timeout_s)
            if rc != 0:
                print(f"  {m.name}: the tests fail WITHOUT the edit (rc {rc}); fix them first\n{out}")
                return False
        apply(copy, m)
        t0 = time.perf_counter()
        rc, out = run_tests(copy, m.tests, timeout_s)
        killed = rc not in (0, 5)  # 5: no tests collected, which kills nothing
        verdict = "killed" if killed else "SURVIVED"
        print(f"{verdict:>8}  {m.name:<38} {time.perf_counter() - t0:6.1f} s  ({m.claim})", flush=True)
        if not killed:
            print(out)
        return killed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="mutants to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--no-baseline", action="store_true", help="skip running the tests on an unedited copy")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run")
    args = p.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:<38} {m.path:<26} {m.claim}")
        return 0
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        p.error(f"unknown mutants {sorted(unknown)}; see --list")
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    survivors = [m.name for m in chosen if not check(m, not args.no_baseline, args.timeout)]
    if survivors:
        print(f"{len(survivors)} of {len(chosen)} mutants survived (or their tests fail unedited): {survivors}")
        return 1
    print(f"all {len(chosen)} mutants killed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
