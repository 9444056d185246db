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
from dataclasses import dataclass
from typing import Any, AsyncIterator

from pydantic import BaseModel

from quickdraft.api import LLM
from quickdraft.errors import QuickdraftError
from quickdraft.params import SamplingParams
from quickdraft.scheduler import SequenceUpdate
from quickdraft.sequence import PositionLogprobs, RequestMetrics
from quickdraft.server import logprobs as wire_logprobs
from quickdraft.server.tools import check_tools, forced_call_constraint, held_back, parse_tool_calls
from quickdraft.server.async_engine import (AsyncEngine, EngineStoppedError, Event, QueueFullError, RequestDone,
                                            RequestFailed)
from quickdraft.server.protocol import (MAX_STOP_STRINGS, ApiError, AssistantMessage, ChatChoice,
                                        ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatMessage,
                                        ChatCompletionResponse, CompletionChoice, CompletionChunk,
                                        CompletionRequest, CompletionResponse, DeltaMessage, DeltaToolCall,
                                        SamplingFields, SpecDecodeStats, ToolCall, Usage, error_body)

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
    first = message.split(" ", 1)[0].rstrip(":")
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
        self.echo = False  # completions with echo: each choice starts with its prompt's text
        self.tools = False  # chat with tools: replies' <tool_call> blocks become tool_calls

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

    def finals(self) -> list[Final]:
        """Every completion as it ended, in choice order."""
        out = []
        for i, (rid, prompt) in enumerate(zip(self.request_ids, self.prompts)):
            done = self.done[rid]
            logprobs = done.logprobs or [None] * len(done.output_token_ids)
            for j, (ids, reason, entries) in enumerate(zip(done.output_token_ids, done.finish_reasons, logprobs)):
                out.append(Final(i * self.params.n + j, prompt, ids, reason, entries, done.prompt_logprobs))
        return out


@dataclass
class Final:
    """One completion as it ended: its choice index, prompt and output ids, finish reason, and the
    log-probabilities of its tokens and of its prompt's where the request asked for them."""

    index: int
    prompt: list[int]
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None


class OpenAIServing:
    """The two generation endpoints over one LLM and its engine thread."""

    def __init__(self, llm: LLM, engine: AsyncEngine, served_model_name: str):
        self.llm = llm
        self.engine = engine
        self.served_model_name = served_model_name
        self.max_len = llm.engine.max_len
        template = str(getattr(llm.tokenizer, "chat_template", None) or "")
        self.template_names_developer = "'developer'" in template or '"developer"' in template

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

    def chat_prompt(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation's token ids through the model's chat template (which renders `tools`).

        OpenAI's "developer" messages (its newer name for the application's instructions) reach a template that
        does not name that role as "system" messages, as llama.cpp's server does: most templates know only
        "system" (Qwen2.5's drops a message of another role without a word; SmolLM2's writes its default system
        prompt before it)."""
        rendered = [m.for_template() for m in messages]
        if not self.template_names_developer:
            rendered = [{**m, "role": "system"} if m["role"] == "developer" else m for m in rendered]
        try:
            prompt = self.llm.chat_prompt(rendered, tools=tools)
        except QuickdraftError as exc:
            raise ApiError(400, str(exc), "tools" if str(exc).startswith("tools") else "messages") from None
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
                        prompts: list[list[int]], prompt_param: str, logprobs: int | None = None,
                        prompt_logprobs: int | None = None,
                        structured_outputs: dict[str, Any] | None = None) -> SamplingParams:
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
                num_speculative_tokens=request.num_speculative_tokens, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, logit_bias=request.logit_bias,
                structured_outputs=structured_outputs or request.structured_outputs, **fields)
        except QuickdraftError as exc:
            param = "response_format" if structured_outputs else param_of(str(exc))
            raise ApiError(400, str(exc), param) from None

    # --- the endpoints ---
    async def completions(self, request: CompletionRequest) -> Generation:
        """Check the request and start its generation."""
        self.check_model(request.model)
        if request.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise ApiError(400, "best_of is not supported (other than best_of == n)", "best_of")
        prompts = self.completion_prompts(request)
        # echo with logprobs scores the echoed prompt too (its first token has none)
        prompt_logprobs = request.logprobs if request.echo else None
        params = self.sampling_params(request, request.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, prompts, "prompt",
                                      request.logprobs, prompt_logprobs)
        return await self._start(prompts, params, "cmpl", echo=request.echo)

    async def chat_completions(self, request: ChatCompletionRequest) -> Generation:
        self.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        tools = check_tools(request.tools, request.tool_choice)
        constraint = _response_format(request.response_format)
        forced = forced_call_constraint(tools, request.tool_choice) if tools else None
        if sum(c is not None and c != {} for c in (constraint, request.structured_outputs, forced)) > 1:
            raise ApiError(400, "give one of response_format, structured_outputs and a forced tool_choice",
                           "tool_choice" if forced else "response_format")
        prompt = self.chat_prompt(request.messages, tools)
        max_tokens = request.max_completion_tokens or request.max_tokens
        params = self.sampling_params(request, max_tokens, None, [prompt], "messages",
                                      (request.top_logprobs or 0) if request.logprobs else None,
                                      structured_outputs=constraint or forced)
        return await self._start([prompt], params, "chatcmpl", tools=tools is not None)

    async def _start(self, prompts: list[list[int]], params: SamplingParams, prefix: str,
                     echo: bool = False, tools: bool = False) -> Generation:
        generation = Generation(self.engine, f"{prefix}-{uuid.uuid4().hex}", prompts, params)
        generation.echo, generation.tools = echo, tools
        await generation.start()
        return generation

    # --- log-probabilities and echo ---
    def token_text(self, before: int | None, token: int) -> str:
        """The text `token` adds after `before` (see logprobs.TokenText)."""
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            return str(token)
        if before is None:
            return tokenizer.decode([token])
        head, full = tokenizer.decode([before]), tokenizer.decode([before, token])
        return full[len(head):] if full.startswith(head) else tokenizer.decode([token])

    def echo_text(self, prompt: list[int]) -> str:
        tokenizer = self.llm.tokenizer
        return tokenizer.decode(prompt) if tokenizer is not None else ""

    def completion_choice_logprobs(self, generation: Generation, final: Final, echoed: str):
        """A whole completion choice's logprobs: the echoed prompt's (with echo), then its tokens'."""
        if generation.params.logprobs is None:
            return None
        top, text = generation.params.logprobs, self.token_text
        out = None
        if generation.echo:
            out = wire_logprobs.completion_logprobs(final.prompt, final.prompt_logprobs or [None] * len(final.prompt),
                                                    top, text)
        return wire_logprobs.completion_logprobs(final.token_ids[:len(final.logprobs or [])], final.logprobs or [],
                                                 top, text, None, len(echoed), out)

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
        choices = []
        for final in generation.finals():
            echoed = self.echo_text(final.prompt) if generation.echo else ""
            choices.append(CompletionChoice(
                index=final.index, text=echoed + texts[final.index], finish_reason=final.finish_reason,
                logprobs=self.completion_choice_logprobs(generation, final, echoed),
                token_ids=final.token_ids if return_token_ids else None,
                prompt_token_ids=final.prompt if return_token_ids else None))
        return CompletionResponse(id=generation.response_id, model=self.served_model_name, choices=choices,
                                  usage=generation.usage(), spec_decode=generation.spec_decode())

    def chat_response(self, generation: Generation, texts: list[str], return_token_ids: bool) -> ChatCompletionResponse:
        top = generation.params.logprobs
        choices = [ChatChoice(index=final.index, **self._reply(generation, texts[final.index], final.finish_reason),
                              logprobs=None if top is None else wire_logprobs.chat_logprobs(
                                  final.token_ids, final.logprobs or [], top, self.token_text),
                              token_ids=final.token_ids if return_token_ids else None)
                   for final in generation.finals()]
        return ChatCompletionResponse(
            id=generation.response_id, model=self.served_model_name, choices=choices, usage=generation.usage(),
            spec_decode=generation.spec_decode(), prompt_token_ids=generation.prompts[0] if return_token_ids else None)

    @staticmethod
    def _reply(generation: Generation, text: str, finish_reason: str | None) -> dict[str, Any]:
        """A whole chat reply: its message and finish reason, calls parsed out where the request gave tools."""
        if not generation.tools:
            return {"message": AssistantMessage(content=text), "finish_reason": finish_reason}
        content, calls = parse_tool_calls(text)
        return {"message": AssistantMessage(content=content, tool_calls=[ToolCall(**c) for c in calls] or None),
                "finish_reason": "tool_calls" if calls else finish_reason}

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
            offsets: dict[int, int] = {}  # per choice: the length of its text sent so far (text_offset)
            # per choice: its last output token so far (what the next token's text follows; None at the start:
            # the choice's text is its output decoded alone, so its first token's text is decoded alone too)
            last: dict[int, int | None] = {}
            replies: dict[int, list] = {}  # chat with tools: per choice [its whole text, how much of it was sent]
            async for events in generation.steps():
                updates = [e for e in events if isinstance(e, SequenceUpdate)
                           and (e.text_delta or e.finished or e.new_logprobs or (generation.echo and e.prompt_logprobs))]
                choices = [self._chat_choice(generation, generation.choice_index(e), e, last, replies) if chat
                           else self._completion_choice(generation, generation.choice_index(e), e, offsets, last)
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

    def _completion_choice(self, generation: Generation, index: int, update: SequenceUpdate,
                           offsets: dict[int, int], last: dict[int, int | None]) -> CompletionChoice:
        """A streamed completion choice: the echoed prompt before its first tokens, the step's text, and the
        log-probabilities of the tokens the step kept."""
        text, logprobs, top = update.text_delta, None, generation.params.logprobs
        prompt = generation.prompts[index // generation.params.n]
        if index not in offsets:
            offsets[index], last[index] = 0, None
            if generation.echo:
                echoed = self.echo_text(prompt)
                text = echoed + text
                offsets[index] = len(echoed)
                if top is not None:
                    logprobs = wire_logprobs.completion_logprobs(
                        prompt, update.prompt_logprobs or [None] * len(prompt), top, self.token_text)
        if top is not None:
            kept = update.new_logprobs or []
            tokens = update.new_token_ids[:len(kept)]
            logprobs = wire_logprobs.completion_logprobs(tokens, kept, top, self.token_text, last[index],
                                                         offsets[index], logprobs)
            last[index] = tokens[-1] if tokens else last[index]
        offsets[index] += len(update.text_delta)
        return CompletionChoice(index=index, text=text, finish_reason=update.finish_reason, logprobs=logprobs)

    def _chat_choice(self, generation: Generation, index: int, update: SequenceUpdate,
                     last: dict[int, int | None], replies: dict[int, list]) -> ChatChunkChoice:
        top = generation.params.logprobs
        logprobs = None
        if top is not None:
            kept = update.new_logprobs or []
            tokens = update.new_token_ids[:len(kept)]
            before = last.get(index)
            logprobs = wire_logprobs.chat_logprobs(tokens, kept, top, self.token_text, before)
            last[index] = tokens[-1] if tokens else before
        if not generation.tools:
            return ChatChunkChoice(index=index, delta=DeltaMessage(content=update.text_delta or None),
                                   finish_reason=update.finish_reason, logprobs=logprobs)
        # With tools, text from a call block's start on is held back (a tail that may still become one too);
        # at the end the calls go out as one tool_calls delta and the rest of the text as content.
        reply = replies.setdefault(index, ["", 0])
        reply[0] += update.text_delta
        if not update.finished:
            end = held_back(reply[0])
            delta, reply[1] = reply[0][reply[1]:end], max(reply[1], end)
            return ChatChunkChoice(index=index, delta=DeltaMessage(content=delta or None), logprobs=logprobs)
        content, calls = parse_tool_calls(reply[0])
        rest = (content or "")[reply[1]:] if calls else reply[0][reply[1]:]
        tool_calls = [DeltaToolCall(index=i, **call) for i, call in enumerate(calls)] or None
        return ChatChunkChoice(index=index, delta=DeltaMessage(content=rest or None, tool_calls=tool_calls),
                               finish_reason="tool_calls" if calls else update.finish_reason, logprobs=logprobs)


def _response_format(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's response_format as a structured_outputs constraint (None for plain text)."""
    if response_format is None or response_format == {"type": "text"}:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                "{...}}}", "response_format")
        return {"json": schema}
    raise ApiError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}",
                   "response_format")


def _refuse_unsupported(request: SamplingFields) -> None:
    if request.stream_options is not None and not request.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
