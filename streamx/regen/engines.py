"""What `streamx regenerate` asks for assistant turns: OpenAI-compatible chat-completions servers over HTTP
(vllm serve, SGLang, transformers serve), or the target model in this process through transformers.

Both take a Request (the conversation so far and the turn's seed) and give a Reply (the new turn's text, its
reasoning, tool calls, finish reason, token counts and, where known, the exact token ids). A row the engine
cannot answer raises RowError (its reason goes to the side file, the run goes on); a server that stays down
raises ServerDown (the run stops).
"""

from __future__ import annotations

import http.client
import itertools
import json
import random
import threading
import urllib.parse
from dataclasses import dataclass

import jinja2
import torch

from ..base.threads import Stopped
from ..data.tokenize import vocabulary_fingerprint

RETRIED_STATUS = frozenset({408, 429})  # and every 5xx: timeouts, rate limits, overloaded or restarting
UNAVAILABLE_STATUS = frozenset({408, 429, 502, 503, 504})  # still so after the retries: the server is down
SETUP_STATUS = frozenset({401, 403, 404, 405})  # no or a wrong key, --model or URL: every row would fail alike
MAX_BACKOFF_S = 30.0
CONNECT_TIMEOUT_S = 10.0  # a host that does not answer at all is known in seconds, whatever --timeout is
STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)  # a keep-alive the server closed


@dataclass(frozen=True)
class Sampling:
    """How each turn is generated: the regenerate settings that reach the engine."""

    max_tokens: int
    temperature: float | None = None  # None: the model's own generation config
    top_p: float | None = None
    thinking: str = "auto"  # on / off: the chat template's enable_thinking; auto: the template's default

    def template_kwargs(self) -> dict:
        return {} if self.thinking == "auto" else {"enable_thinking": self.thinking == "on"}


@dataclass(frozen=True)
class Request:
    messages: list[dict]  # the conversation so far, OpenAI form
    seed: int
    tools: list | None = None  # the row's tool definitions, sent as they are


@dataclass(frozen=True)
class Reply:
    content: str
    reasoning: str | None
    tool_calls: list | None
    finish_reason: str  # stop, length (truncated), tool_calls, ...
    prompt_tokens: int
    completion_tokens: int
    prompt_ids: list[int] | None = None  # exactly what the model read and wrote, where the engine says
    completion_ids: list[int] | None = None


class RowError(Exception):
    """This row cannot be regenerated, for a reason of its own: it goes to the side file and is retried by the
    next run."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class ServerDown(RuntimeError):
    """No server answered a request within its retries, or the servers refuse every request (a wrong --model,
    key or URL): the run stops (what was written stays)."""


# ---- OpenAI-compatible servers ----

def api_base(url: str) -> str:
    """http://host:port, .../v1 or .../v1/chat/completions -> http://host:port/v1 (no trailing slash)."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--endpoint must be an http(s) URL such as http://localhost:8000/v1; got {url!r}")
    path = parts.path.rstrip("/").removesuffix("/chat/completions").rstrip("/") or "/v1"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class Endpoints:
    """One or more servers sharing the load: requests go round the endpoints, a failed one is retried on the
    next with exponential backoff, until `cancel()` (a run winding up) ends the retries. Each thread keeps one
    keep-alive connection per endpoint."""

    def __init__(self, urls: list[str], sampling: Sampling, timeout: float = 600.0, retries: int = 5,
                 return_token_ids: bool = False, model: str | None = None, api_key: str | None = None,
                 api_key_env: str = "OPENAI_API_KEY"):
        """`api_key` (read by the caller from the variable `api_key_env`) goes out as a Bearer token and nowhere
        else: the messages below name the variable, never the key, and blank it out of servers' answers."""
        self.urls = [api_base(u) for u in urls]
        self.api_key, self.api_key_env = api_key or None, api_key_env
        self.headers = {"Content-Type": "application/json",
                        **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})}
        self.sampling, self.timeout, self.retries = sampling, timeout, retries
        self._cancelled = threading.Event()
        self.return_token_ids = return_token_ids
        self._turn = itertools.count()  # which endpoint a request starts at
        self.vocabulary = None  # whose tokens the server's token ids are: not known here
        self._local = threading.local()
        self.model = model if model is not None else self.served_model()

    def served_model(self) -> str:
        """The one model the first endpoint lists (GET /models), for a run that names none."""
        status, payload = self._call(self.urls[0], "GET", "/models", None, what="list its models")
        if status in (401, 403):
            answer = self.redact(error_message(payload))
            raise ServerDown(f"{self.urls[0]}: HTTP {status}: {answer} ({self.key_hint()})")
        models = [m.get("id") for m in payload.get("data", [])] if status == 200 and isinstance(payload, dict) else []
        if len(models) != 1:
            listed = ", ".join(map(str, models)) or f"HTTP {status}"
            raise ValueError(f"{self.urls[0]} serves {len(models)} models ({listed}): name one with --model")
        return str(models[0])

    def body(self, request: Request) -> dict:
        s = self.sampling
        body = {"model": self.model, "messages": request.messages, "max_tokens": s.max_tokens, "seed": request.seed}
        body |= {k: v for k, v in (("temperature", s.temperature), ("top_p", s.top_p)) if v is not None}
        if s.template_kwargs():
            body["chat_template_kwargs"] = s.template_kwargs()
        if request.tools:
            body["tools"] = request.tools
        if self.return_token_ids:
            body["return_token_ids"] = True
        return body

    def complete(self, request: Request) -> Reply:
        body = json.dumps(self.body(request), ensure_ascii=False).encode()
        start = next(self._turn)
        for attempt in range(self.retries + 1):
            url, status, timed_out = self.urls[(start + attempt) % len(self.urls)], None, False
            try:
                status, payload = self._post(url, body)
            except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out
                failure = f"{url}: {err or type(err).__name__}"
                timed_out = isinstance(err, TimeoutError)
            else:
                if status == 200:
                    return parse_reply(payload)
                failure = f"{url}: HTTP {status}: {self.redact(error_message(payload))}"
                if status in (401, 403):
                    raise ServerDown(f"{failure} ({self.key_hint()})")
                if status in SETUP_STATUS:
                    raise ServerDown(f"{failure} (check --model and --endpoint)")
                if self.return_token_ids and "return_token_ids" in failure:  # every row would be refused alike
                    raise ServerDown(f"{failure} (this server returns no token ids, vLLM does: drop "
                                     "--return-token-ids)")
                if status < 500 and status not in RETRIED_STATUS:  # the server read the request and refused it
                    raise RowError("request_rejected", failure)
            backoff = min(MAX_BACKOFF_S, 0.5 * 2**attempt) * random.uniform(0.5, 1)
            if attempt < self.retries and self._cancelled.wait(backoff):
                raise Stopped
        if status is not None and status not in UNAVAILABLE_STATUS:  # the server answers, but fails on this row
            raise RowError("server_error", f"{failure} ({self.retries + 1} tries)")
        if timed_out and self.answering(url):  # this row outlasts --timeout; the server is up
            raise RowError("timeout", f"no reply within --timeout {self.timeout:g} s in {self.retries + 1} tries, "
                           f"while {url} answers other requests")
        raise ServerDown(f"no answer after {self.retries + 1} tries; the last: {failure}")

    def key_hint(self) -> str:
        """What to do about a server that refused this client's key, or wants one."""
        if self.api_key:
            return f"the server refused the API key in ${self.api_key_env}"
        return (f"no API key was sent: put the server's key in ${self.api_key_env}, or name the variable that holds "
                "it with --api-key-env")

    def redact(self, text: str) -> str:
        """`text` with the key blanked out (a server may quote what it was sent)."""
        return text.replace(self.api_key, "***") if self.api_key else text

    def answering(self, url: str) -> bool:
        """Whether the server at `url` answers at all now (GET /models within CONNECT_TIMEOUT_S)."""
        parts = urllib.parse.urlsplit(url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = kind(parts.netloc, timeout=CONNECT_TIMEOUT_S)
        try:
            conn.request("GET", parts.path + "/models", headers=self.headers)
            conn.getresponse().read()
            return True
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def cancel(self) -> None:
        """Requests waiting to retry, now and from now on, raise Stopped instead."""
        self._cancelled.set()

    def _post(self, url: str, body: bytes) -> tuple[int, object]:
        return self._call(url, "POST", "/chat/completions", body)

    def _call(self, url: str, method: str, path: str, body: bytes | None, what: str = "") -> tuple[int, object]:
        connections = self._local.__dict__.setdefault("connections", {})
        for fresh in (url not in connections, True):  # a kept-alive connection the server closed: once more, anew
            try:
                if url not in connections:
                    connections[url] = self._connect(url)
                conn = connections[url]
                conn.request(method, urllib.parse.urlsplit(url).path + path, body=body, headers=self.headers)
                response = conn.getresponse()
                raw = response.read()
                break
            except (OSError, http.client.HTTPException) as err:
                if url in connections:
                    connections.pop(url).close()
                if not fresh and isinstance(err, STALE):
                    continue
                if what:  # a call made once at start: say plainly which server is not there
                    raise ServerDown(f"cannot {what} at {url}: {err or type(err).__name__}") from None
                raise
        try:
            return response.status, json.loads(raw)
        except ValueError:
            return response.status, raw.decode("utf-8", "replace")

    def _connect(self, url: str) -> http.client.HTTPConnection:
        parts = urllib.parse.urlsplit(url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = kind(parts.netloc, timeout=CONNECT_TIMEOUT_S)
        conn.connect()
        conn.sock.settimeout(self.timeout)  # then each response may take up to --timeout
        return conn


def error_message(payload: object) -> str:
    """The first line of a server's error answer, whichever shape it has (OpenAI's, FastAPI's, plain text)."""
    if isinstance(payload, dict):
        err = payload.get("error", payload.get("detail", payload.get("message", payload)))
        payload = err.get("message", err) if isinstance(err, dict) else err
    text = str(payload).strip()
    return (text.splitlines() or ["(empty answer)"])[0][:300]


def parse_reply(payload: object) -> Reply:
    """A chat completion -> Reply; reasoning under vLLM's or SGLang's names, token ids where vLLM returns them."""
    try:
        choice = payload["choices"][0]
        message = choice["message"]
        usage = payload.get("usage") or {}
        content = message.get("content") or ""
        reasoning = message.get("reasoning_content") or message.get("reasoning") or None
        prompt_ids, completion_ids = payload.get("prompt_token_ids"), choice.get("token_ids")
        return Reply(content=content, reasoning=reasoning, tool_calls=message.get("tool_calls") or None,
                     finish_reason=str(choice.get("finish_reason") or "unknown"),
                     prompt_tokens=int(usage.get("prompt_tokens") or len(prompt_ids or ())),
                     completion_tokens=int(usage.get("completion_tokens") or len(completion_ids or ())),
                     prompt_ids=list(prompt_ids) if prompt_ids is not None else None,
                     completion_ids=list(completion_ids) if completion_ids is not None else None)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as err:
        raise RowError("bad_response", f"not a chat completion ({type(err).__name__}: {err}): "
                       f"{str(payload)[:200]}") from None


# ---- the model in this process ----

class LocalEngine:
    """The target model through transformers' `generate`, the requests of a step as one left-padded batch (on
    CPU, transformers' continuous batching measured slower than this; at scale, serve the model and use
    --endpoint). The prompt is the chat template's rendering, so the token ids are exact."""

    def __init__(self, model: str, sampling: Sampling, device: str = "auto", dtype: str = "auto"):
        from ..model.load import load_model
        self.lm, self.tokenizer, self.info = load_model(model, dtype=dtype, device=device)
        if self.tokenizer.chat_template is None:
            raise ValueError(f"{model} has no chat template: regenerate needs one to prompt it")
        self.sampling = sampling
        self.model = self.info.model
        self.vocabulary = vocabulary_fingerprint(self.tokenizer)  # the output's token ids are this tokenizer's
        self.max_positions = getattr(self.lm.config.get_text_config(), "max_position_embeddings", None)
        config = self.lm.generation_config
        eos = config.eos_token_id if config.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos = frozenset(eos if isinstance(eos, list) else [eos])
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos)
        self.generation = config.to_dict() | {"max_new_tokens": sampling.max_tokens, "pad_token_id": self.pad_id,
                                               "eos_token_id": sorted(self.eos)}
        if sampling.temperature == 0:
            self.generation |= {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        elif sampling.temperature is not None:
            self.generation |= {"do_sample": True, "temperature": sampling.temperature}
        if sampling.top_p is not None and sampling.temperature != 0:  # a top-p asks for sampling
            self.generation |= {"do_sample": True, "top_p": sampling.top_p}

    def prompt_ids(self, request: Request) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(request.messages, tools=request.tools, tokenize=False,
                                                      add_generation_prompt=True, **self.sampling.template_kwargs())
        except jinja2.TemplateError as err:
            raise RowError("template_error", str(err).splitlines()[0] if str(err) else type(err).__name__) from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self.max_positions and len(ids) + self.sampling.max_tokens > self.max_positions:
            raise RowError("too_long", f"{len(ids)} prompt tokens + --max-tokens {self.sampling.max_tokens} > the "
                           f"model's {self.max_positions} positions")
        return ids

    def generate(self, requests: list[Request]) -> list[Reply | RowError]:
        """One reply (or the row's error) per request, in order."""
        from transformers import GenerationConfig
        prompts: list[list[int] | RowError] = []
        for request in requests:
            try:
                prompts.append(self.prompt_ids(request))
            except RowError as err:
                prompts.append(err)
        batch = [p for p in prompts if isinstance(p, list)]
        generated = iter(())
        if batch:
            width = max(map(len, batch))
            ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in batch])
            attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            torch.manual_seed(requests[0].seed)  # one generator for the batch: a sampled batch is reproducible whole
            with torch.inference_mode():
                out = self.lm.generate(input_ids=ids.to(self.lm.device), attention_mask=attention.to(self.lm.device),
                                       generation_config=GenerationConfig(**self.generation))
            generated = iter(out[:, width:].tolist())
        return [p if isinstance(p, RowError) else self._reply(p, next(generated)) for p in prompts]

    def _reply(self, prompt: list[int], tokens: list[int]) -> Reply:
        end = next((i for i, t in enumerate(tokens) if t in self.eos), None)
        completion = tokens if end is None else tokens[: end + 1]  # the end-of-turn token is the model's too
        text = self.tokenizer.decode(completion[:end] if end is not None else completion, skip_special_tokens=False)
        reasoning, content = split_reasoning(text)
        return Reply(content=content, reasoning=reasoning, tool_calls=None,
                     finish_reason="length" if end is None else "stop", prompt_tokens=len(prompt),
                     completion_tokens=len(completion), prompt_ids=prompt, completion_ids=completion)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """`<think>reasoning</think>answer` -> (reasoning, answer), as reasoning servers split a reply; text with
    no `</think>` is all answer."""
    if "</think>" not in text:
        return None, text
    reasoning, content = text.split("</think>", 1)
    return reasoning.replace("<think>", "", 1).strip() or None, content.strip()
