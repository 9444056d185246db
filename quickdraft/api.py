"""The Python API, with vLLM's names: LLM, SamplingParams, RequestOutput, CompletionOutput."""

from __future__ import annotations

import copy
import gc
import logging
import os
import random
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence as Seq

import torch
from torch import nn

from quickdraft import kv, structured
from quickdraft.drafts import METHODS, DraftContext, LoadedDraft, Proposer, SpeculativeConfig, build_proposer, read_config
from quickdraft.engine import Engine, RequestMetrics
from quickdraft.errors import QuickdraftError
from quickdraft.models import RUNNERS, loader, make_runner
from quickdraft.params import SEED_MAX, SEED_MIN, SamplingParams
from quickdraft.sampling import derive_key
from quickdraft.scheduler import Request, Scheduler, SequenceSetup
from quickdraft.sequence import PositionLogprobs

log = logging.getLogger(__name__)

Prompt = str | dict[str, Any]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    # SamplingParams.logprobs: per output token, {token id: Logprob} of the token and its alternatives.
    logprobs: list[PositionLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = True
    # SamplingParams.prompt_logprobs: per prompt token (None for the first), as CompletionOutput.logprobs.
    prompt_logprobs: list[PositionLogprobs | None] | None = None


class TextStream:
    """Iterates over the text deltas of one completion; `.output` holds the RequestOutput once it ends."""

    def __init__(self, deltas: Iterator[str]):
        self._deltas = deltas
        self.output: RequestOutput | None = None

    def __iter__(self) -> Iterator[str]:
        return self._deltas


def _prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise QuickdraftError("prompts must be a string, a dict with 'prompt' or 'prompt_token_ids', or a list of "
                              f"them; got {type(prompts).__name__}")
    if not prompts:
        raise QuickdraftError("no prompts given: pass at least one prompt")
    return list(prompts)


def _check_llm_arguments(model, seed, trust_remote_code, runner, max_model_len) -> None:
    if not isinstance(model, (str, nn.Module)):
        raise QuickdraftError("model must be an alias, a .gguf file, a directory, a hub id or a loaded transformers "
                              f"model; got {type(model).__name__}")
    if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool) and SEED_MIN <= seed <= SEED_MAX):
        raise QuickdraftError(f"seed must be an integer in [-2**63, 2**64 - 1] or None, got {seed!r}")
    if not isinstance(trust_remote_code, bool):
        raise QuickdraftError(f"trust_remote_code must be true or false, got {trust_remote_code!r}")
    if runner not in RUNNERS:
        raise QuickdraftError(f"unknown runner {runner!r}; use one of {', '.join(RUNNERS)}")
    if max_model_len is not None and not (isinstance(max_model_len, int) and not isinstance(max_model_len, bool)
                                          and max_model_len >= 2):
        raise QuickdraftError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")


def freeze_loaded_objects() -> None:
    """For a process that holds its LLM for its whole life (a server, a Ray replica, a batch job): every object
    alive now (the models' ~400,000 Python objects) leaves the garbage collector's generations (gc.freeze, after a
    collection), so that its full collections while decoding no longer traverse them (vLLM freezes after start-up
    too). Measured on the Qwen2.5-Coder pair, greedy draft_model, 4 prompts x 3 rounds interleaved: 1.037x tok/s
    (benchmarks/RESULTS.md, session 19). Not done by LLM() itself: a process that makes and drops many LLMs (tests)
    would keep their cyclic garbage for good."""
    gc.collect()
    gc.freeze()


class LLM:
    """A target model with a speculative draft.

    model: an alias (smollm2-135m, gemma3-270m), a .gguf file, a model directory, a hub id, or a loaded
        transformers model (then pass `tokenizer` too, or drive it with prompt_token_ids).
    speculative_config: {"method": one of {methods}, "num_speculative_tokens": K, "adaptive": True,
        "model": ..., "num_layers": ..., "quantization": "int8", "prompt_lookup_min": ...,
        "prompt_lookup_max": ...} (see SpeculativeConfig), or a JSON file of one.
    speculative_model / num_speculative_tokens: shorthand for method draft_model.
    dtype: auto (bf16 on CUDA and on CPUs with native bf16, else float32; a model object keeps its own),
        float32, bfloat16, float16.
    runner: auto (quickdraft's native decoder for Llama-family and Gemma 3 models, transformers otherwise),
        native, or hf (always the transformers forward).
    max_num_seqs / max_num_batched_tokens: continuous batching limits (sequences per step, new target rows per
        step). kv_cache_memory: a KV budget in bytes or a fraction of free memory (None: unbounded).
    enable_prefix_caching: keep full blocks of KV by their token prefix and copy them into later requests that
        start alike (None: on where the target computes rows alike whatever the batch, so reuse is exact).
    """

    def __init__(
        self,
        model: str | nn.Module = loader.DEFAULT_MODEL,
        *,
        tokenizer: Any = None,
        speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
        speculative_model: str | nn.Module | None = None,
        num_speculative_tokens: int | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        seed: int | None = None,
        trust_remote_code: bool = False,
        max_model_len: int | None = None,
        runner: str = "auto",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 4096,
        kv_cache_memory: int | float | None = None,
        enable_prefix_caching: bool | None = None,
    ):
        _check_llm_arguments(model, seed, trust_remote_code, runner, max_model_len)
        if enable_prefix_caching is not None and not isinstance(enable_prefix_caching, bool):
            raise QuickdraftError(f"enable_prefix_caching must be true, false or None (auto), got {enable_prefix_caching!r}")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise QuickdraftError(f"{name} must be an integer >= 1, got {value!r}")
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        kv.check_budget(kv_cache_memory)  # before anything loads
        self.device = loader.resolve_device(device)
        if isinstance(model, nn.Module) and isinstance(dtype, str) and dtype == "auto":
            self.dtype = next(model.parameters()).dtype  # a model object keeps its dtype unless told otherwise
        else:
            self.dtype = loader.resolve_dtype(dtype, self.device)
        # dtype "auto" keeps a GGUF model's stored precision (its quantized blocks) where the CPU kernels run;
        # a named dtype widens every weight to it.
        self.keep_quantized = isinstance(dtype, str) and dtype == "auto"
        self.runner_kind = runner
        self.trust_remote_code = trust_remote_code
        if isinstance(speculative_config, (str, os.PathLike)):
            speculative_config = read_config(speculative_config)
        if speculative_config is not None and not isinstance(speculative_config, (dict, SpeculativeConfig)):
            raise QuickdraftError("speculative_config must be a dict or a JSON file, got "
                                  f"{type(speculative_config).__name__}")
        config = dict(speculative_config or {}) if not isinstance(speculative_config, SpeculativeConfig) \
            else speculative_config
        if speculative_model is not None or num_speculative_tokens is not None:
            if speculative_config is not None:
                raise QuickdraftError("pass either speculative_config or speculative_model/num_speculative_tokens, "
                                      "not both")
            if speculative_model is not None:
                config.setdefault("method", "draft_model")
                config["model"] = speculative_model
            if num_speculative_tokens is not None:
                config["num_speculative_tokens"] = num_speculative_tokens
        self.speculative_config = SpeculativeConfig.from_dict(config)

        self.model_name, target_model, self.tokenizer, self.source, quantized = self._load(model, tokenizer)
        self.target = make_runner(target_model, self.model_name, runner, quantized)
        self.proposer = self._build_proposer(self.speculative_config)
        eos = self._eos_token_ids(target_model)
        self.engine = Engine(self.target, self.proposer, self.speculative_config.effective_k, eos, max_model_len,
                             adaptive_k=self.speculative_config.adaptive,
                             relaxed_threshold=self.speculative_config.relaxed_threshold,
                             tree=self.speculative_config.tree)
        # An LLM seed makes every request reproducible: a request without a seed of its own gets a noise key
        # from this generator, so its draws are position-keyed and do not depend on how many random numbers
        # speculation consumed (adaptive K changes that from run to run).
        self._seeded = seed is not None
        self._seed = seed
        self._seed_rng = random.Random(seed)
        # The KV cache budget in bytes (None: unbounded), measured after the models are loaded.
        self.kv_cache_memory = kv.resolve_budget(kv_cache_memory, self.device)
        if self.kv_cache_memory is not None and not kv.estimate(self.engine.kv_caches(),
                                                                 self.kv_cache_memory)["total_blocks"]:
            estimate = kv.estimate(self.engine.kv_caches(), None)
            raise QuickdraftError(f"kv_cache_memory of {self.kv_cache_memory} bytes holds no block of KV cache "
                                  f"(16 positions x {estimate['bytes_per_token']} bytes per token); give more")
        # Prefix caching by default only where a kept block holds exactly what a fresh prefill computes (the
        # target computes each row alike whatever the call: quickdraft's CPU kernels); elsewhere a reused
        # prefix could change a near-tie, so it is the user's choice.
        self.enable_prefix_caching = self.target.rows_invariant if enable_prefix_caching is None \
            else enable_prefix_caching
        self.kv_memory = kv.KVMemory(self.engine.kv_caches(), self.kv_cache_memory, self.enable_prefix_caching)
        self._grammar_tokenizer = None  # llguidance's form of the tokenizer, built by the first structured request

    def with_speculative_config(self, speculative_config: dict[str, Any] | SpeculativeConfig) -> "LLM":
        """An LLM with this one's target (its runner, weights and tokenizer shared, not copied) and another
        draft method: comparing methods on one model loads and packs it once."""
        other = copy.copy(self)
        other.speculative_config = SpeculativeConfig.from_dict(speculative_config)
        other.proposer = other._build_proposer(other.speculative_config)
        other.engine = Engine(self.target, other.proposer, other.speculative_config.effective_k,
                              self.engine.eos_token_ids, self.engine.max_len,
                              adaptive_k=other.speculative_config.adaptive,
                              relaxed_threshold=other.speculative_config.relaxed_threshold,
                              tree=other.speculative_config.tree)
        # Its own seed stream, started from this LLM's seed: the derived LLM draws as LLM(seed=...) with this
        # config would, and this one's stream is not advanced (LLM(seed=1).generate(p) gives the same text
        # before and after a with_speculative_config call; bench, check and tune make such calls).
        other._seed_rng = random.Random(self._seed)
        other.kv_memory = kv.KVMemory(other.engine.kv_caches(), other.kv_cache_memory, other.enable_prefix_caching)
        return other

    # --- construction -------------------------------------------------------------------------------------
    def _load(self, model: str | nn.Module, tokenizer: Any):
        """(name, model, tokenizer, source, quantized weights); source is None for a model object passed in,
        the quantized weights (a GGUF file's own blocks) None unless kept (see keep_quantized)."""
        if isinstance(model, nn.Module):
            return type(model).__name__, model.to(device=self.device, dtype=self.dtype).eval(), tokenizer, None, None
        source = loader.resolve(model)
        loaded, loaded_tokenizer, quantized = loader.load_for_runner(
            source, self.dtype, self.device, self.trust_remote_code, self.keep_quantized and self.runner_kind != "hf")
        return model, loaded, tokenizer if tokenizer is not None else loaded_tokenizer, source, quantized

    def _build_proposer(self, config: SpeculativeConfig) -> Proposer:
        return build_proposer(config, DraftContext(self.target, self._load_draft, self.tokenizer, self.model_name))

    def _load_draft(self, model: str | nn.Module, tokenizer: Any = None) -> LoadedDraft:
        """A draft model's runner and tokenizer (the draft proposer compares it with the target's)."""
        draft_name, draft_model, draft_tokenizer, _, quantized = self._load(model, tokenizer)
        return LoadedDraft(make_runner(draft_model, draft_name, self.runner_kind, quantized), draft_tokenizer,
                           draft_name)

    @staticmethod
    def _eos_token_ids(model: nn.Module) -> set[int]:
        ids: set[int] = set()
        for cfg in (getattr(model, "generation_config", None), model.config):
            eos = getattr(cfg, "eos_token_id", None)
            if eos is not None:
                ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return ids

    # --- prompts -----------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                    raise QuickdraftError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise QuickdraftError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if not isinstance(prompt, str):
            raise QuickdraftError(f"a prompt is a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")
        if not prompt.strip():
            raise QuickdraftError("the prompt is empty; give some text to continue")
        if self.tokenizer is None:
            raise QuickdraftError(f"model '{self.model_name}' has no tokenizer; pass {{'prompt_token_ids': [...]}}")
        return prompt, self.tokenizer(prompt)["input_ids"]

    def apply_chat_template(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as the model's chat template writes it, ending where the assistant's reply starts;
        `tools` (OpenAI's function definitions) are given to the template, which must render them."""
        if self.tokenizer is None:
            raise QuickdraftError(f"model '{self.model_name}' has no tokenizer, so no chat template")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise QuickdraftError(
                f"model '{self.model_name}' has no chat template (it is a base model); use generate() with a plain "
                "prompt (CLI: drop --chat), or pass chat_template=...")
        if not messages or not all(isinstance(m, dict) and "role" in m and ("content" in m or "tool_calls" in m)
                                   for m in messages):
            raise QuickdraftError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        text = self.tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                                  add_generation_prompt=True, tools=tools or None)
        if tools and text == self.tokenizer.apply_chat_template(messages, chat_template=chat_template,
                                                                tokenize=False, add_generation_prompt=True):
            raise QuickdraftError(f"tools: the chat template of model '{self.model_name}' does not render tools (it "
                                  "writes the same prompt with and without them); use a model whose template takes "
                                  "tools (e.g. Qwen2.5), or pass chat_template=...")
        return text

    def _generator(self, params: SamplingParams) -> torch.Generator:
        seed = derive_key(params.seed) if params.seed is not None else self._seed_rng.getrandbits(63)
        return torch.Generator(device=self.device).manual_seed(seed)

    def _noise_keys(self, params: SamplingParams) -> list[int | None]:
        """One position-noise key per completion, or None (rejection sampling) where nothing is seeded."""
        if params.seed is not None:
            request_key = params.seed
        elif self._seeded:
            request_key = self._seed_rng.getrandbits(64)
        else:
            return [None] * params.n
        return [derive_key(request_key, index) for index in range(params.n)]

    # --- generation --------------------------------------------------------------------------------------
    def _sequence_setups(self, params: SamplingParams) -> list[SequenceSetup]:
        """What each of a request's n completions draws with (the scheduler makes the sequences). A request's own
        seed (or the LLM's) makes its text reproducible with or without speculation and whatever K
        (position-keyed noise); without one, verification is rejection sampling from the request's generator."""
        grammar = self._grammar(params)  # first: a constraint that does not compile draws no seeds
        generator = self._generator(params)
        return [SequenceSetup(generator, noise_key, None if grammar is None else grammar if index == 0 else grammar.copy())
                for index, noise_key in enumerate(self._noise_keys(params))]

    def _grammar(self, params: SamplingParams) -> structured.GrammarState | None:
        """The request's structured-outputs constraint compiled against this model's tokenizer (whose
        llguidance form is built once per LLM), or None."""
        if params.structured_outputs is None:
            return None
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = structured.grammar_tokenizer(self.tokenizer, self.target.vocab_size,
                                                                   self.engine.eos_token_ids)
        matcher = structured.compile_matcher(self._grammar_tokenizer, params.structured_outputs)
        state = structured.GrammarState(matcher, self.target.vocab_size)
        if state.stopped([]):
            raise QuickdraftError("structured_outputs: the constraint allows no token of this model's vocabulary "
                                  "to start with; check it against the model's tokens")
        return state

    def new_scheduler(self, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None) -> Scheduler:
        """A continuous-batching scheduler on this LLM's engine (what generate uses, and what a server drives):
        `add_request(request_id, prompt_ids, params)`, `step()`, `abort_request(request_id)`."""
        return Scheduler(self.engine, self.tokenizer, max_num_seqs or self.max_num_seqs,
                         max_num_batched_tokens or self.max_num_batched_tokens, self._sequence_setups,
                         memory=self.kv_memory)

    def kv_cache_estimate(self) -> dict[str, Any]:
        """The KV cache before running: bytes per token (target, plus a draft model's own caches: layers x
        kv_heads x head_dim x 2 x dtype size each), and with kv_cache_memory the budget in bytes, its blocks of
        16 positions and the tokens they hold (each scheduler gets this budget)."""
        return kv.estimate(self.engine.kv_caches(), getattr(self, "kv_cache_memory", None))

    def _output(self, text: str | None, prompt_ids: list[int], request: Request) -> RequestOutput:
        completions = []
        for index, (seq, detok) in enumerate(zip(request.sequences, request.detokenizers)):
            logprobs = self.decode_logprobs(seq.logprobs)
            cumulative = sum(entry[t].logprob for entry, t in zip(logprobs, seq.output_ids)) \
                if logprobs is not None else None
            completions.append(CompletionOutput(index, detok.text, list(seq.output_ids), seq.finish_reason,
                                                cumulative, logprobs))
        first = request.sequences[0]
        return RequestOutput(request.request_id, text, prompt_ids, completions,
                             RequestMetrics.combine([seq.metrics for seq in request.sequences], concurrent=True),
                             prompt_logprobs=self.decode_logprobs(first.prompt_logprobs))

    def decode_logprobs(self, positions: list[PositionLogprobs | None] | None) -> list[PositionLogprobs | None] | None:
        """Fill each Logprob's decoded_token (the token's own text) where there is a tokenizer."""
        if positions is None or self.tokenizer is None:
            return positions
        ids = sorted({t for entry in positions if entry for t in entry})
        texts = dict(zip(ids, self.tokenizer.batch_decode([[t] for t in ids])))
        for entry in positions:
            for token_id, logprob in (entry or {}).items():
                logprob.decoded_token = texts[token_id]
        return positions

    def _run(self, prompt: Prompt, params: SamplingParams, request_id: str) -> Iterator[str]:
        """Generate all n completions of one request, yielding the first completion's text deltas; returns the
        RequestOutput."""
        text, prompt_ids = self._prompt_ids(prompt)
        scheduler = self.new_scheduler()
        request = scheduler.add_request(request_id, prompt_ids, params)
        try:
            while scheduler.has_unfinished():
                for update in scheduler.step():
                    if update.index == 0 and update.text_delta:
                        yield update.text_delta
        finally:
            scheduler.abort_request(request_id)  # a stream abandoned midway frees its caches at once
        return self._output(text, prompt_ids, request)

    def generate(self, prompts: Prompt | Iterable[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt together (continuous batching: up to max_num_seqs sequences per step);
        one SamplingParams for all, or one per prompt. Outputs come back in input order, each exactly what its
        prompt gives alone."""
        prompts = _prompt_list(prompts)
        params_list = self._params_list(sampling_params, len(prompts))
        prepared = [(*self._prompt_ids(p), sp) for p, sp in zip(prompts, params_list)]  # all checked first
        scheduler = self.new_scheduler()
        requests = [scheduler.add_request(str(i), ids, sp) for i, (_, ids, sp) in enumerate(prepared)]
        while scheduler.has_unfinished():
            scheduler.step()
        return [self._output(text, ids, request) for (text, ids, _), request in zip(prepared, requests)]

    @staticmethod
    def _params_list(sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if not isinstance(sampling_params, (list, tuple)) or not all(
                isinstance(sp, SamplingParams) for sp in sampling_params):
            raise QuickdraftError("sampling_params must be a SamplingParams or a list of them (one per prompt), "
                                  f"got {type(sampling_params).__name__}")
        params_list = list(sampling_params)
        if len(params_list) != count:
            raise QuickdraftError(f"got {len(params_list)} SamplingParams for {count} prompts")
        return params_list

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             chat_template: str | None = None, tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations, through the chat template (with
        `tools`, OpenAI's function definitions, where the template renders them)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise QuickdraftError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts, or a "
                                  f"list of such lists; got {type(messages).__name__}")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c, chat_template, tools) for c in conversations]
        return self.generate(prompts, sampling_params)

    def chat_prompt(self, messages, chat_template=None, tools=None) -> dict[str, Any]:
        """A conversation as a prompt dict (text and token ids) through the chat template."""
        text = self.apply_chat_template(messages, chat_template, tools)
        # The template already holds the special tokens; tokenizing must not add a second BOS.
        return {"prompt": text, "prompt_token_ids": self.tokenizer(text, add_special_tokens=False)["input_ids"]}

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> TextStream:
        """Text deltas of the first completion as they are generated; `.output` once the iteration ends."""
        if isinstance(prompt, (list, tuple)):
            raise QuickdraftError("stream takes one prompt (a string or a dict), not a list; use generate for many")
        gen = self._run(prompt, self._params_list(sampling_params, 1)[0], "0")
        stream = TextStream(iter(()))

        def deltas() -> Iterator[str]:
            stream.output = yield from gen

        stream._deltas = deltas()
        return stream

    def stream_chat(self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None,
                    chat_template: str | None = None) -> TextStream:
        return self.stream(self.chat_prompt(messages, chat_template), sampling_params)


# The methods the docstring lists come from the draft registry, so that it names every one.
LLM.__doc__ = LLM.__doc__.replace("{methods}", "|".join(f'"{method}"' for method in METHODS))
