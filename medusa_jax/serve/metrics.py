"""The server's Prometheus metrics (prometheus-client), named as vLLM names them so that existing
dashboards read them: requests running and waiting, the KV cache's usage (``kv_cache_usage_perc``),
prompt and generated tokens, prefix-cache queries
and hits (in tokens), finished requests by reason, preemptions (none: a row is never taken from a
request), time to first token, inter-token latency and end-to-end latency histograms, each request's
prompt and generated tokens and its queue, prefill and decode time, and the speculation counters
``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and
``..._num_accepted_tokens_per_pos`` (vLLM's spec-decode metrics).
The counters are read from the engine's own statistics at each scrape (`EngineCollector`)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

#: vLLM's ``finished_reason`` label of the engine's reasons (`engine.engine.Finished.reason`): an
#: answer ended by EOS or a stop string is "stop", by its budget or the cache "length", a request
#: cancelled (its client left, the server shut down) "abort"; "error" keeps its name.
FINISHED_REASON = {"eos": "stop", "stop": "stop", "length": "length", "cache_full": "length", "cancelled": "abort"}

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class EngineCollector:
    """Counters and gauges from `engine.engine.Engine.stats` (monotonic) and its queue, at scrape time."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model = engine, model_name

    def collect(self):
        e, st, labels = self.engine, self.engine.stats, ["model_name"]
        gauge = GaugeMetricFamily("vllm:num_requests_running", "Requests in the batch now.", labels=labels)
        gauge.add_metric([self.model], e.live)
        yield gauge
        gauge = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting for a row.", labels=labels)
        gauge.add_metric([self.model], e.waiting)
        yield gauge
        gauge = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  labels=labels)
        gauge.add_metric([self.model], e.kv_cache_usage)
        yield gauge
        for name, doc, value in (
                ("vllm:prompt_tokens", "Prompt tokens of the requests admitted.", st["prompt_tokens"]),
                ("vllm:generation_tokens", "Tokens generated.", st["tokens"]),
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", st["prompt_tokens"]),
                ("vllm:prefix_cache_hits", "Prompt tokens whose KV cache was reused.", st["reused_tokens"]),
                ("vllm:spec_decode_num_drafts", "Row-steps that verified a draft.", st["drafts"]),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", st["draft_tokens"]),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", st["accepted_tokens"]),
                ("vllm:num_preemptions", "Requests preempted (never: a request keeps its row to the end).", 0)):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self.model], value)
            yield c
        c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted, by position in the draft.", labels=labels + ["position"])
        for pos, value in enumerate(st["accepted_per_pos"]):
            c.add_metric([self.model, str(pos)], value)
        yield c
        c = CounterMetricFamily("vllm:request_success", "Finished requests, by finish reason.",
                                labels=labels + ["finished_reason"])
        by_reason: dict = {}
        for reason, value in st["finished"].items():
            label = FINISHED_REASON.get(reason, reason)
            by_reason[label] = by_reason.get(label, 0) + value
        for label, value in by_reason.items():
            c.add_metric([self.model, label], value)
        yield c


def token_buckets(max_len: int) -> tuple:
    """vLLM's 1-2-5 buckets for token counts, up to `max_len` (``build_1_2_5_buckets``)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Metrics:
    """The registry of one server: the engine's counters and the histograms the server observes
    (`observe_first_token`, `observe_tokens`, `observe_end`)."""

    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        self.model = model_name
        hist = lambda name, doc: Histogram(name, doc, ["model_name"], registry=self.registry,  # noqa: E731
                                           buckets=_LATENCY_BUCKETS)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time from the request to its first token.")
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between two output tokens of a request.")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Time from the request to its last token.")
        self.queue = hist("vllm:request_queue_time_seconds", "Time a request waited before its prefill began.")
        self.prefill = hist("vllm:request_prefill_time_seconds", "Compute time of a request's prefill.")
        self.decode = hist("vllm:request_decode_time_seconds", "Compute time of the steps a request took part in.")
        tokens = lambda name, doc: Histogram(name, doc, ["model_name"], registry=self.registry,  # noqa: E731
                                             buckets=token_buckets(engine.max_len))
        self.prompt_tokens = tokens("vllm:request_prompt_tokens", "Prompt tokens of a finished request.")
        self.generation_tokens = tokens("vllm:request_generation_tokens", "Tokens generated for a finished request.")

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model).observe(seconds)

    def observe_tokens(self, seconds: float, n: int) -> None:
        """`n` tokens arrived `seconds` after the previous ones: n inter-token latencies of seconds / n."""
        per = seconds / max(n, 1)
        h = self.itl.labels(self.model)
        for _ in range(n):
            h.observe(per)

    def observe_end(self, seconds: float, fins=()) -> None:
        """A request ended `seconds` after it came; `fins`: its choices' `decoding.requests.Finished`
        (each an engine request, as vLLM counts ``n`` choices)."""
        self.e2e.labels(self.model).observe(seconds)
        for f in fins:
            self.prompt_tokens.labels(self.model).observe(f.prompt_tokens)
            self.generation_tokens.labels(self.model).observe(len(f.tokens))
            self.queue.labels(self.model).observe(f.queue_s)
            self.prefill.labels(self.model).observe(f.prefill_s)
            self.decode.labels(self.model).observe(f.decode_s)
