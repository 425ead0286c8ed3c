"""Submit-time classification: where a job goes, decided once, with its reasons.

``PeerRouter.classify`` applies these rules in this exact order:

1. ``cluster_pin`` non-empty → QUEUE pinned to that peer. Local feasibility and
   peer capabilities are not checked. A pin naming a peer that is not in the
   configuration raises :class:`shared.errors.UnknownPeer`.
2. ``local_feasible`` → LOCAL.
3. Some reachable peer (fresh heartbeat) has a backend that satisfies every
   constraint → QUEUE (unpinned).
4. Otherwise → REJECT, with a verdict per peer saying why it was turned down.

Inputs and outputs are frozen values; the clock is injected; nothing here does I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum

from shared.constraints import Constraint, first_mismatch
from shared.errors import UnknownPeer
from shared.federation.peer import FederationPeer


class SubmitDisposition(StrEnum):
    """Where a job goes at submit. Persisted in ``jobs.disposition``: append only."""

    LOCAL = "local"
    QUEUE = "queue"
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What classify needs to know about a job."""

    constraints: Sequence[Constraint] = ()
    local_feasible: bool = False
    cluster_pin: str = ""


@dataclass(frozen=True, slots=True)
class PeerVerdict:
    """One peer's answer to a job's constraints.

    ``code`` is one of ``match``, ``unreachable``, ``no_backends``,
    ``missing_attribute``, ``unwanted_attribute``, ``value_mismatch``.
    """

    peer_id: str
    code: str
    detail: str = ""

    def describe(self) -> str:
        return f"{self.peer_id}: {self.detail or self.code}"


@dataclass(frozen=True, slots=True)
class SubmitPlan:
    """The router's decision; ``verdicts`` explains each peer when they were consulted."""

    disposition: SubmitDisposition
    pinned_peer_id: str = ""
    reason: str = ""
    verdicts: tuple[PeerVerdict, ...] = field(default=())


def judge_peer(peer: FederationPeer, constraints: Sequence[Constraint], now: float) -> PeerVerdict:
    """Whether ``peer`` can take a job with ``constraints`` right now, and if not, why."""
    if not peer.is_reachable(now):
        if peer.last_heartbeat_at is None:
            detail = "unreachable (no heartbeat received)"
        else:
            # Absolute times, not ages: the same situation explains itself the same way
            # on every tick, so stored explanations only change when something happened.
            since = _utc(peer.last_heartbeat_at + peer.ttl_s)
            detail = (f"unreachable since {since} (last heartbeat {_utc(peer.last_heartbeat_at)}, "
                      f"ttl {peer.ttl_s:g}s)")
        return PeerVerdict(peer.peer_id, "unreachable", detail)
    if not peer.backends:
        return PeerVerdict(peer.peer_id, "no_backends", "advertises no backends")
    mismatches = []
    for backend in peer.backends:
        mismatch = first_mismatch(constraints, backend.attributes)
        if mismatch is None:
            return PeerVerdict(peer.peer_id, "match", f"backend {backend.name} matches")
        mismatches.append((backend.name, mismatch))
    if len(mismatches) == 1:
        return PeerVerdict(peer.peer_id, mismatches[0][1].code, mismatches[0][1].detail)
    detail = "; ".join(f"backend {name}: {m.detail}" for name, m in mismatches)
    return PeerVerdict(peer.peer_id, mismatches[0][1].code, detail)


def _utc(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


REASON_NAMES = 10  # peers named in a reason; the rest are counted


def name_some(items: Sequence[str], sep: str = ", ") -> str:
    """``a, b, c`` — or the first REASON_NAMES and how many more: reasons are stored per job."""
    if len(items) <= REASON_NAMES:
        return sep.join(items)
    return f"{sep.join(items[:REASON_NAMES])}{sep}and {len(items) - REASON_NAMES} more"


class PeerRouter:
    """Classifies submits against the federation's peers (see the module docstring)."""

    def __init__(
        self, peers: Iterable[FederationPeer], clock: Callable[[], float] = time.time
    ) -> None:
        self._peers = {peer.peer_id: peer for peer in peers}
        self._clock = clock

    @property
    def peers(self) -> dict[str, FederationPeer]:
        return dict(self._peers)

    def classify(self, request: RoutingRequest) -> SubmitPlan:
        """Decide LOCAL, QUEUE (maybe pinned) or REJECT for ``request``."""
        pin = request.cluster_pin
        if pin:
            if pin not in self._peers:
                known = ", ".join(sorted(self._peers)) or "none"
                raise UnknownPeer(f"cluster_pin {pin!r} is not a peer of this federation (peers: {known})")
            return SubmitPlan(SubmitDisposition.QUEUE, pinned_peer_id=pin,
                              reason=f"rule 1: pinned to {pin}")
        if request.local_feasible:
            return SubmitPlan(SubmitDisposition.LOCAL, reason="rule 2: the local cluster can run it")
        now = self._clock()
        verdicts = tuple(
            judge_peer(peer, request.constraints, now) for peer in self._peers.values()
        )
        matching = [v.peer_id for v in verdicts if v.code == "match"]
        if matching:
            return SubmitPlan(
                SubmitDisposition.QUEUE,
                reason=f"rule 3: reachable peers can host it: {name_some(matching)}",
                verdicts=verdicts,
            )
        if not verdicts:
            reason = "rule 4: no peer can host the job: the federation has no peers"
        else:
            # The reply's verdicts name every peer; the reason stays one readable line.
            reason = "rule 4: no peer can host the job: " + name_some([v.describe() for v in verdicts], sep="; ")
        return SubmitPlan(SubmitDisposition.REJECT, reason=reason, verdicts=verdicts)
