"""Prometheus metrics of swarmnode: every metric name the API server and the nodes export, in one place.

Two registries, so that each process exports only its own metrics: `API_REGISTRY` (served at `/metrics`
by `swarmnode api`) and `NODE_REGISTRY` (served by `swarmnode join --metrics-port N`). Gauges whose value
lives elsewhere (open sessions, cache use, bans) are bound to a callback with `bind_*` once the owning
object exists; until then they read 0.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# latencies of one decode step / one token: from a millisecond on a GPU to seconds on a slow swarm
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# --- the API server (`swarmnode api`) ----------------------------------------------------------------------
API_REGISTRY = CollectorRegistry(auto_describe=True)

API_REQUESTS = Counter("swarmnode_api_requests", "HTTP requests to the OpenAI-compatible API, by endpoint and "
                       "status code", ["endpoint", "status"], registry=API_REGISTRY)
API_PROMPT_TOKENS = Counter("swarmnode_api_prompt_tokens", "Prompt tokens of the generations run",
                            registry=API_REGISTRY)
API_TOKENS_GENERATED = Counter("swarmnode_api_tokens_generated", "Tokens generated through the swarm",
                               registry=API_REGISTRY)
API_TIME_PER_TOKEN = Histogram("swarmnode_api_time_per_token_seconds", "Seconds between consecutive generated "
                               "tokens (decode steps through the swarm)", buckets=_LATENCY_BUCKETS,
                               registry=API_REGISTRY)
API_TIME_TO_FIRST_TOKEN = Histogram("swarmnode_api_time_to_first_token_seconds", "Seconds from the request "
                                    "to its first generated token", buckets=_LATENCY_BUCKETS, registry=API_REGISTRY)
API_ACTIVE_SESSIONS = Gauge("swarmnode_api_active_sessions", "Generations running now (one inference session each)",
                            registry=API_REGISTRY)
API_KEY_REQUESTS = Counter("swarmnode_api_key_requests", "Requests to /v1/ by API key name (`api.keys`; '-': no "
                           "valid key) and status code", ["key", "status"], registry=API_REGISTRY)
API_KEY_TOKENS = Counter("swarmnode_api_key_tokens", "Tokens by API key name and kind (prompt, completion)",
                         ["key", "kind"], registry=API_REGISTRY)
API_KEY_SESSIONS = Gauge("swarmnode_api_key_sessions", "Generations running now, by API key name", ["key"],
                         registry=API_REGISTRY)
API_CANCELLED = Counter("swarmnode_api_cancelled", "Generations stopped because the HTTP client went away",
                        registry=API_REGISTRY)
API_RETRIES = Counter("swarmnode_api_session_retries", "Failed hop attempts that sessions retried on other peers",
                      registry=API_REGISTRY)
API_BANNED_PEERS = Gauge("swarmnode_api_banned_peers", "Peers the client bans now (after failures)",
                         registry=API_REGISTRY)

# --- a node (`swarmnode join --metrics-port N`) ------------------------------------------------------------
NODE_REGISTRY = CollectorRegistry(auto_describe=True)

NODE_SESSIONS_OPEN = Gauge("swarmnode_node_sessions_open", "Inference sessions open on this node",
                           registry=NODE_REGISTRY)
NODE_SESSIONS = Counter("swarmnode_node_sessions", "Inference sessions opened on this node", registry=NODE_REGISTRY)
NODE_TOKENS_PROCESSED = Counter("swarmnode_node_tokens_processed", "Tokens (batch x length) run through this "
                                "node's blocks, by kind of request", ["kind"], registry=NODE_REGISTRY)
NODE_STEP_LATENCY = Histogram("swarmnode_node_step_latency_seconds", "Seconds one inference step or forward took "
                              "on this node, queueing included", ["kind"], buckets=_LATENCY_BUCKETS,
                              registry=NODE_REGISTRY)
NODE_DECODE_WAIT_TOKENS = Histogram("swarmnode_node_decode_wait_tokens", "Prompt tokens (positions) of other "
                                    "sessions' prompts a decode step waited behind, from its arrival to its run "
                                    "(chunked prefill holds it for at most one chunk of a session's prompt, --prefill-chunk tokens; a "
                                    "stateless forward runs whole)",
                                    buckets=(0, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 32768),
                                    registry=NODE_REGISTRY)
NODE_CACHE_TOKENS_USED = Gauge("swarmnode_node_cache_tokens_used", "KV-cache tokens reserved by open sessions",
                               registry=NODE_REGISTRY)
NODE_CACHE_TOKENS_TOTAL = Gauge("swarmnode_node_cache_tokens_total", "KV-cache budget of this node, in tokens",
                                registry=NODE_REGISTRY)
NODE_PLACEMENT_VERSION = Gauge("swarmnode_node_placement_version", "Version of the placement this node follows "
                               "(-1: none, e.g. a manual --blocks node)", registry=NODE_REGISTRY)
NODE_REQUESTS_REFUSED = Counter("swarmnode_node_requests_refused", "Requests this node refused (invalid or "
                                "over its limits)", registry=NODE_REGISTRY)
NODE_PLACEMENT_VERSION.set(-1)


def _safe(fn: Callable[[], float]) -> Callable[[], float]:
    def read() -> float:
        try:
            return float(fn())
        except Exception:  # safe: a gauge read mid-change (a node still starting, a unit closing) reads as 0
            return 0.0

    return read


def bind_node(node) -> None:
    """Bind the node's gauges to its live state (`swarmnode.server.node.Node`)."""
    NODE_SESSIONS_OPEN.set_function(_safe(lambda: len(node.handler.sessions)))
    NODE_CACHE_TOKENS_TOTAL.set_function(_safe(lambda: sum(u.budget.tokens for u in node.units)))
    NODE_CACHE_TOKENS_USED.set_function(_safe(lambda: sum(u.budget.tokens - u.budget.free_tokens for u in node.units)))
    NODE_PLACEMENT_VERSION.set_function(
        _safe(lambda: -1 if node.placement_version is None else node.placement_version))


def bind_client(model) -> None:
    """Bind the API server's ban gauge to the client's view of the swarm."""
    API_BANNED_PEERS.set_function(_safe(lambda: len(model.swarm.banned())))


def start_node_metrics_server(port: int, host: str = "127.0.0.1") -> int:
    """Serve NODE_REGISTRY at http://host:port/metrics on a daemon thread; the bound port."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=NODE_REGISTRY)
    return server.server_address[1]
