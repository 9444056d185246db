"""Completions and chat completions: request -> prompts and SamplingParams -> engine requests -> an OpenAI
response or an SSE stream.

One HTTP request becomes one engine request per prompt (a chat is one prompt), each with n completions;
choice i*n + j is completion j of prompt i. Text comes from the scheduler's text deltas (its detokenizer
holds back what a stop string could still cut, so the deltas concatenated are the final text); token counts
and finish reasons come from each request's RequestDone (a stop string can cut tokens a step reported).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from pydantic import BaseModel

from quickdraft.api import LLM
from quickdraft.errors import QuickdraftError
from quickdraft.params import SamplingParams
from quickdraft.scheduler import SequenceUpdate
from quickdraft.sequence import RequestMetrics
from quickdraft.server.async_engine import (AsyncEngine, EngineStoppedError, Event, QueueFullError, RequestDone,
                                            RequestFailed)
from quickdraft.server.protocol import (MAX_STOP_STRINGS, ApiError, AssistantMessage, ChatChoice,
                                        ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatMessage,
                                        ChatCompletionResponse, CompletionChoice, CompletionChunk,
                                        CompletionRequest, CompletionResponse, DeltaMessage, SamplingFields,
                                        SpecDecodeStats, Usage, error_body)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
RETRY_AFTER_S = "1"
SSE_DONE = "data: [DONE]\n\n"

# SamplingParams' defaults where OpenAI leaves a field out (None); vLLM's names.
_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                      "presence_penalty": 0.0, "frequency_penalty": 0.0}


class GenerationFailed(Exception):
    """The engine failed one of this HTTP request's engine requests (or stopped)."""


def spec_decode_stats(metrics: RequestMetrics) -> SpecDecodeStats:
    return SpecDecodeStats(**metrics.spec_decode_fields())


def param_of(message: str) -> str | None:
    """The request field a QuickdraftError names: SamplingParams' messages start with it."""
    first = message.split(" ", 1)[0]
    return first if first in SamplingFields.model_fields or first == "prompt" else None


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event; a model without its optional fields that are None (see protocol._optional)."""
    data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


class Generation:
    """One HTTP request's engine requests, one per prompt (its token ids): submits them and follows their
    events. The response id names the engine requests too (response_id-i for prompt i)."""

    def __init__(self, engine: AsyncEngine, response_id: str, prompts: list[list[int]], params: SamplingParams):
        self.engine = engine
        self.response_id = response_id
        self.prompts = prompts
        self.params = params
        self.request_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        self._prompt_index = {rid: i for i, rid in enumerate(self.request_ids)}
        self.sink: asyncio.Queue[list[Event]] = asyncio.Queue()
        self.done: dict[str, RequestDone] = {}

    def choice_index(self, event: SequenceUpdate) -> int:
        return self._prompt_index[event.request_id] * self.params.n + event.index

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.request_ids)

    async def start(self) -> None:
        requests = [(rid, ids, self.params) for rid, ids in zip(self.request_ids, self.prompts)]
        try:
            await self.engine.submit(requests, self.sink)
        except QueueFullError as exc:
            raise ApiError(503, f"{exc}; retry later", headers={"Retry-After": RETRY_AFTER_S}) from None
        except EngineStoppedError:
            raise ApiError(503, "the server is shutting down") from None
        except QuickdraftError as exc:
            raise ApiError(400, str(exc), param_of(str(exc))) from None
        except Exception as exc:
            raise ApiError(500, f"the engine could not take this request: {type(exc).__name__}: {exc}") from None

    async def steps(self) -> AsyncIterator[list[Event]]:
        """Each engine step's events for these requests, until all are done; raises GenerationFailed."""
        while not self.finished:
            events = await self.sink.get()
            for event in events:
                if isinstance(event, RequestFailed):
                    raise GenerationFailed(event.message)
                if isinstance(event, RequestDone):
                    self.done[event.request_id] = event
            yield events

    def abort_unfinished(self) -> None:
        """Free what is still running (a client gone, a failure): safe to call more than once."""
        self.engine.abort([rid for rid in self.request_ids if rid not in self.done])

    # --- what the finished requests add up to ---
    def usage(self) -> Usage:
        prompt = sum(len(ids) for ids in self.prompts)
        completion = sum(len(ids) for done in self.done.values() for ids in done.output_token_ids)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def spec_decode(self) -> SpecDecodeStats:
        return spec_decode_stats(RequestMetrics.combine([self.done[rid].metrics for rid in self.request_ids],
                                                        concurrent=True))

    def finals(self) -> list[tuple[int, list[int], list[int], str | None]]:
        """(choice index, prompt ids, output ids, finish reason) of every completion, in choice order."""
        out = []
        for i, (rid, prompt) in enumerate(zip(self.request_ids, self.prompts)):
            done = self.done[rid]
            for j, (ids, reason) in enumerate(zip(done.output_token_ids, done.finish_reasons)):
                out.append((i * self.params.n + j, prompt, ids, reason))
        return out


class OpenAIServing:
    """The two generation endpoints over one LLM and its engine thread."""

    def __init__(self, llm: LLM, engine: AsyncEngine, served_model_name: str):
        self.llm = llm
        self.engine = engine
        self.served_model_name = served_model_name
        self.max_len = llm.engine.max_len

    # --- request checks ---
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves '{self.served_model_name}'",
                           "model")

    def tokenize(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if self.llm.tokenizer is None:
            raise ApiError(400, f"model '{self.served_model_name}' has no tokenizer: send token ids", param)
        # Tokenizing here, on the event loop, is fast for prompts of a context's size; the engine thread only
        # decodes (concurrent reads of one fast tokenizer are safe).
        return self.llm.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        """The conversation's token ids through the model's chat template."""
        try:
            prompt = self.llm.chat_prompt([{"role": m.role, "content": m.text()} for m in messages])
        except QuickdraftError as exc:
            raise ApiError(400, str(exc), "messages") from None
        except Exception as exc:  # the template's own checks (e.g. role order) raise template errors
            raise ApiError(400, f"the chat template refused these messages: {exc}", "messages") from None
        return prompt["prompt_token_ids"]

    def completion_prompts(self, request: CompletionRequest) -> list[list[int]]:
        """Each prompt's token ids: one text, token ids, or a list of either."""
        raw = request.prompt
        if isinstance(raw, str):
            items: list[str | list[int]] = [raw]
        elif raw and all(isinstance(t, int) for t in raw):
            items = [raw]  # one prompt of token ids
        else:
            items = list(raw)
        if not items:
            raise ApiError(400, "prompt is empty: give a string, a list of strings or token ids", "prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise ApiError(400, "prompt is empty: give some text to continue", "prompt")
                prompts.append(self.tokenize(item, "prompt"))
            else:
                if not item:
                    raise ApiError(400, "prompt has an empty list of token ids", "prompt")
                prompts.append(list(item))
        return prompts

    def sampling_params(self, request: SamplingFields, requested_max_tokens: int | None, default_max_tokens: int | None,
                        prompts: list[list[int]], prompt_param: str) -> SamplingParams:
        """The request's SamplingParams, max_tokens checked against the context the longest prompt leaves."""
        _refuse_unsupported(request)
        longest = max(len(ids) for ids in prompts)
        left = self.max_len - longest
        if left < 1:
            raise ApiError(400, f"this model's maximum context length is {self.max_len} tokens, and the prompt has "
                                f"{longest}: shorten it so that at least one token can be generated", prompt_param)
        if requested_max_tokens is not None and requested_max_tokens > left:
            raise ApiError(400, f"this model's maximum context length is {self.max_len} tokens; the prompt has "
                                f"{longest} and max_tokens asks for {requested_max_tokens} more: lower max_tokens to "
                                f"at most {left}", "max_tokens")
        max_tokens = requested_max_tokens or min(default_max_tokens or left, left)
        if isinstance(request.stop, list) and len(request.stop) > MAX_STOP_STRINGS:
            raise ApiError(400, f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(request.stop)}", "stop")
        fields = {name: default if getattr(request, name) is None else getattr(request, name)
                  for name, default in _SAMPLING_DEFAULTS.items()}
        try:
            return SamplingParams(
                n=request.n, max_tokens=max_tokens, stop=request.stop, seed=request.seed,
                stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos,
                skip_special_tokens=request.skip_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
                num_speculative_tokens=request.num_speculative_tokens, **fields)
        except QuickdraftError as exc:
            raise ApiError(400, str(exc), param_of(str(exc))) from None

    # --- the endpoints ---
    async def completions(self, request: CompletionRequest) -> Generation:
        """Check the request and start its generation."""
        self.check_model(request.model)
        if request.echo:
            raise ApiError(400, "echo is not supported", "echo")
        if request.logprobs:
            raise ApiError(400, "logprobs is not supported", "logprobs")
        if request.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise ApiError(400, "best_of is not supported (other than best_of == n)", "best_of")
        prompts = self.completion_prompts(request)
        params = self.sampling_params(request, request.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, prompts, "prompt")
        return await self._start(prompts, params, "cmpl")

    async def chat_completions(self, request: ChatCompletionRequest) -> Generation:
        self.check_model(request.model)
        if request.logprobs or request.top_logprobs:
            raise ApiError(400, "logprobs is not supported", "logprobs")
        if request.tools:
            raise ApiError(400, "tools are not supported", "tools")
        if request.response_format not in (None, {"type": "text"}):
            raise ApiError(400, "response_format other than {'type': 'text'} is not supported", "response_format")
        prompt = self.chat_prompt(request.messages)
        max_tokens = request.max_completion_tokens or request.max_tokens
        params = self.sampling_params(request, max_tokens, None, [prompt], "messages")
        return await self._start([prompt], params, "chatcmpl")

    async def _start(self, prompts: list[list[int]], params: SamplingParams, prefix: str) -> Generation:
        generation = Generation(self.engine, f"{prefix}-{uuid.uuid4().hex}", prompts, params)
        await generation.start()
        return generation

    # --- whole responses ---
    async def collect(self, generation: Generation) -> list[str]:
        """Every choice's text, once all are done; raises GenerationFailed."""
        texts = [""] * (len(generation.prompts) * generation.params.n)
        try:
            async for events in generation.steps():
                for event in events:
                    if isinstance(event, SequenceUpdate):
                        texts[generation.choice_index(event)] += event.text_delta
        finally:
            generation.abort_unfinished()
        return texts

    def completion_response(self, generation: Generation, texts: list[str],
                            return_token_ids: bool) -> CompletionResponse:
        choices = [CompletionChoice(index=index, text=texts[index], finish_reason=reason,
                                    token_ids=ids if return_token_ids else None,
                                    prompt_token_ids=prompt if return_token_ids else None)
                   for index, prompt, ids, reason in generation.finals()]
        return CompletionResponse(id=generation.response_id, model=self.served_model_name, choices=choices,
                                  usage=generation.usage(), spec_decode=generation.spec_decode())

    def chat_response(self, generation: Generation, texts: list[str], return_token_ids: bool) -> ChatCompletionResponse:
        choices = [ChatChoice(index=index, message=AssistantMessage(content=texts[index]), finish_reason=reason,
                              token_ids=ids if return_token_ids else None)
                   for index, _, ids, reason in generation.finals()]
        return ChatCompletionResponse(
            id=generation.response_id, model=self.served_model_name, choices=choices, usage=generation.usage(),
            spec_decode=generation.spec_decode(), prompt_token_ids=generation.prompts[0] if return_token_ids else None)

    # --- streams ---
    async def stream(self, generation: Generation, chat: bool, include_usage: bool) -> AsyncIterator[str]:
        """The SSE body: a chunk per choice per step that gave it text (or its end), then with include_usage a
        usage chunk; spec_decode rides on the last chunk. An engine failure ends it with an error event."""
        chunk_type = ChatCompletionChunk if chat else CompletionChunk
        head = dict(id=generation.response_id, created=int(time.time()), model=self.served_model_name)
        try:
            if chat:  # the role first, as OpenAI does
                for index in range(len(generation.prompts) * generation.params.n):
                    role = ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
                    yield sse(ChatCompletionChunk(**head, choices=[role]))
            async for events in generation.steps():
                updates = [e for e in events if isinstance(e, SequenceUpdate) and (e.text_delta or e.finished)]
                choices = [(self._chat_choice if chat else self._completion_choice)(generation.choice_index(e), e)
                           for e in updates]
                chunks = [chunk_type(**head, choices=[choice]) for choice in choices]
                if generation.finished and not include_usage and chunks:
                    chunks[-1].spec_decode = generation.spec_decode()
                for chunk in chunks:
                    yield sse(chunk)
            if include_usage:
                yield sse(chunk_type(**head, choices=[], usage=generation.usage(),
                                     spec_decode=generation.spec_decode()))
        except GenerationFailed as exc:
            yield sse(error_body(500, str(exc)))
        finally:
            # A client that went away cancels this generator: its requests stop and free their caches now.
            generation.abort_unfinished()
        yield SSE_DONE

    @staticmethod
    def _completion_choice(index: int, update: SequenceUpdate) -> CompletionChoice:
        return CompletionChoice(index=index, text=update.text_delta, finish_reason=update.finish_reason)

    @staticmethod
    def _chat_choice(index: int, update: SequenceUpdate) -> ChatChunkChoice:
        return ChatChunkChoice(index=index, delta=DeltaMessage(content=update.text_delta or None),
                               finish_reason=update.finish_reason)


def _refuse_unsupported(request: SamplingFields) -> None:
    if request.logit_bias:
        raise ApiError(400, "logit_bias is not supported", "logit_bias")
    if request.stream_options is not None and not request.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
