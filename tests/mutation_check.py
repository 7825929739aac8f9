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
           "dflash_cache/part_checks.py", (('        if value != part.arrays[name]["crc32c"]:\n',
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
    Mutant("trainer-close-stops-at-first-error", "a failed run closes every component (no reader thread left "
           "running at exit) even when closing one of them fails", "train/loop/loop.py",
           (("        except BaseException as err:\n            if raise_first and first is None:\n",
             "        except BaseException as err:\n            raise\n            if raise_first and first is None:\n"),),
           ("tests/test_reliability_sweep.py::"
            "test_a_failed_checkpoint_write_then_a_failed_metrics_write_leave_no_thread_running",)),
    Mutant("distill-teacher-row-shifted", "distillation: a block row is trained against the teacher's distribution "
           "for that row's own target token", "train/models/distill.py",
           (("    src = (blocks.layout.anchors.to(final.device).unsqueeze(1) + k - 1).clamp(min=0)",
             "    src = (blocks.layout.anchors.to(final.device).unsqueeze(1) + k).clamp(min=0)"),),
           ("tests/test_distill.py::test_each_row_is_distilled_against_the_teacher_distribution_of_its_own_target_token",
            "tests/test_distill.py::test_batch_loss_and_every_gradient_equal_the_dense_reference")),
    Mutant("bonus-token-from-last-draft-row", "speculative sampling (eval --live): after a fully accepted block "
           "the bonus token is drawn from the teacher's row after the last draft", "train/tools/sampling.py",
           (("        return out + [self.sample(p[len(drafts)])]\n",
             "        return out + [self.sample(p[len(drafts) - 1])]\n"),),
           ("tests/test_sampling_bonus.py::test_the_bonus_token_of_an_accepted_block_follows_the_row_after_the_last_draft",
            "tests/test_sampling_bonus.py::test_eval_live_loop_emits_the_bonus_token_from_the_teachers_next_position")),
    Mutant("shipped-bonus-token-from-last-draft-row", "speculative sampling (shipped dflash.py): after a fully "
           "accepted block the bonus token is drawn from the target's row after the last draft",
           "train/models/hf_modeling/dflash.py", (("        dist = p[k]\n", "        dist = p[k - 1]\n"),),
           ("tests/test_sampling_bonus.py::test_the_bonus_token_of_an_accepted_block_follows_the_row_after_the_last_draft",)),
    Mutant("shipped-loop-passes-wrong-bonus-row", "spec_generate (shipped dflash.py) verifies with the target's "
           "distribution after each prefix of the block, the last row after the last draft",
           "train/models/hf_modeling/dflash.py",
           (("accepted, nxt = speculative_sampling(block[0, 1:].cpu(), q, p, generator)",
             "accepted, nxt = speculative_sampling(block[0, 1:].cpu(), q, torch.cat([p[:-1], p[-2:-1]]), generator)"),),
           ("tests/test_sampling_bonus.py::test_shipped_spec_generate_emits_the_bonus_token_from_the_teachers_next_position",)),
    Mutant("shipped-top-p-drops-the-crossing-token", "top-p (shipped dflash.py) keeps the smallest prefix of the "
           "sorted tokens reaching top_p, the token that crosses it included", "train/models/hf_modeling/dflash.py",
           (("sorted_p.cumsum(-1) - sorted_p >= top_p)", "sorted_p.cumsum(-1) >= top_p)"),),
           ("tests/test_sampling_shipped_warp.py::test_shipped_warp_probs_is_the_distribution_worked_out_by_hand",)),
    Mutant("shipped-top-k-keeps-one-less", "top-k (shipped dflash.py) keeps the k most likely tokens",
           "train/models/hf_modeling/dflash.py",
           (("z = z.masked_fill(z < z.topk(top_k, dim=-1).values[..., -1:]",
             "z = z.masked_fill(z <= z.topk(top_k, dim=-1).values[..., -1:]"),),
           ("tests/test_sampling_shipped_warp.py::test_shipped_warp_probs_is_the_distribution_worked_out_by_hand",)),
    Mutant("shipped-spec-generate-verifies-without-top-p", "spec_generate (shipped dflash.py) verifies against the "
           "target's distribution under the caller's top-p", "train/models/hf_modeling/dflash.py",
           (("p = warp_probs(out.logits[0], temperature, top_p, top_k).cpu()",
             "p = warp_probs(out.logits[0], temperature, 1.0, top_k).cpu()"),),
           ("tests/test_sampling_shipped_warp.py::"
            "test_shipped_spec_generate_with_top_p_and_top_k_samples_the_teachers_distribution",)),
    Mutant("guard-ignores-rising-norm", "the guard refuses a level shift while the norm is still rising across its "
           "spikes", "train/components/guards.py",
           (("        if late > self.cfg.rebaseline_max_rise * early:\n", "        if False:\n"),),
           ("tests/test_guards.py::test_a_norm_growing_geometrically_under_a_flat_loss_stops_the_run",)),
    Mutant("guard-rising-norm-inverted", "a settling overshoot (the norm falling across the spikes) is a level shift",
           "train/components/guards.py",
           (("        if late > self.cfg.rebaseline_max_rise * early:\n",
             "        if early > self.cfg.rebaseline_max_rise * late:\n"),),
           ("tests/test_guards.py::test_a_settling_overshoot_is_a_level_shift_within_rebaseline_after_skips",)),
    Mutant("guard-forgets-the-last-level-shift", "a second level shift up within guards.window steps is refused",
           "train/components/guards.py", (("            self.since_shift = 0\n", ""),),
           ("tests/test_guards.py::test_a_norm_growing_geometrically_under_a_flat_loss_stops_the_run",)),
    Mutant("selector-recall-counts-appended-gold", "selector/topk_recall measures recall of the unary top-K, also "
           "under train.selector_gold_outside=append", "train/models/dflash2.py",
           (("metrics.update(selector_metric_sums(blocks, rows, chosen, (top_idx == gold.unsqueeze(1)).any(-1)))",
             "metrics.update(selector_metric_sums(blocks, rows, chosen, trains))"),),
           ("tests/test_model_dflash2.py::test_selector_topk_recall_is_the_share_of_rows_whose_gold_is_a_candidate",)),
    Mutant("reader-checks-only-the-first-chunk-of-a-run", "training reads only the part's own chunks: every chunk "
           "of a read range is checked against the commit record, not only the first",
           "dflash_cache/reader.py", (("want = None if bound is None else int(bound[first + i])",
                                       "want = None if bound is None or i > 0 else int(bound[first + i])"),),
           ("tests/test_cache_safety.py::test_every_chunk_of_a_read_range_is_checked_against_the_record_not_only_"
            "the_first",)),
    Mutant("lease-ignores-a-live-holder", "nobody else takes (and so commits) a part while its holder is live",
           "dflash_cache/locks.py", (("        if live(holder):\n            raise Contended(holder)\n", ""),),
           ("tests/test_cache_safety.py::test_nobody_else_takes_a_part_while_its_holder_is_live",)),
    Mutant("commit-skips-its-lease-check", "a writer that lost its lease never commits, even before its "
           "generation is sealed dead", "dflash_cache/writer.py",
           (("        if not self._lease.held():\n            if self._committed_as(record):",
             "        if False:\n            if self._committed_as(record):"),),
           ("tests/test_cache_safety.py::test_a_writer_that_lost_its_lease_never_commits_even_before_its_generation_"
            "is_sealed_dead",)),
    Mutant("commit-seal-overwrites", "the commit seal is created exclusively: a generation sealed dead stays dead",
           "dflash_cache/fence.py", (("    if storage.create_exclusive(seal_key(key, gen), commit_seal(record), "
                                      "durable=True):",
                                      "    if storage.put(seal_key(key, gen), commit_seal(record), durable=True) "
                                      "or True:"),),
           ("tests/test_cache_safety.py::test_the_commit_seal_and_the_dead_seal_exclude_each_other",)),
    Mutant("remover-ignores-a-commit-seal", "a remover backs off from a generation sealed for its commit",
           "dflash_cache/fence.py", (("                return False  # its writer is committing it",
                                      "                pass  # its writer is committing it"),),
           ("tests/test_cache_safety.py::test_the_commit_seal_and_the_dead_seal_exclude_each_other",)),
    Mutant("generation-reused-after-gc", "a generation identifier is never reused for a part (it carries its "
           "writer's token): a late writer cannot take the new owner's generation for its own",
           "dflash_cache/parts.py", (('return f"g{self.number:06d}-{self.token}" if self.token else '
                                      'f"g{self.number:06d}"', 'return f"g{self.number:06d}"'),),
           ("tests/test_cache_generations.py::test_freeze_timeout_gc_rerun_resume_leaves_the_new_owners_part_untouched",
            "tests/test_cache_generations.py::test_release_gc_rerun_resume_leaves_the_new_owners_part_untouched")),
    Mutant("superseded-lock-removes-lease-files", "a lock that was taken over removes no lock file (its number may "
           "name another holder's by now)", "dflash_cache/locks.py",
           (("        if not self.held():\n            return\n        for name in self.storage.list_dir",
             "        for name in self.storage.list_dir"),),
           ("tests/test_locks.py::test_a_stale_holder_is_taken_over_and_its_late_beat_and_release_change_nothing",)),
    Mutant("reader-trusts-the-records-copies", "training reads the sample boundaries and ids verify checked: the "
           "record's copies are compared with the stored arrays", "dflash_cache/reader.py",
           (("                    if name in _KEPT:  # what training reads must be what verify checked: both "
             "copies, once\n                        self._check_inline_copies()\n", ""),),
           ("tests/test_cache_binding.py::test_training_refuses_what_verify_rejects[edited_offsets]",
            "tests/test_cache_binding.py::test_training_refuses_what_verify_rejects[edited_sample_ids]")),
    Mutant("estimate-backward-bf16-and-fp32-grads", "one layer's backward: weight gradients net of the freed bf16 copies",
           "train/tools/estimate.py", (("            return n * (precision.param_bytes - 2) + largest * 2\n",
                                        "            return n * (precision.param_bytes + 2)\n"),),
           ("tests/test_estimate.py::test_each_phase_holds_at_shapes_the_estimate_was_not_fitted_on",)),
    Mutant("train-runs-extraction-checks", "dflash-train does not check extraction's settings",
           "dflash_cache/runtime/schema.py", (("        if command in (None, EXTRACT_COMMAND):\n",
                                               "        if True:\n"),),
           ("tests/test_config_per_command.py::test_training_a_cache_longer_than_the_extraction_budget",)),
    Mutant("object-store-fixed-order", "bench_object_store rotates the stores' order every round",
           "bench/bench_object_store.py", (("            order = names[r % len(names):] + names[:r % len(names)]\n",
                                            "            order = names\n"),),
           ("tests/test_bench_scripts.py::test_bench_object_store_runs_every_store_and_reports_requests",)),
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
    Mutant("lease-held-compares-numbers-only", "a late writer resuming while a new holder holds the reused lease "
           "number (after gc) changes nothing of the new holder's: a lease is held by number and token",
           "dflash_cache/locks.py", (("        return gen == self.gen and holder is not None and holder.token == "
                                      "self.token\n", "        return gen == self.gen and holder is not None\n"),),
           ("tests/test_cache_generations.py::test_a_late_writer_resuming_while_the_new_holder_holds_the_same_lease_"
            "number_changes_nothing",)),
    Mutant("lock-gives-up-when-its-directory-vanishes", "an acquire whose part directory is removed by a release "
           "while it creates its lease file there retries (no FileNotFoundError)", "dflash_cache/locks.py",
           (("        except FileNotFoundError:\n            # the directory was removed while we created",
             "        except KeyError:\n            # the directory was removed while we created"),),
           ("tests/test_cache_leases.py::test_racing_acquire_and_release_stay_exclusive",)),
    Mutant("lock-gives-up-after-a-few-lost-races", "an acquire that loses races to holders giving the lease back at "
           "once keeps trying (32 tries, backing off) before it says nobody holds the part", "dflash_cache/locks.py",
           (("                    tries: int = 32)", "                    tries: int = 8)"),),
           ("tests/test_cache_leases.py::test_racing_acquire_and_release_stay_exclusive",
            "tests/test_cache_leases.py::test_an_acquire_that_loses_every_race_says_nobody_holds_the_part")),
    Mutant("takeover-ignores-restarted-numbering", "one holder per part also when a release emptied the part "
           "during a takeover and another process took generation 1 again", "dflash_cache/locks.py",
           (("        if not lock.stands(holder):", "        if False:"),),
           ("tests/test_cache_leases.py::test_a_takeover_whose_numbering_restarted_under_it_does_not_hold_beside_the_"
            "fresh_holder",)),
    Mutant("verify-unfinished-hides-damage", "damage is exit 2 whatever else is true: also inside an unfinished "
           "extraction (not 3)", "dflash_cache/cli.py",
           (("    if report.ok and not report.finished:  # no damage", "    if not report.finished:  # no damage"),),
           ("tests/test_extraction_state.py::test_damage_inside_an_unfinished_extraction_is_damage",)),
    Mutant("old-cache-taken-for-finished", "a cache from before extraction plans (meta/config.json, no plan, no "
           "report) is unfinished: verify 3, training refuses it", "dflash_cache/extraction.py",
           (("    if plan is None and not storage.exists(CONFIG):\n", "    if plan is None:\n"),),
           ("tests/test_extraction_state.py::test_a_cache_from_before_extraction_plans_is_unfinished_until_its_report",)),
    Mutant("sharegpt-checks-only-the-first-exchange", "ShareGPT turns must alternate after the first exchange too",
           "extract/data.py", (("    for j, m in enumerate(body):\n", "    for j, m in enumerate(body[:2]):\n"),),
           ("tests/test_sharegpt_input.py::test_turns_that_stop_alternating_after_the_first_exchange_are_an_error_"
            "naming_the_turn", "tests/test_sharegpt_input.py::test_turns_that_stop_alternating_later_are_counted_"
            "skips_with_skip_bad")),
    Mutant("resume-forgets-the-last-level-shift", "a resumed run refuses a second level shift up within "
           "guards.window of an accepted one, as the uninterrupted run does", "train/components/guards.py",
           (("        self.since_shift = None if since is None else int(since)",
             "        self.since_shift = None"),),
           ("tests/test_guards.py::test_a_resume_inside_the_window_after_a_level_shift_refuses_a_second_shift_up_as_"
            "the_straight_run",)),
    Mutant("causal-key-over-is-causal", "is_causal decides over a disagreeing dflash_config.causal (the engines' "
           "precedence)", "train/models/model.py",
           (("    reference = {k: v for k, v in _reader_rules(is_causal).items() if k in kinds}",
             "    reference = {k: v for k, v in _reader_rules(causal if causal is not None else is_causal).items() "
             "if k in kinds}"),
            ("    vllm = {k: v for k, v in _reader_rules(is_causal if is_causal is not None else causal).items() "
             "if k in kinds}",
             "    vllm = {k: v for k, v in _reader_rules(causal if causal is not None else is_causal).items() "
             "if k in kinds}")),
           ("tests/test_released_config.py::test_a_released_config_trains_and_exports_as_the_reference_reads_it"
            "[is_causal-false-over-causal-true]",
            "tests/test_released_config.py::test_is_causal_decides_over_a_disagreeing_dflash_config_causal_with_a_"
            "warning")),
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
