"""Errors that quickdraft raises for bad input.

Every message names the problem and what to do about it; the CLI prints it without a traceback.
"""


class QuickdraftError(ValueError):
    """Bad input or configuration, with a message that says how to fix it."""


class ModelNotFoundError(QuickdraftError):
    """A model id, alias or path could not be resolved."""


class TokenizerMismatchError(QuickdraftError):
    """A draft model does not share the target's tokenizer."""
