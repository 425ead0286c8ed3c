"""Explanations: why a job is where it is, stored on the job for `irisfed explain`.

The stored form is compact JSON: ``{"by", "rule", "peers": [{"peer_id", "code",
"detail"}]}``, plus ``"more": {code: count}`` when the federation has more than
``MAX_EXPLAINED_PEERS`` peers: every job carries its explanation, so its size must
not grow with the federation (the first peers are listed, the rest counted). Peer codes: ``match``, ``unreachable``, ``no_backends``,
``missing_attribute``, ``unwanted_attribute``, ``value_mismatch``,
``no_free_capacity``, ``not_pinned_peer``, ``avoided``, ``insufficient_resources``,
``held``, ``discovering``, ``insufficient_nodes``. Append only. A job held back by its user's quota has no
peer verdicts and ``"wait": "quota"``.

A peer turned down for resources also carries ``"short": [{"resource", "asked",
"available", "backend"}]`` (at most ``MAX_SHORTFALLS``): ``available`` is the most
that backend has for ``insufficient_resources``, what it has free now for
``no_free_capacity`` (docs/scheduling.md).
"""

from __future__ import annotations

from collections.abc import Iterable

from irisfed.shared.federation.router import PeerVerdict

PEER_CODES = {
    "match": "can take it",
    "unreachable": "unreachable",
    "no_backends": "advertises no backends",
    "missing_attribute": "lacks a required attribute",
    "unwanted_attribute": "advertises an attribute the job excludes",
    "value_mismatch": "attribute value does not match",
    "no_free_capacity": "matches but is full",
    "not_pinned_peer": "not the pinned peer",
    "avoided": "lost this job before",
    "insufficient_resources": "too small for it, even when empty",
    "held": "held for a job that has waited longer",
    "discovering": "its engine has not said what it has yet",
    "insufficient_nodes": "no backend has enough nodes for its tasks, even when empty",
}


MAX_EXPLAINED_PEERS = 10
MAX_SHORTFALLS = 8  # per peer: a few backends × a few resources; the detail says the rest


def _peer(v: PeerVerdict) -> dict:
    doc = {"peer_id": v.peer_id, "code": v.code, "detail": v.detail}
    short = getattr(v, "shortfalls", ())
    if short:
        doc["short"] = [{"resource": s.resource, "asked": s.asked, "available": s.available, "backend": s.backend}
                        for s in short[:MAX_SHORTFALLS]]
    return doc


def explanation(by: str, rule: str, verdicts: Iterable[PeerVerdict] = (), code: str | None = None) -> dict:
    """The stored explanation of one decision (bounded: see MAX_EXPLAINED_PEERS).

    ``code`` names why a job waits when that is not a peer's doing (``quota``:
    its user's quota is full); it is stored as ``"wait"``.
    """
    verdicts = list(verdicts)
    doc: dict = {
        "by": by,
        "rule": rule,
        "peers": [_peer(v) for v in verdicts[:MAX_EXPLAINED_PEERS]],
    }
    if code:
        doc["wait"] = code
    if len(verdicts) > MAX_EXPLAINED_PEERS:
        more: dict[str, int] = {}
        for v in verdicts[MAX_EXPLAINED_PEERS:]:
            more[v.code] = more.get(v.code, 0) + 1
        doc["more"] = more
    return doc

