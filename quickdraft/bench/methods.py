"""The methods a benchmark compares: quickdraft's draft methods and the baselines, one runner each behind one
interface, `generate(prompt_ids, max_new_tokens, temperature, seed) -> Generation`.

Every runner shares the one loaded target model (the same module object, dtype and threads); llama.cpp runs
the target's GGUF file itself.
"""

from __future__ import annotations

import importlib.util
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from quickdraft.bench.names import method_help
from quickdraft.drafts import SpeculativeConfig, method_class, parse_draft
from quickdraft.engine import RequestMetrics
from quickdraft.errors import QuickdraftError, TokenizerMismatchError
from quickdraft.models import loader
from quickdraft.models.hf import HFRunner
from quickdraft.params import SamplingParams

REFERENCES = ("none", "hf", "llamacpp")  # the baselines speedups are measured against
LLAMA_CPP_INSTALL = ("pip install 'quickdraft[bench]' (it compiles llama.cpp: several minutes; on CPUs with AMX set "
                     "CMAKE_ARGS as pyproject.toml says, or llama.cpp dies of SIGILL)")


@dataclass(frozen=True)
class MethodSpec:
    """One method as named on the command line.

    kind: quickdraft | hf | hf-lookup | hf-assist | llamacpp | llamacpp-lookup
    arg: quickdraft: the draft as --draft spells it (drafts.draft_help); hf-assist: the assistant model."""

    name: str
    kind: str
    arg: str | None = None

    @property
    def speculative(self) -> bool:
        """Whether it drafts tokens, so that K applies."""
        return self.name not in REFERENCES

    @property
    def is_quickdraft(self) -> bool:
        return self.kind == "quickdraft"


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def _check_model(model: str, method: str) -> None:
    try:
        loader.resolve(model)
    except QuickdraftError as exc:
        raise QuickdraftError(f"unknown method {method!r}: not one of {method_help()}, and not a model ({exc})") \
            from None


def parse_method(name: str) -> MethodSpec:
    """A baseline by its name, else a quickdraft draft as --draft spells it (the draft registry reads it)."""
    if name in ("hf", "hf-lookup"):
        return MethodSpec(name, name)
    if name.startswith("hf-assist:"):
        model = name.split(":", 1)[1]
        if not model:
            raise QuickdraftError("method 'hf-assist:' needs an assistant model, e.g. hf-assist:smollm2-135m")
        _check_model(model, name)
        return MethodSpec(name, "hf-assist", model)
    if name in ("llamacpp", "llamacpp-lookup"):
        if not llama_cpp_available():
            raise QuickdraftError(f"method {name!r} needs llama-cpp-python, which is not installed; install the "
                                  f"optional extra: {LLAMA_CPP_INSTALL}")
        return MethodSpec(name, name)
    config = parse_draft(name, 1)
    SpeculativeConfig.from_dict(config)  # its errors before any model loads
    if method_class(config["method"]).loads_draft_model:
        _check_model(config["model"], name)
    return MethodSpec(name, "quickdraft", name)


def parse_methods(text: str) -> list[MethodSpec]:
    """A comma list of methods; `none` (the reference) is added first when missing."""
    names = [n.strip() for n in str(text).split(",")]
    if not names or any(not n for n in names):
        raise QuickdraftError(f"--methods {text!r}: expected a comma list of methods ({method_help()})")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise QuickdraftError(f"--methods lists {', '.join(duplicates)} more than once")
    specs = [parse_method(n) for n in names]
    if "none" not in names:
        specs.insert(0, parse_method("none"))
    return specs


def parse_k_list(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, each >= 1)."""
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise QuickdraftError(f"--k {text!r}: expected a comma list of positive integers, e.g. 5 or 1,2,4,6,8")
    values = sorted({int(p) for p in parts})
    if len(values) != len(parts):
        raise QuickdraftError(f"--k {text!r} lists a value more than once")
    return values


@dataclass
class Generation:
    """One generation: the new tokens (EOS included when it ended there), its wall time, and quickdraft's
    metrics (None for the baselines)."""

    token_ids: list[int]
    seconds: float
    metrics: RequestMetrics | None = None


@dataclass
class Target:
    """The one loaded target model all methods share (through the reference LLM's runner)."""

    runner: HFRunner
    tokenizer: Any
    name: str
    source: loader.ModelSource | None  # None for a model object passed in
    eos_token_ids: set[int]
    _dequantized: nn.Module | None = field(default=None, repr=False)

    @property
    def model(self) -> nn.Module:
        """The transformers model (for the transformers baselines). A runner that keeps a GGUF model's
        quantized blocks has released the transformers copies of those weights: the baselines then get the
        dequantized model, loaded once here (transformers has no kernels for the quantized blocks)."""
        if self.runner.quantized_weights is None:
            return self.runner.model
        if self._dequantized is None:
            if self.source is None:
                raise QuickdraftError("the transformers baselines need the target's dequantized model")
            self._dequantized, _ = loader.load(self.source, self.runner.dtype, self.runner.device)
        return self._dequantized

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype


class Runner(ABC):
    """One method at one K."""

    def __init__(self, spec: MethodSpec, k: int | None, label: str):
        self.spec = spec
        self.k = k
        self.label = label

    @abstractmethod
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Generation:
        """Generate up to max_new_tokens after prompt_ids, stopping at EOS."""

    @property
    def proposer(self):
        """quickdraft's draft proposer for this method, or None (the baselines have none)."""
        return None


class QuickdraftRunner(Runner):
    """quickdraft's engine, driven directly: no per-step detokenization, like the baselines."""

    def __init__(self, spec: MethodSpec, k: int | None, label: str, llm, adaptive: bool = True):
        super().__init__(spec, k, label)
        self.llm = llm
        self.engine = llm.engine.with_k(k or 0, adaptive_k=adaptive)

    @property
    def proposer(self):
        return self.llm.proposer

    def generate(self, prompt_ids, max_new_tokens, temperature, seed) -> Generation:
        params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=seed)
        generator = torch.Generator(device=self.engine.device).manual_seed(seed)
        start = time.perf_counter()
        seq = self.engine.new_sequence(prompt_ids, params, generator)
        for _ in self.engine.run(seq):
            pass
        return Generation(list(seq.output_ids), time.perf_counter() - start, seq.metrics)


class TransformersRunner(Runner):
    """transformers' `generate` on the shared model: plain, with prompt lookup, or assisted by a model."""

    def __init__(self, spec: MethodSpec, k: int | None, label: str, target: Target, assistant: nn.Module | None = None):
        super().__init__(spec, k, label)
        self.target = target
        self.extra: dict[str, Any] = {}
        if spec.kind == "hf-lookup":
            self.extra["prompt_lookup_num_tokens"] = k
        elif spec.kind == "hf-assist":
            self.assistant = assistant
            self.extra["assistant_model"] = assistant

    def _config(self, max_new_tokens: int, temperature: float):
        from transformers import GenerationConfig

        eos = sorted(self.target.eos_token_ids)
        # Every field that changes the output is set, so that the model's own generation_config cannot add
        # penalties or top-k behind the comparison's back.
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
            else dict(do_sample=False)
        config = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0, num_beams=1,
                                  repetition_penalty=1.0, no_repeat_ngram_size=0, typical_p=1.0,
                                  eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0, **sampling)
        if self.spec.kind == "hf-lookup":
            config.prompt_lookup_num_tokens = self.k
        return config

    def generate(self, prompt_ids, max_new_tokens, temperature, seed) -> Generation:
        if self.spec.kind == "hf-assist":
            # transformers reads the draft length from the assistant's own generation config: a constant K.
            gc = self.assistant.generation_config
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = self.k, "constant"
            gc.assistant_confidence_threshold = 0.0
        config = self._config(max_new_tokens, temperature)
        kwargs = {"assistant_model": self.assistant} if self.spec.kind == "hf-assist" else {}
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.target.device)
        torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.target.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                             generation_config=config, **kwargs)
        seconds = time.perf_counter() - start
        return Generation(out[0, len(prompt_ids):].tolist(), seconds)


class LlamaCppRunner(Runner):
    """llama-cpp-python on the target's GGUF file (its quantized weights), plain or with prompt lookup."""

    # The longest dev-set prompts (~4K tokens) + new tokens + drafts; llama.cpp keeps logits for all of it with a draft.
    N_CTX = 4608

    def __init__(self, spec: MethodSpec, k: int | None, label: str, target: Target):
        super().__init__(spec, k, label)
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        gguf = target.source.gguf_path if target.source is not None else None
        if gguf is None:
            raise QuickdraftError(f"method {spec.name!r} runs llama.cpp on the target's GGUF file; model "
                                  f"'{target.name}' is not a GGUF (use an alias or a .gguf path)")
        draft = LlamaPromptLookupDecoding(num_pred_tokens=k) if spec.kind == "llamacpp-lookup" else None
        threads = torch.get_num_threads()
        # With a draft, llama-cpp-python keeps every position's logits but sizes that buffer by logits_all:
        # without logits_all=True it holds n_batch rows and a prompt longer than 512 tokens crashes it.
        self.llama = Llama(model_path=str(gguf), n_ctx=self.N_CTX, n_threads=threads, n_threads_batch=threads,
                           draft_model=draft, logits_all=draft is not None, verbose=False)
        self.eos = set(target.eos_token_ids) | {self.llama.token_eos()}

    def generate(self, prompt_ids, max_new_tokens, temperature, seed) -> Generation:
        # Prompt lookup evaluates up to K drafts past the last kept token: leave room for them.
        if len(prompt_ids) + max_new_tokens + (self.k or 0) + 1 > self.N_CTX:
            raise QuickdraftError(f"{self.label}: prompt of {len(prompt_ids)} tokens plus {max_new_tokens} new "
                                  f"tokens (and {self.k or 0} drafts) exceed llama.cpp's context of {self.N_CTX}")
        if temperature > 0:
            sampling = dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0)
            self.llama.set_seed(seed)
        else:
            sampling = dict(temp=0.0)
        tokens = []
        start = time.perf_counter()
        self.llama.reset()  # no prefix reuse from an earlier prompt: every method pays its full prefill
        for token in self.llama.generate(list(prompt_ids), repeat_penalty=1.0, **sampling):
            tokens.append(int(token))
            if token in self.eos or len(tokens) >= max_new_tokens:
                break
        return Generation(tokens, time.perf_counter() - start)


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    if target_tok is None or draft_tok is None:
        if (target_tok is None) != (draft_tok is None):
            raise TokenizerMismatchError(
                f"cannot check that draft '{draft_name}' shares the tokenizer of target '{target_name}': only one "
                "of them has a tokenizer; use a draft of the same family, or method ngram or layer_skip")
        return
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        differing = next((t for t, i in target_vocab.items() if draft_vocab.get(t) != i), None)
        raise TokenizerMismatchError(
            f"draft model '{draft_name}' has another tokenizer than target '{target_name}' "
            f"({len(draft_vocab)} vs {len(target_vocab)} tokens; first difference at token {differing!r}). "
            "transformers' assisted generation needs the target's tokenizer: use a smaller model of the same "
            "family (quickdraft's own draft_model method takes one with another tokenizer)")


def _with_tree(config: dict, tree: str | dict | None) -> dict:
    """A method's speculative_config with the bench's tree setting where its proposer proposes trees."""
    return {**config, "tree": tree} if tree is not None and method_class(config["method"]).proposes_trees else config


def _label(spec: MethodSpec, k: int, sweep: bool) -> str:
    return f"{spec.name} k={k}" if spec.speculative and sweep else spec.name


def build_runners(specs: Sequence[MethodSpec], ks: Sequence[int], target: Target, reference_llm,
                  adaptive: bool = True, tree: str | dict | None = None) -> list[Runner]:
    """One runner per method and K (baselines once); quickdraft methods share one LLM per method, all on the
    reference LLM's target runner. A K sweep runs each K fixed; a single K is the largest K of adaptive
    decoding unless adaptive is False. tree: speculative_config's "tree" for the quickdraft methods that
    propose trees (the others, and the reference, decode as without it)."""
    sweep = len(ks) > 1
    runners: list[Runner] = []
    for spec in specs:
        values = list(ks) if spec.speculative else [None]
        if spec.is_quickdraft:
            llm = reference_llm if spec.name == "none" else \
                reference_llm.with_speculative_config(_with_tree(parse_draft(spec.arg, ks[0]), tree))
            runners += [QuickdraftRunner(spec, k, _label(spec, k, sweep), llm, adaptive and not sweep) for k in values]
        elif spec.kind.startswith("hf"):
            assistant = None
            if spec.kind == "hf-assist":
                assistant, tokenizer = loader.load(loader.resolve(spec.arg), target.dtype, target.device)
                check_same_tokenizer(target.tokenizer, tokenizer, target.name, spec.arg)
            runners += [TransformersRunner(spec, k, _label(spec, k, sweep), target, assistant) for k in values]
        else:
            runners += [LlamaCppRunner(spec, k, _label(spec, k, sweep), target) for k in values]
    return runners
