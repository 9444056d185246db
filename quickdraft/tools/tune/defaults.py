"""The defaults of `quickdraft tune`, its command line's and its functions' (a leaf: `quickdraft tune --help` shows
them without importing the modules that measure, which import torch)."""

DEFAULT_DRAFTS = "ngram,suffix"
DEFAULT_K_MAX = 8
DEFAULT_MAX_TOKENS = 128
