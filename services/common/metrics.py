"""Prometheus metrics of every service (one process, one registry).

Names follow Prometheus conventions: counters end in ``_total``, durations are
``_seconds``. docs/operations.md says what each one means.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import REGISTRY

from irisfed.shared.errors import ConfigError

# router
SUBMITS = Counter("irisfed_submits_total", "Jobs created by submits, by disposition", ["disposition"])
SUBMIT_DUPLICATES = Counter("irisfed_submit_duplicates_total", "Resubmissions answered with the original reply")
SUBMIT_ERRORS = Counter("irisfed_submit_errors_total", "Submit requests answered with an error", ["code"])
SUBMIT_ACK = Histogram(
    "irisfed_submit_ack_seconds", "From receiving a submit to replying after commit",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
SUBMIT_BATCH = Histogram(
    "irisfed_submit_batch_jobs", "Submits committed per group-commit transaction",
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
)
CANCELS = Counter("irisfed_cancels_total", "Cancel requests, by outcome", ["outcome"])
SUBMIT_SHED = Counter(
    "irisfed_submit_shed_total",
    "Submits answered unavailable without a commit attempt: queue_full, or expired (waited too long for a writer)",
    ["reason"],
)
ROUTER_QUEUE = Gauge("irisfed_router_queue_depth", "Submits waiting for a group-commit writer")

# tick
ASSIGNMENTS = Counter("irisfed_assignments_total", "Jobs assigned to a peer by the tick")
PREEMPTIONS = Counter("irisfed_preemptions_total",
                      "Live jobs preempted for a job of a higher band, by what became of them", ["result"])
FAILOVERS = Counter("irisfed_failovers_total", "Live jobs recovered from lost peers or agents, by result", ["result"])
UNSCHEDULABLE = Counter("irisfed_unschedulable_total", "Queued jobs that passed their deadline")
TICK_SECONDS = Histogram("irisfed_tick_duration_seconds", "Duration of one tick run")
QUEUE_DEPTH = Gauge("irisfed_queue_depth", "Queued jobs by pin and constraint class", ["pinned_peer", "constraints"])
TICK_PASSES = Counter("irisfed_tick_passes_total",
                      "Tick runs, by kind (full: deadlines, lost peers and placement; place: placement only)",
                      ["kind"])
TICK_WAKEUPS_FROM_HEARTBEATS = Counter(
    "irisfed_tick_heartbeat_wakeups_total",
    "Heartbeats that woke the tick (a peer appeared or came back, changed shape or freed slots)")

# peer agent
FENCED_WRITES = Counter("irisfed_fenced_writes_total", "Status writes refused because the epoch moved on")
STALE_COPIES_KILLED = Counter("irisfed_stale_copies_killed_total", "Local runs killed because their epoch went stale")
RUNS_ADOPTED = Counter("irisfed_runs_adopted_total", "Runs an earlier agent run launched that this one followed to their end")
JOBS_FINISHED = Counter("irisfed_jobs_finished_total", "Jobs this agent finished, by final state", ["state"])
RUNNING_JOBS = Gauge("irisfed_agent_running_jobs", "Jobs this agent is running now")
AGENT_REPORT_ERRORS = Counter(
    "irisfed_agent_report_errors_total",
    "Status writes an agent set aside after a permanent database error (not retried), by what it "
    "was writing (finish, launch_error, stale_copy, orphan)", ["kind"])

# router and tick
HEARTBEATS_DROPPED = Counter(
    "irisfed_heartbeats_dropped_total",
    "Heartbeats dropped, by reason (subject_mismatch: the body names another peer than its subject; "
    "unknown_peer: not in the configuration; malformed: undecodable)", ["reason"])

# every service
NATS_RECONNECTS = Counter("irisfed_nats_reconnects_total", "Reconnections to NATS")
DB_UNAVAILABLE = Counter("irisfed_db_unavailable_total", "Operations that found Postgres unreachable")


class PeerViewCollector:
    """Exports heartbeat age and reachability per peer from a live PeerView at scrape time."""

    def __init__(self, view) -> None:
        self.view = view

    def collect(self):
        age = GaugeMetricFamily("irisfed_peer_heartbeat_age_seconds",
                                "Seconds since the newest heartbeat of each peer", labels=["peer_id"])
        reachable = GaugeMetricFamily("irisfed_peer_reachable",
                                      "1 while the peer's newest heartbeat is within its TTL", labels=["peer_id"])
        now = self.view.clock()
        for peer in list(self.view.peers()):
            seen = peer.heartbeat_age(now)
            if seen is not None:
                age.add_metric([peer.peer_id], seen)
            reachable.add_metric([peer.peer_id], 1.0 if peer.is_reachable(now) else 0.0)
        yield age
        yield reachable


_collectors: list[PeerViewCollector] = []


def watch_peer_view(view) -> None:
    """Export ``view`` (one per process: the last registered wins)."""
    for old in _collectors:
        REGISTRY.unregister(old)
    _collectors.clear()
    collector = PeerViewCollector(view)
    REGISTRY.register(collector)
    _collectors.append(collector)


def serve(port: int | None, host: str = "127.0.0.1") -> None:
    """Serve /metrics on ``port`` (None: metrics are collected but not served)."""
    if port is not None:
        try:
            start_http_server(port, addr=host)
        except (OSError, UnicodeError) as exc:  # UnicodeError: a host name IDNA cannot encode
            raise ConfigError(f"cannot serve metrics on --metrics-host {host!r} --metrics-port {port}: "
                              f"{getattr(exc, 'strerror', None) or exc}") from None


def timer() -> Callable[[], float]:
    start = time.perf_counter()
    return lambda: time.perf_counter() - start
