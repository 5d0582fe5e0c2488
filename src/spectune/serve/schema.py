"""The OpenAI chat-completions request as spectune takes it: what it implements, what it refuses by name, and how a
bad request is told apart from a good one before any slot is taken."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# OpenAI takes at most 4 stop sequences; the length cap keeps the stop check cheap whatever a caller sends.
MAX_STOPS = 4
MAX_STOP_CHARS = 1024
# A 1 MiB body holds ~28,000 tiny messages; no conversation a voice bot holds comes near this.
MAX_MESSAGES = 4096


def _off(*defaults: Any) -> Any:
    """A parameter spectune leaves at its OpenAI default: null, or one of `defaults`."""
    return lambda value: value is None or value in defaults


# Parameters spectune does not implement, refused (400 unsupported_parameter) unless left at their default: a
# client that relies on tool calls, JSON mode or log-probabilities must hear that it will not get them.
UNSUPPORTED = {
    "n": _off(1),
    "tools": _off([]),
    "tool_choice": _off("none", "auto"),
    "functions": _off([]),
    "function_call": _off("none", "auto"),
    "response_format": _off({"type": "text"}),
    "logprobs": _off(False),
    "top_logprobs": _off(0),
    "logit_bias": _off({}),
    "presence_penalty": _off(0, 0.0),
    "frequency_penalty": _off(0, 0.0),
    "repetition_penalty": _off(1, 1.0),
    "modalities": _off(["text"]),
    "audio": _off(),
    "prediction": _off(),
    "best_of": _off(1),
    "use_beam_search": _off(False),
}


def unsupported_parameter(body: dict[str, Any]) -> str | None:
    """The first parameter of `body` that spectune does not implement and the caller set, or None."""
    return next((name for name, is_default in UNSUPPORTED.items() if name in body and not is_default(body[name])), None)


def lone_surrogate(value: Any) -> str | None:
    """The path of the first string in a parsed JSON value that is not valid Unicode (half of a UTF-16 pair, what a
    client sends after cutting a string inside an emoji), or None. Iterative: JSON nests as deep as it likes."""
    pending: list[tuple[str, Any]] = [("", value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, dict):
            pending += [(f"{path}.{key}" if path else str(key), inner) for key, inner in item.items()]
            pending += [(path or "body", key) for key in item]
        elif isinstance(item, list):
            pending += [(f"{path}.{index}", inner) for index, inner in enumerate(item)]
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
    return None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # "developer" is the OpenAI SDK's current name for the system role.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None  # OpenAI also takes a list of text parts
    # Refused, as `tools` is: an assistant's tool calls dropped would leave the model a conversation that never was.
    tool_calls: list[Any] | None = None

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, value: list[Any] | None) -> None:
        if value:
            raise ValueError("tool calls are not supported by this server (it takes no tools)")
        return None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """A part that is not text (an image, audio) named by its index and type, not by pydantic's union branches."""
        for index, part in enumerate(value if isinstance(value, list) else []):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"part {index} is of type {kind!r}: this server takes text parts only")
        return value

    @field_validator("content")
    @classmethod
    def _text(cls, value: str | list[TextPart] | None) -> str:
        return value if isinstance(value, str) else "".join(part.text for part in value or [])

    def for_template(self) -> dict[str, str]:
        """The message as the chat template takes it."""
        return {"role": "system" if self.role == "developer" else self.role, "content": str(self.content)}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    model: str | None = None
    # 0: prefill only (extend this caller's cached prompt while it still speaks, answer nothing: docs/serving.md)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=1)
    # Unset: the server's own setting (`spectune serve --temperature ...`, greedy by default).
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # vLLM's extension
    stop: list[str] | None = None  # OpenAI also takes one string
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    chunking: Literal["token", "sentence"] = "token"
    user: str | None = Field(None, max_length=256)  # the caller: its conversation's cache is its own
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # vLLM's: shares cached prompts only alike
    # vLLM's extensions that benchmark clients (GuideLLM, AIPerf) send to pin the answer's length.
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None

    @field_validator("temperature")
    @classmethod
    def _greedy_below(cls, value: float | None) -> float | None:
        return 0.0 if value is not None and value < 1e-4 else value  # a vanishing temperature is greedy decoding

    @field_validator("stop", mode="before")
    @classmethod
    def _few_short_stops(cls, value: Any) -> Any:
        stops = [value] if isinstance(value, str) else value
        if stops is None:
            return None
        if not isinstance(stops, list):
            return stops  # pydantic says what is wrong with it
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(isinstance(stop, str) and len(stop) > MAX_STOP_CHARS for stop in stops):
            raise ValueError(f"a stop sequence longer than {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("messages")
    @classmethod
    def _spoken_turns(cls, messages: list[Message]) -> list[Message]:
        """Only an assistant turn may be empty (a barge-in cut it off before its first word)."""
        for index, message in enumerate(messages):
            if message.role != "assistant" and not str(message.content).strip():
                raise ValueError(f"message {index} ({message.role}) has empty content")
        return messages

    @model_validator(mode="after")
    def _prefill_for_a_caller(self) -> ChatRequest:
        if self.prefill_only and self.user is None:
            raise ValueError("max_tokens 0 prefills a caller's prompt for its next request: give its `user` too")
        return self

    @property
    def prefill_only(self) -> bool:
        return self.max_tokens == 0 and not self.max_completion_tokens

    def decode_settings(self) -> dict[str, Any]:
        """The decoding settings this request names (what it leaves unset is the server's)."""
        named = {
            "max_tokens": self.max_completion_tokens or self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop,
            "seed": self.seed,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
        }
        return {key: value for key, value in named.items() if value is not None}
