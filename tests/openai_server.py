"""An OpenAI-compatible chat server on loopback for the endpoint tests and benchmark.

``GET /v1/models`` and ``POST /v1/chat/completions`` (non-streaming), answered by

- :class:`TeacherBackend`: the tiny teacher, as ``vllm serve`` would: the chat template applied to the
  request's messages with its ``chat_template_kwargs``, greedy when ``temperature`` is 0, stopped at EOS
  or ``max_tokens``, decoded without special tokens, cut before the first ``stop`` string;
- :class:`InstantBackend`: a fixed reply after a fixed latency (client overhead, concurrency speed-up).

Faults are injected per prompt: ``faults={"substring of the last user turn": ["500", "timeout", ...]}``;
each request whose last user turn contains the key takes the next fault of its list (then answers
normally). Every request is recorded in ``server.requests``.

Run standalone: ``python tests/openai_server.py --instant --latency-s 0.05`` prints the URL and serves.
"""

from __future__ import annotations

import argparse
import json
import select
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

FAULTS = ("500", "503", "429", "400", "timeout", "malformed", "no-content", "empty")


class TeacherBackend:
    def __init__(self, model_dir: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.eos = sorted({i for i in (self.tok.eos_token_id, self.model.generation_config.eos_token_id)
                           if isinstance(i, int)})
        self._lock = threading.Lock()  # one generate at a time

    def complete(self, body: dict[str, Any]) -> tuple[str, int, str]:
        torch = self.torch
        text = self.tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True,
                                            **(body.get("chat_template_kwargs") or {}))
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        temperature = float(body.get("temperature", 1.0))
        kwargs: dict[str, Any] = dict(max_new_tokens=int(body.get("max_tokens", 16)), eos_token_id=self.eos,
                                      pad_token_id=self.tok.pad_token_id)
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_p=float(body.get("top_p", 1.0)))
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        with self._lock, torch.inference_mode():
            if temperature > 0:
                torch.manual_seed(int(body.get("seed", 0)))
            out = self.model.generate(input_ids=torch.tensor([ids]), **kwargs)[0, len(ids):].tolist()
        finish = "length"
        for j, t in enumerate(out):
            if t in self.eos:
                out, finish = out[:j], "stop"
                break
        reply = self.tok.decode(out, skip_special_tokens=True)
        cuts = [i for s in body.get("stop") or [] if (i := reply.find(s)) >= 0]
        if cuts:
            reply, finish = reply[:min(cuts)], "stop"
        return reply, len(out), finish


class InstantBackend:
    def __init__(self, reply: str = "Sure. Here is a short answer.", tokens: int = 8, latency_s: float = 0.0):
        self.reply, self.tokens, self.latency_s = reply, tokens, latency_s

    def complete(self, body: dict[str, Any]) -> tuple[str, int, str]:
        if self.latency_s:
            time.sleep(self.latency_s)
        return self.reply, self.tokens, "stop"


class OpenAIServer:
    """``with OpenAIServer(backend, "served-name") as server: server.url``"""

    def __init__(self, backend: Any, served_name: str, faults: dict[str, list[str]] | None = None,
                 timeout_sleep_s: float = 600.0, reasoning_field: bool = False, delay_s: float = 0.0):
        self.backend, self.served_name = backend, served_name
        self.delay_s = delay_s  # added to every completion (a kill then lands mid-run)
        self.faults = {k: list(v) for k, v in (faults or {}).items()}
        unknown = {f for v in self.faults.values() for f in v} - set(FAULTS)
        assert not unknown, f"unknown faults {unknown}; expected some of {FAULTS}"
        self.timeout_sleep_s = timeout_sleep_s
        self.reasoning_field = reasoning_field  # split <think> into message.reasoning_content (a reasoning parser)
        self.requests: list[dict[str, Any]] = []  # {"key", "fault", "body", "auth"} per chat request
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def start(self) -> OpenAIServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def take_fault(self, body: dict[str, Any], auth: str | None = None) -> tuple[str, str | None]:
        users = [m.get("content", "") for m in body.get("messages", []) if m.get("role") == "user"]
        key = users[-1] if users else ""
        with self._lock:
            fault = None
            for k, todo in self.faults.items():
                if k in key and todo:
                    fault = todo.pop(0)
                    break
            self.requests.append({"key": key, "fault": fault, "body": body, "auth": auth})
        return key, fault

    def completion(self, body: dict[str, Any], fault: str | None) -> dict[str, Any]:
        time.sleep(self.delay_s)
        text, n, finish = self.backend.complete(body)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning_field and "</think>" in text:
            reasoning, _, answer = text.partition("</think>")
            message = {"role": "assistant", "content": answer.lstrip("\n"),
                       "reasoning_content": reasoning.replace("<think>", "")}
        if fault == "no-content":
            message["content"] = None
        elif fault == "empty":
            message["content"] = ""
        return {"id": "chatcmpl-test", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model"), "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n}}


def _handler(server: OpenAIServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the engines serve
        # headers and body go out in two writes: with Nagle on, the body waits ~40 ms for a delayed ACK
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, status: int, payload: bytes, headers: dict[str, str] | None = None) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout fault)
                self.close_connection = True

        def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
            self._send(status, json.dumps(obj).encode(), headers)

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": server.served_name, "object": "model"}]})
            else:
                self._json(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path != "/v1/chat/completions":
                self._json(404, {"error": {"message": f"no route {self.path}"}})
                return
            if body.get("model") != server.served_name:
                self._json(404, {"error": {"message": f"the model {body.get('model')} does not exist"}})
                return
            _, fault = server.take_fault(body, self.headers.get("Authorization"))
            if fault in ("500", "503"):
                self._json(int(fault), {"error": {"message": "injected server error"}})
            elif fault == "429":
                self._json(429, {"error": {"message": "injected rate limit"}}, {"Retry-After": "0"})
            elif fault == "400":
                self._json(400, {"error": {"message": "injected: prompt longer than the context"}})
            elif fault == "malformed":
                self._send(200, b"<html>502 Bad Gateway</html>")
            else:
                if fault == "timeout":  # answer only once the client has given up (at most timeout_sleep_s)
                    select.select([self.connection], [], [], server.timeout_sleep_s)
                self._json(200, server.completion(body, fault))

    return Handler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--model", help="tiny teacher directory (TeacherBackend)")
    p.add_argument("--instant", action="store_true", help="a fixed reply (InstantBackend)")
    p.add_argument("--latency-s", type=float, default=0.0)
    p.add_argument("--served-name", default="test-model")
    args = p.parse_args(argv)
    backend = InstantBackend(latency_s=args.latency_s) if args.instant else TeacherBackend(args.model)
    server = OpenAIServer(backend, args.served_name).start()
    print(server.url, flush=True)
    try:
        server._thread.join()
    except KeyboardInterrupt:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
