"""Prometheus metrics with vLLM's names (and its `model_name` label), fed by the engine thread.

Each app has its own CollectorRegistry, so several apps (tests) do not collide. Counting follows the
scheduler's metrics: spec-decode counts and generation tokens are added when a completion finishes, from
what it output (a draft cut by a stop string is not counted); request_success counts completions by finish
reason (stop, length, abort, error). The gauges are the scheduler's state after each engine iteration;
kv_cache_usage_perc is the fraction of the KV budget that requests hold (0 without a budget); blocks kept
only for prefix caching are evictable and count as free, as in vLLM. With a budget (a byte budget, or the CUDA
runner's paged pool, which always has one) quickdraft:kv_blocks{state} gives its blocks: total, used (held by
requests), cached (kept for their prefix, evictable) and free (free or cached: what an allocation can take); a
paged runner's forwards are counted by how they ran: quickdraft:graph_replays (a captured CUDA graph replayed),
quickdraft:eager_steps (run eagerly: a shape's first sighting, no graphs, or no bucket) and, of those,
quickdraft:unbucketed_steps (a step that fits no bucket of sequences or rows: a long prompt, over 64 sequences).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from quickdraft.scheduler import Request
from quickdraft.server.async_engine import EngineStats

# vLLM's buckets, with finer low ends: a CPU step of a small model takes milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0, 20.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0)


class ServerMetrics:
    """The server's Prometheus metrics; an EngineObserver (its methods run on the engine thread)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        # prometheus_client appends _total to counters: these are exposed as vllm:..._total.
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Drafting steps (steps that proposed tokens).")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position in the draft.", ("position",))
        self.tree_steps = counter("quickdraft:spec_decode_num_tree_steps", "Drafting steps that verified a token tree.")
        self.tree_path_lengths = counter("quickdraft:spec_decode_tree_path_length",
                                         "Token-tree steps, by the length of their accepted path.", ("length",))
        self.running = gauge("vllm:num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Sequences waiting to be admitted.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of the KV cache budget held by requests; "
                                                          "prefix-cached blocks are free (0 without a budget).")
        self.kv_blocks = Gauge("quickdraft:kv_blocks", "Blocks of the KV budget by state: total, used (held by "
                               "requests), cached (kept for their prefix, evictable), free (free or cached).",
                               labels + ["state"], registry=self.registry)
        self.runner_steps = {key: counter(f"quickdraft:{key}", doc) for key, doc in (
            ("graph_replays", "Forwards of a paged runner that replayed a captured CUDA graph."),
            ("eager_steps", "Forwards of a paged runner run eagerly (a shape's first sighting, no graphs, no bucket)."),
            ("unbucketed_steps", "Forwards of a paged runner that fit no bucket of sequences or rows (eager)."))}
        self._runner_seen: dict[str, int] = {}
        self.preemptions = counter("vllm:num_preemptions", "Sequences preempted for KV memory (recomputed later).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated (output).")
        self.request_success = counter("vllm:request_success", "Finished completions, by finish reason.",
                                       ("finished_reason",))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between steps that gave a sequence tokens (a speculative step may give several).",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to end.", E2E_BUCKETS)
        self._preemptions_seen = 0

    # --- EngineObserver -------------------------------------------------------------------------------------
    def on_iteration(self, stats: EngineStats) -> None:
        name = self.model_name
        self.running.labels(name).set(stats.num_running)
        self.waiting.labels(name).set(stats.num_waiting)
        usage = stats.kv_usage
        self.kv_usage.labels(name).set(usage["usage"] if usage else 0.0)
        if usage:
            for state, key in (("total", "total_blocks"), ("used", "request_blocks"), ("cached", "cached_blocks"),
                               ("free", "free_blocks")):
                self.kv_blocks.labels(name, state).set(usage.get(key, 0))
        for key, value in (stats.runner_metrics or {}).items():
            seen = self._runner_seen.get(key, 0)
            if key in self.runner_steps and value > seen:
                self.runner_steps[key].labels(name).inc(value - seen)
                self._runner_seen[key] = value
        if stats.num_preemptions > self._preemptions_seen:
            self.preemptions.labels(name).inc(stats.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.num_preemptions

    def on_token_latency(self, seconds: float, first: bool) -> None:
        (self.ttft if first else self.itl).labels(self.model_name).observe(max(0.0, seconds))

    def on_request_finished(self, request: Request, e2e_latency_s: float) -> None:
        name = self.model_name
        sequences = request.sequences
        self.prompt_tokens.labels(name).inc(len(sequences[0].prompt_ids))
        self.e2e.labels(name).observe(e2e_latency_s)
        for seq in sequences:
            metrics = seq.metrics
            self.generation_tokens.labels(name).inc(len(seq.output_ids))
            self.request_success.labels(name, seq.finish_reason or "abort").inc()
            if metrics.num_drafts:
                self.spec_drafts.labels(name).inc(metrics.num_drafts)
                self.spec_draft_tokens.labels(name).inc(metrics.proposed_tokens)
                self.spec_accepted_tokens.labels(name).inc(metrics.accepted_tokens)
            for position, accepted in enumerate(metrics.accepted_per_position):
                self.spec_accepted_per_pos.labels(name, str(position)).inc(accepted)
            if metrics.tree_steps:
                self.tree_steps.labels(name).inc(metrics.tree_steps)
                for length, steps in enumerate(metrics.accepted_path_lengths):
                    if steps:
                        self.tree_path_lengths.labels(name, str(length)).inc(steps)
