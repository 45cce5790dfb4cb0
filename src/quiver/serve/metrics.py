"""What `GET /metrics` reports, in Prometheus's text format (prometheus_client), one registry per server."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_FILL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """Requests by route and status, tokens, queue and batch, adapter loads, time to first token and
    between tokens."""

    def __init__(self, waiting: Callable[[], float], running: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("quiver_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("quiver_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("quiver_generated_tokens", "Tokens generated", registry=r)
        self.adapter_loads = Counter("quiver_adapter_loads", "Adapter slots filled for a request", registry=r)
        Gauge("quiver_queue_length", "Requests waiting for the scheduler", registry=r).set_function(waiting)
        Gauge("quiver_batch_size", "Sequences in the running batch", registry=r).set_function(running)
        self.decode_steps = Counter("quiver_decode_steps", "Decode steps by their rows (sequences decoded together)",
                                    ["rows"], registry=r)  # fmt: skip
        self.adapter_routed = Counter("quiver_adapter_requests", "Requests for an adapter, by whether the replica "
                                      "that ran them held it already (Ray Serve's multiplexing)", ["held"],
                                      registry=r)  # fmt: skip
        self.adapter_fill = Histogram("quiver_adapter_slot_fill_seconds", "Filling an adapter slot from its sections",
                                      buckets=_FILL_BUCKETS, registry=r)  # fmt: skip
        self.first_token = Histogram("quiver_time_to_first_token_seconds", "From arrival to the first token",
                                     buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.between_tokens = Histogram("quiver_inter_token_latency_seconds", "Between two tokens of a stream",
                                        buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip

    def watch_prefixes(self, hits: Callable[[], float], reused: Callable[[], float], held: Callable[[], float]) -> None:
        """The prefix cache's hits, the prompt tokens they spared, and the bytes it holds (read when scraped)."""
        r = self.registry
        Gauge("quiver_prefix_cache_hits", "Prompts that began as a kept prefix (since start)", registry=r).set_function(
            hits
        )
        Gauge("quiver_prefix_cache_reused_tokens", "Prompt tokens taken from kept prefixes (since start)",
              registry=r).set_function(reused)  # fmt: skip
        Gauge("quiver_prefix_cache_bytes", "Cache rows the prefix cache holds", registry=r).set_function(held)

    def text(self) -> bytes:
        return bytes(generate_latest(self.registry))
