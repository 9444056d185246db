"""The decoder's transformers config of a model: the one place that knows multimodal configs nest it."""

from __future__ import annotations


def get_text_config(config):
    """The text decoder's config within `config` (a transformers config): a multimodal model's (Gemma 3's
    vision-language config nests it) or the config itself. transformers releases before get_text_config have
    only flat configs, which are their own text config."""
    if hasattr(config, "get_text_config"):
        return config.get_text_config(decoder=True)
    return config
