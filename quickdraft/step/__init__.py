"""The engine's step split by concern: policy.py (how much a step drafts: adaptive K, tree sizing and calibration)
and verification.py (the batch's acceptance rules as tensors over a StepBatch); quickdraft/engine.py is the step
itself (propose, one target forward, verify, commit)."""
