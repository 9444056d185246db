"""`quickdraft check`: is the speculative output really the target's, for this model, draft and sampling?

Two checks on the user's own prompts:

1. Greedy: speculative decoding and plain decoding (method none, the same loaded target) must give the same
   tokens. At the first divergence of a prompt the target's logits on the common prefix are computed afresh
   (penalised, as greedy decoding sees them): if the two tokens' logits both lie within a rounding tolerance
   of the largest (NEAR_TIE_ULPS x the runner dtype's eps x the logit's magnitude), the runs split at a
   numerical near-tie, which rounding alone can flip; otherwise the divergence is a defect.

2. Sampled: N samples of the first m tokens (default m = 4: the prompt's own step commits one token with no
   drafts, then a step verifies up to 2 drafts) are drawn through the engine (rejection sampling, driven with
   one seeded generator so that the check is reproducible; with a request seed, also the seeded path through
   LLM.generate) and compared with the exact law of plain sampling: the target's processed distributions
   (penalties, temperature, top-k, top-p, min-p, as sampling.process computes them) over a pruned tree of
   output prefixes, each prefix expanded by one target forward when its expected count is at least
   EXPAND_MIN_COUNT. Chi-square goodness of fit on several views of the samples (the law of y1, of y1..y2,
   ..., of y1..ym, and of the windows y2y3, y3y4, ...), each view's cells those of expected count >= 5 with
   the rest (and the prefixes the tree did not reach) pooled; prompts are strata (statistics and degrees of
   freedom summed); Bonferroni over every statistic. A prompt whose tree would exceed its share of the
   forward budget is compared with as many samples of plain decoding instead (a two-sample chi-square test).

The verdict FAILs on a greedy divergence that is not a near-tie, a p-value below the level, or a sampled
sequence of probability zero under the exact law (a token that top-k, top-p or min-p removes, or any token
after a prefix whose distribution the tree computed).

The package, imports pointing down: cli -> checking (check) -> greedy (the greedy comparison, near-ties),
samples (drawing through the engine), stats (chi-square tests) -> law (the exact law's prefix tree) and report
(the results and their rendering).
"""

from quickdraft.tools.check.checking import (DEFAULT_ALPHA, DEFAULT_CHECK_SEED, DEFAULT_MAX_FORWARDS,
                                             DEFAULT_MAX_TOKENS, DEFAULT_SAMPLE_TOKENS, DEFAULT_SAMPLES,
                                             DEFAULT_STAT_PROMPTS, DEFAULT_TEMPERATURE, check)
from quickdraft.tools.check.cli import add_parser, run, sampling_params_from_args, speculative_config_from_args
from quickdraft.tools.check.greedy import NEAR_TIE_ULPS, near_tie_tolerance
from quickdraft.tools.check.report import CheckReport, Divergence, GreedyResult, StatResult

__all__ = [
    "DEFAULT_ALPHA", "DEFAULT_CHECK_SEED", "DEFAULT_MAX_FORWARDS", "DEFAULT_MAX_TOKENS", "DEFAULT_SAMPLE_TOKENS",
    "DEFAULT_SAMPLES", "DEFAULT_STAT_PROMPTS", "DEFAULT_TEMPERATURE", "NEAR_TIE_ULPS",
    "CheckReport", "Divergence", "GreedyResult", "StatResult",
    "add_parser", "check", "near_tie_tolerance", "run", "sampling_params_from_args", "speculative_config_from_args",
]
