"""The model layer: models that answer the agent's messages, and the helpers that keep a conversation sendable.

- `LiteLLMModel`: any litellm provider string (a local vLLM/SGLang/llama.cpp server is `openai/<name>` plus an api
  base), with retries on rate limits, 5xx, timeouts and dropped connections, token and cost accounting, and a
  plain-text action format for models without native tool calling.
- The plain-text action format lives in `text_actions.py`; fitting a conversation to the window in `context.py`.
- `ScriptedModel`: replays fixed replies (tests, demos, RL data).

The model a run uses (a LiteLLMModel, or the built-in policy when none is named) is picked by
`kernelpilot.models.resolve_model`, outside this package: the agent never imports the policy.

litellm is imported only when a LiteLLMModel first needs it: `kernelpilot --help`, scripted runs and the built-in
policy never pay its import time, and the GPU machine's image does not have it.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any

from kernelpilot.agent import ModelReply, RecoverableError, RunEnded, ToolCall, Usage
from kernelpilot.agent.context import fit_context
from kernelpilot.agent.text_actions import (
    LENIENT_JSON,
    as_text_conversation,
    new_call_id,
    split_text_reply,
    text_tool_instructions,
)
from kernelpilot.errors import KernelpilotError

Message = dict[str, Any]

DEFAULT_CONTEXT_WINDOW = 32_768  # tokens, for models missing from litellm's map (most local servers)
DEFAULT_REPLY_TOKENS = 4_096  # room kept for the reply when max_tokens is not set
TOKEN_SAFETY = 0.9  # litellm counts with a stand-in tokenizer for unknown models; leave slack for the real one
NO_KEY_PLACEHOLDER = "no-key"  # the openai client insists on a key; local servers ignore it


class ModelError(KernelpilotError):
    """The model cannot be used: no model configured, bad key, unknown model, server down, context too small."""


class MalformedReply(RecoverableError):
    """A reply whose tool calls could not be read. The message tells the model what to fix; `content` and `usage`
    keep what the reply said and cost, so the loop can still record them."""

    def __init__(self, message: str, content: str = "", usage: Usage | None = None):
        super().__init__(message)
        self.content = content
        self.usage = usage or Usage()


# --- litellm ---------------------------------------------------------------------------------------------------


def _litellm():
    """Import litellm on first use, with its bundled price map (no network fetch at import) and no banners."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.suppress_debug_info = True  # its "Give Feedback / Get Help" banner would follow every handled error
    return litellm


class LiteLLMModel:
    """A model behind any litellm provider string, e.g. `openai/gpt-4o`, `anthropic/...`, or `openai/<name>` with
    `api_base` pointing at a local OpenAI-compatible server."""

    def __init__(
        self,
        model: str,
        *,
        api_base: str | None = None,
        api_key: str | None = None,
        temperature: float = 0.0,
        max_tokens: int | None = None,
        timeout_s: float = 120,
        max_retries: int = 4,
        native_tools: bool | None = None,
        context_window: int | None = None,
        retry_base_delay_s: float = 1.0,
        retry_max_delay_s: float = 60.0,
    ):
        self.name = model
        self.api_base = api_base
        self.api_key = api_key
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_base_delay_s = retry_base_delay_s
        self.retry_max_delay_s = retry_max_delay_s
        self._native_tools = native_tools
        self._native_tools_chosen = native_tools is not None
        self._context_window = context_window
        self._request_key: str | None = None
        self._checked = False
        self._answered = False  # whether the server has answered once: until then a refused connection is final
        self._message_tokens = functools.lru_cache(maxsize=8192)(self._count_serialized_message)

    @property
    def context_window(self) -> int:
        """Prompt tokens the model accepts: as given, else litellm's map, else DEFAULT_CONTEXT_WINDOW."""
        if self._context_window is None:
            self._context_window = _known_context_window(self.name) or DEFAULT_CONTEXT_WINDOW
        return self._context_window

    @property
    def native_tools(self) -> bool:
        """Whether tools go as native function calling (else the text format): as given, else native for
        `openai/` endpoints (OpenAI-compatible servers mostly support it), else litellm's model map."""
        if self._native_tools is None:
            self._native_tools = self.name.startswith("openai/") or _supports_function_calling(self.name)
        return self._native_tools

    def query(self, messages: list[Message], tools: list[dict[str, Any]]) -> ModelReply:
        litellm = _litellm()
        from openai import OpenAIError

        self._check_configuration(litellm)
        budget_scale = 1.0
        while True:
            request = self._request(messages, tools, budget_scale)
            try:
                return self._reply(self._complete(request))
            except litellm.ContextWindowExceededError as err:
                # Our count used a stand-in tokenizer; the provider's own verdict wins: trim harder and resend.
                budget_scale *= 0.75
                if budget_scale < 0.5:
                    raise _model_error(self, err, attempts=1) from None
            except litellm.BadRequestError as err:
                if not self._fall_back_to_text_actions(err):
                    raise _model_error(self, err, attempts=1) from None
            except OpenAIError as err:
                attempts = self.max_retries + 1 if self._retried(err) else 1
                raise _model_error(self, err, attempts=attempts) from None

    def _check_configuration(self, litellm) -> None:
        """Fail before the first request on what needs no network: an unknown provider, a missing key."""
        if self._checked:
            return
        try:
            provider = litellm.get_llm_provider(self.name, api_base=self.api_base)[1]
        except Exception as err:  # noqa: BLE001 - litellm raises several types for an unparseable model string
            raise ModelError(
                f"litellm cannot tell which provider serves the model '{self.name}': {_reason(err)}.",
                hint=_MODEL_NAME_HINT,
            ) from None
        self._request_key = self.api_key or self._key_from_environment(litellm, provider)
        self._checked = True

    def _key_from_environment(self, litellm, provider: str) -> str | None:
        """None when litellm will find the provider's key itself; a placeholder for a keyless local server."""
        missing_keys = litellm.validate_environment(model=self.name).get("missing_keys", [])
        missing = [key for key in missing_keys if key.endswith("_KEY")]  # not e.g. OLLAMA_API_BASE, which defaults
        if not missing:
            return None
        if self.api_base:
            return NO_KEY_PLACEHOLDER
        raise ModelError(
            f"No API key is set for {self.name} ({provider}): {' or '.join(missing)} is missing.",
            hint=f"export {missing[0]}=... or pass --api-key; a local server: --model openai/<name> --api-base URL.",
        )

    def _request(self, messages: list[Message], tools: list[dict[str, Any]], budget_scale: float) -> dict[str, Any]:
        native = self.native_tools
        budget = int(self._prompt_budget(tools, native) * budget_scale)
        fitted = fit_context(messages, max_tokens=budget, count_tokens=self.count_tokens)
        needed = self.count_tokens(fitted)
        if needed > budget:
            raise ModelError(
                f"The conversation needs about {needed} tokens but {self.name}'s context window of "
                f"{self.context_window} leaves {budget} for it, even after trimming.",
                hint="Use a model with a larger context window, or give its real size if litellm does not know it.",
            )
        request: dict[str, Any] = {
            "model": self.name,
            "messages": fitted if native else as_text_conversation(fitted, tools),
            "api_base": self.api_base,
            "api_key": self._request_key,
            "temperature": self.temperature,
            "timeout": self.timeout_s,
            "max_retries": 0,  # the openai client's own retries would hide ours (and their count)
            "drop_params": True,  # e.g. temperature for models that accept none
            # litellm 1.106.x imports its MCP gateway, and with it the undeclared `mcp` package, whenever `tools`
            # are passed; ours are plain functions (1.108.x and later skip it by themselves).
            "_skip_mcp_handler": True,
        }
        if self.max_tokens is not None:
            request["max_tokens"] = self.max_tokens
        if native and tools:
            request["tools"] = tools
        return request

    def _prompt_budget(self, tools: list[dict[str, Any]], native: bool) -> int:
        """Tokens left for the messages once the reply and the tool descriptions have their room."""
        described = json.dumps(tools) if native else text_tool_instructions(tools)
        tools_tokens = self.count_tokens([{"role": "system", "content": described}])
        reply_tokens = self.max_tokens or min(DEFAULT_REPLY_TOKENS, self.context_window // 8)
        return int((self.context_window - reply_tokens - tools_tokens) * TOKEN_SAFETY)

    def count_tokens(self, messages: Sequence[Message]) -> int:
        """Prompt tokens of `messages` by litellm's tokenizer for this model (cached per message)."""
        return sum(self._message_tokens(json.dumps(m, sort_keys=True, default=str)) for m in messages)

    def _count_serialized_message(self, serialized: str) -> int:
        return _litellm().token_counter(model=self.name, messages=[json.loads(serialized)])

    def _complete(self, request: dict[str, Any]):
        """litellm.completion, retried with exponential backoff and jitter on errors that may pass."""
        litellm = _litellm()
        attempt = 0
        while True:
            try:
                response = litellm.completion(**request)
                self._answered = True
                return response
            except Exception as err:
                if attempt == self.max_retries or not self._retried(err):
                    raise
                time.sleep(self._retry_delay_s(attempt, err))
                attempt += 1

    def _retried(self, err: Exception) -> bool:
        """Whether `err` is worth another attempt: a transient error, except a refused connection before the server
        ever answered (nothing listens at api_base: a wrong address or a server not started, which waiting won't fix)."""
        return _is_transient(err) and (self._answered or not _connection_refused(err))

    def _retry_delay_s(self, attempt: int, err: Exception) -> float:
        asked = _retry_after_s(err)
        if asked is not None:
            return min(asked, self.retry_max_delay_s)
        backoff = min(self.retry_max_delay_s, self.retry_base_delay_s * 2**attempt)
        return backoff * random.uniform(0.5, 1.0)  # jitter: parallel runs (suite over GPUs) must not retry in step

    def _fall_back_to_text_actions(self, err: Exception) -> bool:
        """A server started without tool support (vLLM without --enable-auto-tool-choice, llama.cpp without
        --jinja) rejects `tools` with a 400: when native tools were only presumed, switch to the text format."""
        if self._native_tools_chosen or not self._native_tools or "tool" not in str(err).lower():
            return False
        self._native_tools = False
        return True

    def _reply(self, response) -> ModelReply:
        choices = getattr(response, "choices", None) or []
        message = choices[0].message if choices else None
        content = (getattr(message, "content", None) or "") if message else ""
        usage = _usage(response)
        native_calls = (getattr(message, "tool_calls", None) or []) if message else []
        if self.native_tools and (native_calls or "<tool_call>" not in content):
            return ModelReply(content, [_native_call(c, content, usage) for c in native_calls], usage)
        # Text mode, or a server that passed the model's <tool_call> text through without parsing it.
        try:
            prose, calls = split_text_reply(content)
        except RecoverableError as err:
            raise MalformedReply(str(err), content=content, usage=usage) from None
        return ModelReply(prose, calls, usage)


def _native_call(call, content: str, usage: Usage) -> ToolCall:
    name = call.function.name or ""
    raw = call.function.arguments or ""
    try:
        arguments = LENIENT_JSON.decode(raw) if raw.strip() else {}
    except json.JSONDecodeError as err:
        raise MalformedReply(
            f"The arguments of your {name} call are not valid JSON ({err.msg} at column {err.colno}); "
            f"call {name} again with its arguments as one JSON object.",
            content=content,
            usage=usage,
        ) from None
    if not isinstance(arguments, dict):
        raise MalformedReply(
            f"The arguments of your {name} call are a JSON {type(arguments).__name__}; they must be one JSON object.",
            content=content,
            usage=usage,
        )
    return ToolCall(id=call.id or new_call_id(), name=name, arguments=arguments, raw_arguments=raw)


def _usage(response) -> Usage:
    usage = getattr(response, "usage", None)
    try:
        cost = _litellm().completion_cost(completion_response=response)
    except Exception:  # noqa: BLE001 - models missing from litellm's price map (local servers) have no known price
        cost = None
    return Usage(
        prompt_tokens=getattr(usage, "prompt_tokens", 0) or 0,
        completion_tokens=getattr(usage, "completion_tokens", 0) or 0,
        cost_usd=cost,
    )


def _known_context_window(model: str) -> int | None:
    try:
        info = _litellm().get_model_info(model)
    except Exception:  # noqa: BLE001 - "not mapped" is the common answer for local models
        return None
    return info.get("max_input_tokens") or info.get("max_tokens")


def _supports_function_calling(model: str) -> bool:
    try:
        return bool(_litellm().supports_function_calling(model))
    except Exception:  # noqa: BLE001 - an unknown model: the text format works with every model
        return False


def _is_transient(err: Exception) -> bool:
    """Errors a later attempt may not meet: rate limits, 5xx, timeouts, dropped connections."""
    litellm = _litellm()
    transient = (
        litellm.RateLimitError,
        litellm.Timeout,
        litellm.APIConnectionError,
        litellm.InternalServerError,
        litellm.ServiceUnavailableError,
        litellm.BadGatewayError,
    )
    return isinstance(err, transient) or (isinstance(err, litellm.APIError) and (err.status_code or 0) >= 500)


def _connection_refused(err: BaseException) -> bool:
    """True when a ConnectionRefusedError lies in the error's chain (litellm wraps openai's, which wraps httpx's)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, ConnectionRefusedError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _retry_after_s(err: Exception) -> float | None:
    """The wait the server asked for (Retry-After in seconds or as an HTTP date, or retry-after-ms), if any."""
    headers = getattr(err, "litellm_response_headers", None) or getattr(getattr(err, "response", None), "headers", None)
    headers = {k.lower(): v for k, v in (headers or {}).items()}
    try:
        if "retry-after-ms" in headers:
            return max(0.0, float(headers["retry-after-ms"]) / 1000)
        if "retry-after" in headers:
            return max(0.0, float(headers["retry-after"]))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(headers["retry-after"])
    except (KeyError, TypeError, ValueError):
        return None
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


_MODEL_NAME_HINT = (
    "Name the model as provider/model, e.g. --model openai/gpt-4o, or --model openai/<served name> "
    "--api-base http://localhost:8000/v1 for a local vLLM, SGLang or llama.cpp server."
)
_LITELLM_PREFIX = re.compile(r"^(?:\s*(?:litellm\.)?[A-Za-z_]+(?:Error|Exception|Timeout)(?: Error)?\s*[:-]\s*)+")
_REASON_CHARS = 300


def _reason(err: Exception) -> str:
    """litellm's explanation on one line, without its stack of class-name prefixes."""
    text = _LITELLM_PREFIX.sub("", str(getattr(err, "message", None) or err))
    text = " ".join(text.split()).rstrip(".")
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 1] + "…"


def _model_error(model: LiteLLMModel, err: Exception, attempts: int) -> ModelError:
    """One sentence for a provider error that retrying did not (or cannot) fix, with what to do about it."""
    litellm = _litellm()
    status = getattr(err, "status_code", None)
    where = model.api_base or "the provider"
    tries = f"after {attempts} attempts" if attempts > 1 else "on the first attempt"
    if isinstance(err, litellm.Timeout):
        return ModelError(
            f"{model.name} did not answer within {model.timeout_s:g} s, {tries}.",
            hint="The server may be overloaded or the model slow: try again later, or allow a longer timeout.",
        )
    if _is_connection_error(err):
        return ModelError(
            f"Could not connect to {where} for {model.name} {tries}: {_reason(err)}.",
            hint="Check that the server is running and that --api-base points at it (e.g. http://localhost:8000/v1).",
        )
    if isinstance(err, (litellm.AuthenticationError, litellm.PermissionDeniedError)) or status in (401, 403):
        return ModelError(
            f"The API key for {model.name} was refused by {where}: {_reason(err)}.",
            hint="Pass --api-key, or set the provider's key variable (OPENAI_API_KEY for openai/ models).",
        )
    if isinstance(err, litellm.RateLimitError):
        return ModelError(
            f"{model.name} was still rate-limited {tries}: {_reason(err)}.",
            hint="Wait, then continue the run with --resume; a lower-tier account may need a slower pace.",
        )
    if isinstance(err, litellm.ContextWindowExceededError):
        return ModelError(
            f"The conversation does not fit in {model.name}'s context window even after trimming: {_reason(err)}.",
            hint="Use a model with a larger context window.",
        )
    if _is_transient(err):
        return ModelError(
            f"{model.name} kept failing (HTTP {status}) {tries}: {_reason(err)}.",
            hint="The provider is having trouble: try again later and continue the run with --resume.",
        )
    if isinstance(err, litellm.NotFoundError) or status == 404:
        return ModelError(f"{model.name} is not served by {where}: {_reason(err)}.", hint=_MODEL_NAME_HINT)
    return ModelError(
        f"{model.name} rejected the request (HTTP {status}): {_reason(err)}.",
        hint="Check --model, --api-base and --api-key.",
    )


def _is_connection_error(err: BaseException) -> bool:
    """litellm reports a refused connection as an InternalServerError; the cause chain says what happened."""
    from openai import APIConnectionError, APITimeoutError

    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, APIConnectionError) and not isinstance(seen, APITimeoutError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# --- scripted model and model resolution ---------------------------------------------------------------------


class ScriptedModel:
    """A deterministic Model for tests, demos and RL data: returns `replies` in order. An exception in the script
    is raised instead (e.g. KeyboardInterrupt to test Ctrl-C); RunEnded("script-exhausted") when none are left."""

    def __init__(
        self,
        replies: Sequence[ModelReply | BaseException],
        *,
        name: str = "scripted",
        context_window: int | None = None,
    ):
        self.name = name
        self.context_window = context_window
        self._replies = list(replies)
        self.received: list[list[Message]] = []  # the messages of every query, for assertions

    def query(self, messages: list[Message], tools: list[dict[str, Any]]) -> ModelReply:
        self.received.append([dict(m) for m in messages])
        if not self._replies:
            raise RunEnded("script-exhausted", "the scripted model has no reply left")
        reply = self._replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply
