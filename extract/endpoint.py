"""``dflash-extract regenerate --endpoint URL``: the teacher's replies from an OpenAI-compatible server
(``POST /v1/chat/completions``, as served by ``vllm serve`` and SGLang).

What a run guarantees:

- The server is asked for the teacher: the served model (``GET /v1/models``) must be ``teacher.path``
  (or end with its last path component) unless ``regenerate.served_model`` names it explicitly.
- One conversation is one worker at a time; its replies are asked in order, each request carrying the
  regenerated history (``extract.turns.TurnCursor``, as in-process), so up to
  ``regenerate.max_concurrency`` requests are in flight.
- A request is retried after 429, 5xx, a timeout or a lost connection, up to ``max_retries`` times, waiting
  ``retry_backoff_s`` doubled each time (capped at 60 s; a server's ``Retry-After`` is honoured within that
  cap); every retry is counted by cause.
- A response that is not JSON, has no ``choices[0].message.content``, an empty reply, or any other status
  is a failure: the conversation is not written, it is listed at the end (and in ``OUT.failures.jsonl``),
  and the exit code says the run is incomplete. A rerun asks only what is missing from OUT.
- A conversation is written (``extract.answer_log``) once its last reply is in: a kill at any moment
  loses only the conversations in flight.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tqdm import tqdm

from dflash_cache.errors import DFlashError
from dflash_cache.runtime.schema import PipelineConfig

from .answer_log import AnswerLog
from .config import RegenerateConfig
from .run_config import template_options
from .template import TemplateOptions
from .turns import TurnCursor, iter_cursors, output_record, reply_message, scan_prompts

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 60.0
INCOMPLETE_EXIT_CODE = 3  # the run ended with prompts unanswered (listed); rerun to ask them again
_SHOW_FAILURES = 20


class EndpointError(DFlashError):
    """The server cannot be used: unreachable, or not serving the teacher."""


class RequestFailed(Exception):
    """A request that gets no usable reply; ``cause`` is set when it may succeed if retried."""

    def __init__(self, reason: str, cause: str | None = None, retry_after: float | None = None):
        super().__init__(reason)
        self.cause = cause  # "429" / "5xx" / "timeout" / "connection" (retryable), None (final)
        self.retry_after = retry_after


# -- HTTP --------------------------------------------------------------------------------------------------


class ChatClient:
    """JSON over HTTP/1.1 keep-alive, one connection per thread, on the stdlib's ``http.client``.

    Kept rather than httpx after measuring both transports on the same requests and server
    (bench/bench_http_client.py, docs/performance.md): with one request in flight httpx spent 3.5-7x the
    client CPU per request (0.48-0.84 ms against 0.12-0.14 ms) and more wall time; with 8 in flight
    against a 50 ms server both are server-bound (within 4%). httpx would add five packages and still leave
    the retry policy (429 / 5xx / timeouts, Retry-After, backoff) to this class: it retries only failed
    connects. What is hand-written here is the transport's ~25 lines in :meth:`_send`."""

    def __init__(self, url: str, cfg: RegenerateConfig, stop: threading.Event | None = None):
        parts = urlsplit(url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EndpointError(f"--endpoint {url!r}: expected an http(s) URL such as http://localhost:8000")
        self.url = url
        self.base = parts.path.removesuffix("/v1")
        self._conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._host, self._port = parts.hostname, parts.port
        self.cfg = cfg
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise EndpointError(f"regenerate.api_key_env = {cfg.api_key_env!r}, but that environment variable "
                                    "is not set")
            self.headers["Authorization"] = f"Bearer {key}"
        self.stop = stop or threading.Event()
        self.retries: Counter[str] = Counter()
        self._retries_lock = threading.Lock()
        self._local = threading.local()

    def _send(self, method: str, path: str, body: bytes | None) -> tuple[int, http.client.HTTPMessage, bytes]:
        for attempt in range(2):
            conn = getattr(self._local, "conn", None)
            reused = conn is not None
            if conn is None:
                conn = self._local.conn = self._conn_cls(self._host, self._port, timeout=self.cfg.request_timeout_s)
            try:
                conn.request(method, self.base + path, body=body, headers=self.headers)
                resp = conn.getresponse()
                return resp.status, resp.headers, resp.read()
            except (OSError, http.client.HTTPException) as err:
                conn.close()
                self._local.conn = None
                # a kept-alive connection the server closed while idle: reconnect once, not a retry
                if reused and attempt == 0 and isinstance(err, http.client.RemoteDisconnected | BrokenPipeError |
                                                          ConnectionResetError):
                    continue
                if isinstance(err, TimeoutError):
                    raise RequestFailed(f"no response within {self.cfg.request_timeout_s:g} s", "timeout") from None
                raise RequestFailed(f"{type(err).__name__}: {err}", "connection") from None
        raise AssertionError("unreachable")

    def call(self, method: str, path: str, payload: dict | None = None) -> bytes:
        """The body of a 200 response, retrying what may succeed later; raises :class:`RequestFailed`."""
        body = None if payload is None else json.dumps(payload, ensure_ascii=False).encode()
        for attempt in range(self.cfg.max_retries + 1):
            try:
                status, headers, data = self._send(method, path, body)
                if status == 200:
                    return data
                detail = _error_detail(data)
                if status == 429 or status >= 500:
                    raise RequestFailed(f"HTTP {status}: {detail}", "429" if status == 429 else "5xx",
                                        _retry_after(headers))
                raise RequestFailed(f"HTTP {status}: {detail}")
            except RequestFailed as err:
                if err.cause is None or attempt == self.cfg.max_retries or self.stop.is_set():
                    raise
                with self._retries_lock:
                    self.retries[err.cause] += 1
                delay = min(self.cfg.retry_backoff_s * 2 ** attempt, MAX_BACKOFF_S)
                if err.retry_after is not None:
                    delay = min(max(delay, err.retry_after), MAX_BACKOFF_S)
                if self.stop.wait(delay * random.uniform(0.8, 1.2)):  # jitter: retries do not arrive in step
                    raise
        raise AssertionError("unreachable")


def _error_detail(data: bytes) -> str:
    try:
        obj = json.loads(data)
        msg = obj.get("error", obj) if isinstance(obj, dict) else obj
        if isinstance(msg, dict):
            msg = msg.get("message", msg)
        return str(msg)[:300]
    except (ValueError, UnicodeDecodeError):
        return repr(data[:200])


def _retry_after(headers: http.client.HTTPMessage) -> float | None:
    try:
        return float(headers.get("Retry-After", ""))
    except ValueError:
        return None


# -- the served model --------------------------------------------------------------------------------------


def served_models(client: ChatClient) -> list[str]:
    try:
        data = client.call("GET", "/v1/models")
    except RequestFailed as err:
        raise EndpointError(f"cannot list the models of {client.url} (GET /v1/models: {err}); is the server "
                            "running and is --endpoint its base URL?") from None
    try:
        return [str(m["id"]) for m in json.loads(data)["data"]]
    except (ValueError, KeyError, TypeError):
        raise EndpointError(f"{client.url}/v1/models did not answer an OpenAI model list: {data[:200]!r}") from None


def pick_served_model(served: list[str], teacher_path: str, override: str | None, url: str) -> str:
    """The model to request: ``override`` if served, else the served name that is the teacher."""
    if override is not None:
        if override not in served:
            raise EndpointError(f"regenerate.served_model = {override!r} is not served by {url}; it serves {served}")
        return override
    if teacher_path in served:
        return teacher_path
    tail = Path(teacher_path.rstrip("/")).name
    same = [m for m in served if Path(m.rstrip("/")).name == tail]
    if len(same) == 1:
        return same[0]
    raise EndpointError(
        f"{url} serves {served}, which is not the teacher (teacher.path = {teacher_path!r}); the drafter must "
        "learn the teacher's own replies. Point --endpoint at a server running the teacher, or pass "
        "--served-model NAME (regenerate.served_model) if NAME is the teacher under another name"
    )


# -- one request -------------------------------------------------------------------------------------------


def request_seed(seed: int, sample_id: int, turn: int) -> int:
    """Per request, so a conversation's sampled replies do not depend on order, concurrency or resumes."""
    return (seed * 1_000_003 + sample_id * 64 + turn) % (2**31 - 1)


def request_body(cfg: RegenerateConfig, model: str, options: TemplateOptions, cursor: TurnCursor) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": cursor.history(), "max_tokens": cfg.max_new_tokens,
                            "temperature": cfg.temperature, "top_p": cfg.top_p}
    if cfg.stop:
        body["stop"] = list(cfg.stop)
    if cfg.temperature > 0:
        body["seed"] = request_seed(cfg.seed, cursor.record.sample_id, cursor.k)
    if options.enable_thinking is not None:  # how vLLM and SGLang pass chat-template switches (Qwen3 thinking)
        body["chat_template_kwargs"] = {"enable_thinking": options.enable_thinking}
    body.update(cfg.extra_body)
    return body


@dataclass
class Reply:
    message: dict[str, str]
    completion_tokens: int
    truncated: bool  # finish_reason "length": cut at max_tokens


def parse_reply(data: bytes) -> Reply:
    """The assistant message of a chat completion; a body that carries none raises :class:`RequestFailed`."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise RequestFailed(f"the response is not JSON: {data[:120]!r}") from None
    choices = obj.get("choices") if isinstance(obj, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise RequestFailed(f"the response has no choices[0].message: {data[:120]!r}")
    finish = choice.get("finish_reason")
    content = message.get("content")
    reasoning = message.get("reasoning_content") or message.get("reasoning")  # a server's reasoning parser
    if not isinstance(content, str):
        hint = "; it was cut at max_tokens, raise regenerate.max_new_tokens" if finish == "length" else ""
        raise RequestFailed(f"the reply has no content (finish_reason={finish!r}){hint}")
    if reasoning is not None and not isinstance(reasoning, str):
        raise RequestFailed(f"the reply's reasoning is not a string: {reasoning!r:.80}")
    if not content.strip() and not (reasoning or "").strip():
        raise RequestFailed(f"the reply is empty (finish_reason={finish!r})")
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
    tokens = usage.get("completion_tokens")  # only for the progress figures: a server without usage counts 0
    return Reply(reply_message(content, reasoning), tokens if isinstance(tokens, int) else 0, finish == "length")


# -- the run -----------------------------------------------------------------------------------------------


@dataclass
class Failure:
    sample_id: int
    source: str
    turn: int
    reason: str

    def line(self) -> str:
        return f"id {self.sample_id} ({self.source}), reply {self.turn + 1}: {self.reason}"


@dataclass
class EndpointReport:
    url: str
    model: str
    n_input: int  # conversations in the input
    n_before: int  # already answered in OUT before this run
    n_answered: int = 0
    n_requests: int = 0  # answered requests (retries not included)
    completion_tokens: int = 0
    n_truncated: int = 0
    retries: dict[str, int] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    n_bad_input: int = 0
    read: str = ""  # the input's read counts (ReadCounts.summary)
    stopped: str | None = None  # why the run stopped before asking everything
    wall_s: float = 0.0

    @property
    def n_missing(self) -> int:
        return self.n_input - self.n_before - self.n_answered

    @property
    def complete(self) -> bool:
        return self.n_missing == 0

    exit_code = INCOMPLETE_EXIT_CODE

    def lines(self, out: str) -> list[str]:
        wall = max(self.wall_s, 1e-9)
        retries = ", ".join(f"{k} x{v}" for k, v in sorted(self.retries.items())) or "none"
        out_lines = [self.read] * bool(self.read) + [
            f"endpoint {self.url}, model {self.model}",
            f"answered {self.n_answered} conversations into {out} ({self.n_before} were there already); "
            f"{self.n_missing} of {self.n_input} missing" + (f"; {self.n_bad_input} bad input records skipped"
                                                              if self.n_bad_input else ""),
            f"requests: {self.n_requests} answered, retries: {retries}; failed conversations: {len(self.failures)}",
            f"generated {self.completion_tokens} tokens ({self.n_truncated} replies cut at max_tokens) in "
            f"{self.wall_s:.1f} s: {self.n_requests / wall:.1f} req/s, {self.completion_tokens / wall:.0f} tok/s",
        ]
        if self.stopped:
            out_lines.append(f"stopped early: {self.stopped}")
        if self.failures:
            out_lines.append("failed (rerun the same command to ask them again):")
            failures = sorted(self.failures, key=lambda f: f.sample_id)
            out_lines += ["  " + f.line() for f in failures[:_SHOW_FAILURES]]
            if len(self.failures) > _SHOW_FAILURES:
                out_lines.append(f"  ... and {len(self.failures) - _SHOW_FAILURES} more in {failures_path(out)}")
        return out_lines


def failures_path(out: str | Path) -> Path:
    return Path(str(out) + ".failures.jsonl")


class EndpointRun:
    """Worker threads, each taking the next conversation and asking its replies in order."""

    def __init__(self, cfg: RegenerateConfig, client: ChatClient, model: str, options: TemplateOptions,
                 answers: AnswerLog, pending: Iterable[TurnCursor], fingerprint: str, report: EndpointReport):
        self.cfg, self.client, self.model, self.options = cfg, client, model, options
        self.answers, self.fingerprint, self.report = answers, fingerprint, report
        self._queue: Iterator[TurnCursor] = iter(pending)
        self._lock = threading.Lock()
        self._consecutive_failures = 0
        self.error: BaseException | None = None  # a worker's unexpected error, raised by run()

    def _next(self) -> TurnCursor | None:
        with self._lock:
            return None if self.client.stop.is_set() else next(self._queue, None)

    def _ask(self, cursor: TurnCursor) -> None:
        while not cursor.done:
            reply = parse_reply(self.client.call("POST", "/v1/chat/completions",
                                                 request_body(self.cfg, self.model, self.options, cursor)))
            cursor.add_reply(reply.message)
            with self._lock:
                self.report.n_requests += 1
                self.report.completion_tokens += reply.completion_tokens
                self.report.n_truncated += reply.truncated

    def _worker(self) -> None:
        try:
            while (cursor := self._next()) is not None:
                try:
                    self._ask(cursor)
                except RequestFailed as err:
                    with self._lock:
                        self.report.failures.append(Failure(cursor.record.sample_id, cursor.record.source,
                                                            cursor.k, str(err)))
                        self._consecutive_failures += 1
                        if self._consecutive_failures >= self.cfg.max_consecutive_failures and not self.report.stopped:
                            self.report.stopped = (f"{self._consecutive_failures} conversations in a row failed "
                                                   f"(last: {err}); check the server, then rerun")
                            self.client.stop.set()
                    continue
                if not self.answers.append(output_record(cursor, self.fingerprint)):
                    return  # the log was closed under us (interrupted): this answer is lost, as in-flight ones are
                with self._lock:
                    self.report.n_answered += 1
                    self._consecutive_failures = 0
        except BaseException as err:  # a write error (disk full ...): stop everything, run() raises it
            self.error = err
            self.client.stop.set()

    def run(self, n_pending: int, show: bool) -> None:
        threads = [threading.Thread(target=self._worker, name=f"regenerate-{i}", daemon=True)
                   for i in range(min(self.cfg.max_concurrency, n_pending))]
        t0 = time.perf_counter()
        bar = tqdm(total=n_pending, unit="conv", desc="regenerate", disable=not show, dynamic_ncols=True)
        for t in threads:
            t.start()
        try:
            while (alive := [t for t in threads if t.is_alive()]) and self.error is None:
                alive[0].join(0.5)
                self._refresh(bar, t0)
        finally:
            self.client.stop.set()  # on an interrupt, daemon workers stop asking; in-flight answers are dropped
            self.answers.close()
            self._refresh(bar, t0)
            bar.close()
            self.report.wall_s = time.perf_counter() - t0
            self.report.retries = dict(self.client.retries)
        if self.error is not None:
            raise self.error

    def _refresh(self, bar: tqdm, t0: float) -> None:
        r = self.report
        elapsed = max(time.perf_counter() - t0, 1e-9)
        bar.n = r.n_answered + len(r.failures)
        bar.set_postfix_str(f"{r.n_requests / elapsed:.1f} req/s, {r.completion_tokens / elapsed:,.0f} gen tok/s, "
                            f"retries {sum(self.client.retries.values())}, failed {len(r.failures)}", refresh=False)
        bar.refresh()


def regenerate_via_endpoint(cfg: PipelineConfig, out_path: str, show: bool = True) -> EndpointReport:
    """Ask the server for every conversation of ``cfg.data`` missing from ``out_path``; append the answers."""
    rcfg = cfg.regenerate
    assert rcfg.endpoint is not None
    scan = scan_prompts(cfg)  # a stream: checks and counts the input, then the run reads it again lazily
    client = ChatClient(rcfg.endpoint, rcfg)
    model = pick_served_model(served_models(client), cfg.teacher.path, rcfg.served_model, rcfg.endpoint)
    answers = AnswerLog(out_path, scan.fingerprint, rcfg.fsync_every_s)
    done = answers.open()  # ids of this input (the log's fingerprint is checked): the only O(input) state
    n_input = scan.n_conversations
    pending = (c for c in iter_cursors(cfg, scan) if c.record.sample_id not in done)
    report = EndpointReport(rcfg.endpoint, model, n_input, len(done), n_bad_input=len(scan.counts.bad),
                            read=scan.counts.summary())
    log.info("%s serves %s: %d of %d conversations to ask (%d answered in %s already), %d in flight at most",
             rcfg.endpoint, model, n_input - len(done), n_input, report.n_before, out_path, rcfg.max_concurrency)
    try:
        EndpointRun(rcfg, client, model, template_options(cfg), answers, pending, scan.fingerprint, report).run(
            n_input - len(done), show)
    finally:
        answers.close()
    _write_failures(out_path, report.failures)
    return report


def _write_failures(out_path: str, failures: list[Failure]) -> None:
    path = failures_path(out_path)
    if not failures:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        for x in sorted(failures, key=lambda x: x.sample_id):
            f.write(json.dumps(x.__dict__, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
