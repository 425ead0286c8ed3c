"""Submit-time classification: where a job goes, decided once, with its reasons.

``PeerRouter.classify`` applies these rules in this exact order:

1. ``cluster_pin`` non-empty → QUEUE pinned to that peer. Local feasibility and
   peer capabilities are not checked. A pin naming a peer that is not in the
   configuration raises :class:`shared.errors.UnknownPeer`.
2. ``local_feasible`` → LOCAL.
3. Some reachable peer (fresh heartbeat) has a backend that satisfies every
   constraint and could hold the job's resources when empty → QUEUE (unpinned).
   A backend still ``discovering`` (its engine has not said what it has) might: when
   no backend surely can, such a peer also means QUEUE, never a final REJECT.
4. Otherwise → REJECT, with a verdict per peer saying why it was turned down; a peer
   whose matching backends are all too small says so (``insufficient_resources``,
   naming the resource, the amount asked and the most that backend has), one whose
   nodes could never take the tasks one per node too (``insufficient_nodes``:
   ``gang: needs 8 nodes with gpu 8, at most 4 (backend slurm)``).

"Could hold when empty" compares the request with the backend's advertised
*totals*, never with what is free now: a busy peer queues work, a small one rejects
it. A backend that advertises no resources (an older agent) is judged by its
attributes only. A gang (``replicas`` > 1) needs, on one backend, its tasks' sum within
the totals, a slot per task and a node per task (shared.nodes): a backend that
advertises no nodes runs single-task jobs only. ``local_feasible`` is the caller's: it must mean that a local
backend matches the constraints *and* could hold the resources
(:func:`backend_can_hold`), judged on the local cluster's newest advertised shape.

Inputs and outputs are frozen values; the clock is injected; nothing here does I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum

from irisfed.shared.constraints import Constraint, first_mismatch
from irisfed.shared.errors import UnknownPeer
from irisfed.shared.federation.peer import Backend, FederationPeer
from irisfed.shared.nodes import Gang, NodePool, gang_verdict
from irisfed.shared.reachability import expires_at
from irisfed.shared.resources import (
    DEFAULT_RESOURCES,
    Resources,
    Shortfall,
    as_resources,
    describe_shortfalls,
    offer_units,
    shortfalls,
)


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
    # What the job asks for (a Resources or the wire's mapping); None = the default, one cpu.
    # For a gang, what each task asks.
    resources: Resources | Mapping[str, float] | None = None
    replicas: int = 1  # tasks (docs/design.md §3.4)
    group_by: str = ""  # the node attribute a gang's nodes share ("": none)


@dataclass(frozen=True, slots=True)
class PeerVerdict:
    """One peer's answer to a job's constraints and resources.

    ``code`` is one of ``match``, ``unreachable``, ``no_backends``,
    ``missing_attribute``, ``unwanted_attribute``, ``value_mismatch``,
    ``insufficient_resources``, ``discovering`` (placement adds ``no_free_capacity``, ``held``,
    ``not_pinned_peer``, ``avoided``: shared.explain lists them all).
    ``shortfalls`` names the resources a backend lacks, for the resource codes.
    """

    peer_id: str
    code: str
    detail: str = ""
    shortfalls: tuple[Shortfall, ...] = ()

    def describe(self) -> str:
        return f"{self.peer_id}: {self.detail or self.code}"


@dataclass(frozen=True, slots=True)
class SubmitPlan:
    """The router's decision; ``verdicts`` explains each peer when they were consulted."""

    disposition: SubmitDisposition
    pinned_peer_id: str = ""
    reason: str = ""
    verdicts: tuple[PeerVerdict, ...] = field(default=())


def backend_can_hold(backend: Backend, resources: Resources, replicas: int = 1, group_by: str = "") -> bool:
    """Whether ``backend`` could hold a job of ``replicas`` tasks each asking ``resources``
    when empty (by its totals and, where it advertises them, its nodes').

    A backend that advertises no resources is not judged for a single task (always
    True); one still discovering holds nothing yet (False).
    """
    return not backend.discovering and not too_small(backend, resources, replicas) \
        and not too_few_nodes(backend, Gang(replicas, resources.units, group_by))


def too_small(backend: Backend, resources: Resources, replicas: int = 1) -> list[Shortfall]:
    """The resources ``backend``'s totals cannot cover for ``replicas`` tasks of
    ``resources`` (empty: it could hold the job).

    Empty for a backend that advertises no resources: its shape is unknown.
    """
    if not backend.resources:
        return []
    totals = {name: total for name, (total, _free) in offer_units(backend.resources).items()}
    units = resources.units if replicas == 1 else tuple((name, amount * replicas) for name, amount in resources.units)
    return shortfalls(units, totals, backend.name)


def too_few_nodes(backend: Backend, gang: Gang) -> str:
    """Why ``backend``'s hosts could never take the job's tasks, one per node ("": they
    could): a gang needs a backend advertising nodes, enough slots, and ``replicas``
    nodes (sharing a ``group_by`` value) each able to hold one task; a single task on a
    backend advertising nodes must fit on one of them."""
    if not backend.nodes:
        if gang.replicas > 1:
            return (f"gang: needs {gang.replicas} nodes, but backend {backend.name} advertises no nodes "
                    "(it runs single-task jobs only)")
        return ""
    if gang.replicas > backend.total:
        return f"gang: needs {gang.replicas} slots, at most {backend.total} (backend {backend.name})"
    pool = NodePool(backend.nodes)
    return "" if pool.can_ever_hold(gang) else gang_verdict(gang, pool, backend.name)


def judge_peer(
    peer: FederationPeer, constraints: Sequence[Constraint], now: float,
    resources: Resources | None = None, replicas: int = 1, group_by: str = "",
) -> PeerVerdict:
    """Whether ``peer`` can take a job with ``constraints`` (and ``resources``, when given:
    None judges attributes only; ``replicas`` tasks of them, sharing a ``group_by``
    value) right now, and if not, why."""
    if not peer.is_reachable(now):
        if peer.last_heartbeat_at is None:
            detail = "unreachable (no heartbeat received)"
        else:
            # Absolute times, not ages: the same situation explains itself the same way
            # on every tick, so stored explanations only change when something happened.
            since = _utc(expires_at(peer.last_heartbeat_at, peer.ttl_s))
            detail = (f"unreachable since {since} (last heartbeat {_utc(peer.last_heartbeat_at)}, "
                      f"ttl {peer.ttl_s:g}s)")
        return PeerVerdict(peer.peer_id, "unreachable", detail)
    if not peer.backends:
        return PeerVerdict(peer.peer_id, "no_backends", "advertises no backends")
    mismatches = []
    small: list[list[Shortfall]] = []
    few_nodes: list[str] = []
    asking: list[str] = []
    for backend in peer.backends:
        if backend.discovering:
            # What it already advertises is configured (``--attr``) and overrides what
            # the engine will say: a constraint on such a key is judged now; the rest
            # waits for the engine.
            mismatch = first_mismatch([c for c in constraints if c.key in backend.attributes], backend.attributes)
            if mismatch is None:
                asking.append(backend.name)
            else:
                mismatches.append((backend.name, mismatch))
            continue
        mismatch = first_mismatch(constraints, backend.attributes)
        if mismatch is None:
            short = too_small(backend, resources, replicas) if resources is not None else []
            if short:
                small.append(short)
                continue
            nodes = too_few_nodes(backend, Gang(replicas, resources.units, group_by)) if resources is not None else ""
            if nodes:
                few_nodes.append(nodes)
                continue
            return PeerVerdict(peer.peer_id, "match", f"backend {backend.name} matches")
        mismatches.append((backend.name, mismatch))
    if asking:
        # Its shape is unknown, not empty: it might hold the job (docs/engines.md).
        return PeerVerdict(peer.peer_id, "discovering",
                           f"backend {', '.join(asking)}: its engine has not said what it has yet")
    if few_nodes:
        # Enough in all, but not on enough nodes: the closest reason.
        return PeerVerdict(peer.peer_id, "insufficient_nodes", "; ".join(few_nodes))
    if small:
        # Some backend has what the job needs but not enough of it: the closest reason.
        detail = "; ".join(f"{describe_shortfalls(short, 'at most')} (backend {short[0].backend})"
                           for short in small)
        return PeerVerdict(peer.peer_id, "insufficient_resources", detail,
                           tuple(s for short in small for s in short))
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
        resources = as_resources(request.resources) if request.resources is not None else DEFAULT_RESOURCES
        verdicts = tuple(
            judge_peer(peer, request.constraints, now, resources, request.replicas, request.group_by)
            for peer in self._peers.values()
        )
        # Rejecting is final for the job id; a peer whose engine has not answered yet
        # might host it, so then the job waits for the tick (its deadline still applies).
        for code, hosting in (("match", "can host it"), ("discovering", "may host it once their engines answer")):
            peers = [v.peer_id for v in verdicts if v.code == code]
            if peers:
                return SubmitPlan(SubmitDisposition.QUEUE, reason=f"rule 3: reachable peers {hosting}: {name_some(peers)}",
                                  verdicts=verdicts)
        if not verdicts:
            reason = "rule 4: no peer can host the job: the federation has no peers"
        else:
            # The reply's verdicts name every peer; the reason stays one readable line.
            reason = "rule 4: no peer can host the job: " + name_some([v.describe() for v in verdicts], sep="; ")
        return SubmitPlan(SubmitDisposition.REJECT, reason=reason, verdicts=verdicts)
