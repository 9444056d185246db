"""The names this module held before the Runner protocol (models/base.py), the transformers runner
(models/hf.py) and the runner choice (models/factory.py) moved to their own modules; kept for users' imports.
Nothing in the package imports this module."""

from quickdraft.models.base import Runner, check_batch
from quickdraft.models.factory import RUNNERS, make_runner, quantized
from quickdraft.models.hf import HFRunner, truncated_view

__all__ = ["Runner", "check_batch", "HFRunner", "truncated_view", "RUNNERS", "make_runner", "quantized"]
