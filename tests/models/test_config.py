"""get_text_config (models/config.py): the decoder's config of flat and nested (multimodal) configs."""

from types import SimpleNamespace

from transformers import Gemma3Config, LlamaConfig

from quickdraft.models.config import get_text_config


def test_a_nested_config_gives_its_decoder_and_a_flat_one_itself():
    nested = Gemma3Config(text_config={"hidden_size": 48, "num_hidden_layers": 2})
    text = get_text_config(nested)
    assert text is nested.text_config and text.hidden_size == 48 and text.model_type == "gemma3_text"
    flat = LlamaConfig(hidden_size=32, num_attention_heads=4)
    assert get_text_config(flat) is flat
    older = SimpleNamespace(hidden_size=32)  # a config from before get_text_config
    assert get_text_config(older) is older
