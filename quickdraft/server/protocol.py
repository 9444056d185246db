"""The OpenAI-compatible wire format: request and response bodies as pydantic models (OpenAI's names, plus
vLLM's sampling extras and quickdraft's `num_speculative_tokens`), and the error body.

Fields OpenAI defines but quickdraft does not implement (suffix, tools, ...) are declared so that a request
that sets them gets a 400 naming the field instead of a silently different answer; unknown fields are ignored,
as OpenAI and vLLM do. logprobs are the target's raw log-probabilities (vLLM's default logprobs_mode), the same
with speculation on or off.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16  # completions per request: n is a multiplier of the work a single request can ask for
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # alternatives per token (vLLM's default max_logprobs); params.MAX_LOGPROBS


class ApiError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
             413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    # vLLM's shape: the type names the HTTP error, the code is the status.
    return {"error": {"message": message, "type": ApiError.TYPES.get(status, "Error"), "param": param,
                      "code": status}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """What completions and chat completions share: OpenAI's sampling fields, vLLM's extras, quickdraft's K."""

    model: str | None = None  # None: the served model
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; not used
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM's sampling extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids (non-streaming responses)
    # quickdraft's: at most this many draft tokens per step for this request (0: no speculation for it)
    num_speculative_tokens: int | None = Field(None, ge=0)
    # vLLM's: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} (see SamplingParams)
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    # One prompt (text or token ids) or a list of them; each is its own n completions.
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False  # the prompt's text before each choice's (and its tokens' logprobs, with logprobs)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # each token's and this many alternatives'
    best_of: int | None = None  # not supported beyond best_of == n
    suffix: str | None = None  # not supported


class TextPart(_Request):
    type: Literal["text"]
    text: str


# The roles of OpenAI's chat API; any other is a 400 that names these (pydantic's message for a Literal).
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)


class ChatMessage(_Request):
    role: ChatRole
    content: str | list[TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's reply: which call it answers
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (a call's arguments as an object, as Qwen2.5's writes them)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                function = dict(call.get("function") or {})
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except json.JSONDecodeError:
                        pass
                calls.append({**call, "function": function})
            out["tool_calls"] = calls
        for name in ("tool_call_id", "name"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token (with logprobs)
    tools: list[dict[str, Any]] | None = None  # OpenAI's function definitions (server/tools.py)
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | {"type": "function", ...}
    # {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": {...}}}
    response_format: dict[str, Any] | None = None


# --- responses ------------------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpecDecodeStats(BaseModel):
    """This request's speculation (its completions pooled), as vLLM defines the figures: acceptance_rate =
    accepted / draft tokens; mean_acceptance_length = 1 + accepted / drafting steps; tokens_per_target_forward
    counts every target forward, the prompt's too. None where nothing was drafted."""

    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    tokens_per_target_forward: float | None
    accepted_per_position: list[int]  # by draft position (a token tree's: by depth)
    tree_steps: int = 0  # drafting steps that verified a token tree
    accepted_path_lengths: list[int] = Field(default_factory=list)  # tree steps by accepted path length
    # True when the server verifies with the LOSSY relaxed acceptance its operator asked for: the text is then
    # not distributed as the model's own.
    lossy: bool = False


def _created() -> int:
    return int(time.time())


def _optional(default=None):
    """A field left out of the JSON while it is None (extras such as token_ids, usage in stream chunks)."""
    return Field(default, exclude_if=lambda value: value is None)


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: per token its text, log-probability (None for an echoed prompt's
    first token), the most likely alternatives {text: logprob}, and its character offset in the choice text."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = _optional()
    prompt_token_ids: list[int] | None = _optional()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    spec_decode: SpecDecodeStats | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ToolCall):
    index: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = _optional()


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = _optional()


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    spec_decode: SpecDecodeStats | None = None
    prompt_token_ids: list[int] | None = _optional()


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = _optional()
    content: str | None = _optional()
    tool_calls: list[DeltaToolCall] | None = _optional()


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = _optional()
    spec_decode: SpecDecodeStats | None = _optional()


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = _optional()
    spec_decode: SpecDecodeStats | None = _optional()


# --- the other endpoints (vLLM's shapes) ----------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_created)
    owned_by: str = "quickdraft"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None  # tokenized through the chat template
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
