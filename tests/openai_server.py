"""A loopback HTTP server speaking the OpenAI chat-completions protocol, replaying scripted replies for tests.

It is a real server (http.server on 127.0.0.1, an ephemeral port, one thread per request), so litellm and the
openai SDK talk to it exactly as they would to vLLM, SGLang or llama.cpp. Tests queue replies (text, tool calls,
token usage), queue failures (HTTP 429 with Retry-After, 5xx, context-length errors) or stalls, then assert on
`server.requests`, the JSON bodies it received.

    with ScriptedOpenAIServer() as server:
        server.reply_tool_calls([("Bash", {"command": "ls"})])
        model = LiteLLMModel("openai/test-model", api_base=server.base_url, api_key="test")
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable
from typing import Any

MODEL_ID = "test-model"


@dataclass
class ScriptedReply:
    """One answer to a chat-completions request: an assistant message, or an HTTP error."""

    status: int = 200
    message: dict[str, Any] = field(default_factory=dict)
    usage: dict[str, int] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    before: Callable[[], None] | None = None  # run when the request arrives, before the answer (a user's action)


class ScriptedOpenAIServer:
    """Serve POST /v1/chat/completions from a queue of ScriptedReply, and GET /v1/models."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self._replies: deque[ScriptedReply] = deque()
        self._lock = threading.Lock()
        self._call_ids = itertools.count(1)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._httpd.daemon_threads = True
        # A short poll interval: shutdown() waits up to one interval, once per test.
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02},
                                        name="openai-test-server", daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> ScriptedOpenAIServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    # --- scripting -------------------------------------------------------------------------------------------

    def reply_text(self, content: str, *, prompt_tokens: int = 10, completion_tokens: int = 5) -> None:
        """Queue a plain assistant answer."""
        self._queue(ScriptedReply(message={"role": "assistant", "content": content},
                                  usage=_usage(prompt_tokens, completion_tokens)))

    def reply_tool_calls(self, calls: list[tuple[str, dict[str, Any] | str]], *, content: str | None = None,
                         prompt_tokens: int = 10, completion_tokens: int = 5,
                         before: Callable[[], None] | None = None) -> None:
        """Queue an assistant answer with tool calls; a str argument is sent verbatim (to script invalid JSON);
        `before` runs when its request arrives (something the user does while the run goes on)."""
        tool_calls = [
            {
                "id": f"call_{next(self._call_ids)}",
                "type": "function",
                "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
            for name, args in calls
        ]
        message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
        self._queue(ScriptedReply(message=message, usage=_usage(prompt_tokens, completion_tokens), before=before))

    def fail(self, status: int, times: int = 1, *, message: str = "scripted failure", code: str | None = None,
             retry_after: str | None = None) -> None:
        """Queue `times` error answers with HTTP `status` (and a Retry-After header when given)."""
        headers = {"Retry-After": retry_after} if retry_after is not None else {}
        error = {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error",
                 "code": code}
        for _ in range(times):
            self._queue(ScriptedReply(status=status, error=error, headers=headers))

    def stall(self, seconds: float, times: int = 1) -> None:
        """Queue `times` answers that sleep `seconds` before sending an error (a client timeout should fire first)."""
        for _ in range(times):
            self._queue(ScriptedReply(status=503, error={"message": "stalled", "type": "server_error"},
                                      delay_s=seconds))

    def _queue(self, reply: ScriptedReply) -> None:
        with self._lock:
            self._replies.append(reply)

    def _next_reply(self, body: dict[str, Any]) -> ScriptedReply:
        with self._lock:
            self.requests.append(body)
            if self._replies:
                return self._replies.popleft()
        # A client error, not a 5xx, so an exhausted script fails the test at once instead of being retried.
        return ScriptedReply(status=400, error={"message": "the test server has no scripted reply left",
                                                "type": "invalid_request_error"})


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _completion_body(reply: ScriptedReply, model: str) -> dict[str, Any]:
    finish_reason = "tool_calls" if reply.message.get("tool_calls") else "stop"
    return {
        "id": f"chatcmpl-{time.monotonic_ns()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": reply.message, "finish_reason": finish_reason}],
        "usage": reply.usage,
    }


def _make_handler(server: ScriptedOpenAIServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.rstrip("/") == "/v1/models":
                self._send_json(200, {"object": "list", "data": [{"id": MODEL_ID, "object": "model",
                                                                   "owned_by": "kernelpilot-tests"}]})
            else:
                self._send_json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(length) or b"{}")
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._send_json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                return
            reply = server._next_reply(body)
            if reply.before is not None:
                reply.before()
            time.sleep(reply.delay_s)
            if reply.error is not None:
                self._send_json(reply.status, {"error": reply.error}, reply.headers)
            else:
                self._send_json(200, _completion_body(reply, body.get("model", MODEL_ID)), reply.headers)

        def _send_json(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a timeout test): nothing to answer

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep test output quiet
            pass

    return Handler
