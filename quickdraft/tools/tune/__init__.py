"""`quickdraft tune` (quickdraft/tools/tune/): for the moment the whole tool is report.py, the old tools/tune.py
moved whole so that its history follows the file that keeps the most of it; the next commit splits it."""

from quickdraft.tools.tune.report import *  # noqa: F401,F403
