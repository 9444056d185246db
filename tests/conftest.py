"""Shared fixtures: tiny random models of each supported family, and the packaged GGUF models."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine a second thread makes every
    forward many times slower: tests of tiny models use one (`pytestmark = pytest.mark.usefixtures(...)`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _sharpen(model):
    """Larger-than-default weights give peaked, varied distributions instead of near-uniform ones."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    return model


def tiny_llama(seed: int = 0, vocab_size: int = 32, layers: int = 4, max_len: int = 256, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None, **overrides)
    return _sharpen(LlamaForCausalLM(config).eval())


def tiny_gemma3(seed: int = 0, vocab_size: int = 32, layers: int = 4, sliding_window: int = 4, max_len: int = 256):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              max_position_embeddings=max_len, sliding_window=sliding_window,
                              layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                              eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return _sharpen(Gemma3ForCausalLM(config).eval())


def _kernel_sized(config_class, model_class, seed: int, layers: int, **overrides):
    """A tiny model of head_dim 16, the smallest shape quickdraft's CPU kernels take."""
    torch.manual_seed(seed)
    config = config_class(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          eos_token_id=None, bos_token_id=None, pad_token_id=None, **overrides)
    return _sharpen(model_class(config).eval())


def tiny_llama16(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _kernel_sized(LlamaConfig, LlamaForCausalLM, seed, layers=4)


def tiny_gemma16(seed: int = 0):
    """A Gemma 3 with a sliding window of 4."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return _kernel_sized(Gemma3TextConfig, Gemma3ForCausalLM, seed, layers=4, head_dim=16,
                         sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2)


def tiny_qwen2(seed: int = 0):
    """A Qwen2: q/k/v projections with biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _kernel_sized(Qwen2Config, Qwen2ForCausalLM, seed, layers=2)


def gguf_blocks_of(model, types=("Q4_0", "Q5_0", "Q4_1", "Q8_0")):
    """The model's own weights in GGUF blocks (gguf's quantizer), as models/gguf_weights would read them from a
    file: each layer's matrices in a different type, the embedding (tied head) in Q8_0."""
    import gguf
    import numpy as np

    from quickdraft.kernels import quant
    from quickdraft.models.gguf_weights import QuantizedWeights

    def blocks(weight, name):
        qtype = gguf.GGMLQuantizationType[name]
        raw = gguf.quants.quantize(weight.detach().float().numpy().astype(np.float32), qtype)
        return quant.pack(quant.decode(raw, int(qtype), weight.shape[1]))

    weights = QuantizedWeights("in-memory")
    roles = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    for i, layer in enumerate(model.model.layers):
        for j, (role, path) in enumerate(roles.items()):
            weights.layers[(i, role)] = blocks(layer.get_submodule(path).weight, types[(i + j) % len(types)])
    weights.embedding = blocks(model.model.embed_tokens.weight, "Q8_0")
    return weights


@pytest.fixture(scope="session")
def smollm2():
    """The packaged SmolLM2-135M-Instruct as a plain (non-speculative) LLM, float32 on CPU."""
    from quickdraft import LLM

    return LLM("smollm2-135m", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def gemma3():
    from quickdraft import LLM

    return LLM("gemma3-270m", dtype="float32", device="cpu")


def assert_greedy_equals_plain(llm, plain, prompts, params, batches=(1, 4)):
    """llm's outputs are plain's token for token at every batch size in `batches` (max_num_seqs), with drafts
    proposed; returns llm's outputs of the last batch size."""
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    for batch in batches:
        llm.max_num_seqs = batch
        out = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in out] == want, batch
    assert sum(o.metrics.proposed_tokens for o in out) > 0
    return out


def run_staggered(scheduler, prompts, params, abort_step: int, abort_id: str = "1", max_running: int = 3):
    """Drive `scheduler` with a new request (ids "0", "1", ...) every other step, abort request `abort_id` at step
    `abort_step` (a second abort of it is refused), never more than `max_running` running; returns each request's
    streamed tokens."""
    outputs: dict[str, list[int]] = {}
    added = steps = 0
    while added < len(prompts) or scheduler.has_unfinished():
        if added < len(prompts) and steps % 2 == 0:
            scheduler.add_request(str(added), prompts[added]["prompt_token_ids"], params[added])
            added += 1
        if steps == abort_step:
            assert scheduler.abort_request(abort_id)
            assert not scheduler.abort_request(abort_id)
        assert scheduler.num_running <= max_running
        for update in scheduler.step():
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        steps += 1
    return outputs


def recorded_graph_keys(runner) -> list:
    """The graph key of every forward a CUDA runner makes from now on, in order (its _run wrapped)."""
    keys = []
    original = runner._run

    def noting(step, embeds):
        keys.append(step.key())
        return original(step, embeds)

    runner._run = noting
    return keys
