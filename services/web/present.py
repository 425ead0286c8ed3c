"""What the pages show, as plain values: bars, ages, peers, a job's spec, its
timeline and the verdicts that explain it, users' usage against their quotas. Pure.

Stored values are read defensively (a field of the wrong type shows as text or is
left out, never fails the page), and strings that may carry a URL with a password
(commands, reasons, details) pass through ``redact``. Escaping is the templates'
(Jinja autoescape) and :func:`visible`'s, which every printed value passes through.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import quote

import msgspec
from markupsafe import Markup, escape

from irisfed.shared.bands import DEFAULT_MAX_PREEMPTIONS, band_name
from irisfed.shared.explain import PEER_CODES
from irisfed.shared.federation.peer import FederationPeer
from irisfed.shared.lifecycle import TERMINAL_STATES, JobState
from irisfed.shared.records import ChangelogEntry
from irisfed.shared.redact import redact
from irisfed.shared.resources import (
    SLOTS,
    amount_text,
    fmt_amount,
    from_units,
    offer_units,
    resource_label,
)
from irisfed.shared.users import UserConfig, dominant_share, share_text

# What a job's URL keeps as it is: every character of a stored job id (``alice:train-1``;
# its ':' is safe in a path that starts with "/").
_URL_SAFE = re.compile(r"[A-Za-z0-9_.~:-]+")
STEP = 5  # bar widths come in 5% steps: one CSS class each (no inline styles under the CSP)


def visible(value: Any) -> Any:
    """Jinja's finalize: every printed string with its control characters (escape
    sequences, bidi overrides, NUL...) shown as ``\\xNN`` escapes; newlines and tabs kept."""
    if isinstance(value, Markup) or not isinstance(value, str) or value.isprintable():
        return value
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode("ascii")
                   for c in value)


def text(value: Any, limit: int | None = None) -> str:
    """Any stored value as a string (None: ""), cut to ``limit`` characters with "…"."""
    out = "" if value is None else value if isinstance(value, str) else str(value)
    if limit is not None and len(out) > limit:
        return out[: limit - 1] + "…"
    return out


def path_part(value: str) -> str:
    """``value`` as one URL path segment (after a "/")."""
    return value if _URL_SAFE.fullmatch(value) else quote(value, safe=":")


def output_path(job_id: str, epoch: int, task: int, name: str) -> str:
    """Where the dashboard serves one stored output file (its name's ``/`` kept)."""
    return f"/jobs/{path_part(job_id)}/outputs/{epoch}/{task}/{quote(name, safe='/')}"


def attachment(name: str) -> str:
    """A Content-Disposition that downloads ``name``'s last part under its own name
    (RFC 6266: an ASCII fallback, the UTF-8 name escaped), never shown inline."""
    base = name.rsplit("/", 1)[-1] or "output"
    fallback = "".join(c if c.isascii() and c.isprintable() and c not in '"\\;' else "_" for c in base)
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(base, safe='')}"


def fmt_age(seconds: float | None) -> str:
    """``4s``, ``12m``, ``3h 5m``, ``2d 4h`` (``-``: unknown)."""
    if seconds is None or seconds != seconds:
        return "-"
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def fmt_time(when: datetime | None) -> str:
    return "-" if when is None else when.strftime("%Y-%m-%d %H:%M:%S")


def bar_step(used: float, total: float) -> int:
    """``used`` of ``total`` as a width in 5% steps (0..100); some use shows as 5% at
    least, a bar not quite full as 95% at most."""
    if not total or total <= 0 or used != used:
        return 0
    ratio = min(1.0, max(0.0, used / total))
    step = round(ratio * 100 / STEP) * STEP
    if used > 0 and step == 0:
        return STEP
    if used < total and step == 100:
        return 100 - STEP
    return step


@dataclass(frozen=True)
class Bar:
    """One resource of a backend: used, free and total, and the bar's width class."""

    name: str
    used: str
    free: str
    total: str
    step: int

    @property
    def label(self) -> str:
        return resource_label(self.name)


@dataclass(frozen=True)
class BackendCard:
    name: str
    attributes: list[tuple[str, str]]
    slots: Bar
    resources: list[Bar]
    discovering: bool = False  # its engine has not said what it has yet


@dataclass(frozen=True)
class PeerCard:
    peer_id: str
    reachable: bool
    heard: bool  # a heartbeat was ever received
    age: str
    ttl_s: float
    backends: list[BackendCard] = field(default_factory=list)


def _slots(total: object, free: object) -> Bar:
    t = total if isinstance(total, int) and not isinstance(total, bool) and total > 0 else 0
    f = min(t, free) if isinstance(free, int) and not isinstance(free, bool) and free > 0 else 0
    return Bar("slots", str(t - f), str(f), str(t), bar_step(t - f, t))


def resource_bars(resources: Mapping[str, Any]) -> list[Bar]:
    """Advertised resources (anything with total and free) → bars, by name."""
    bars = []
    for name, (total, free) in sorted(offer_units(resources).items()):
        used = total - free
        bars.append(Bar(name, amount_text(name, from_units(name, used)), amount_text(name, from_units(name, free)),
                        amount_text(name, from_units(name, total)), bar_step(used, total)))
    return bars


def peer_cards(peers: Iterable[FederationPeer], now: float) -> list[PeerCard]:
    """The routing view's peers (newest heartbeat each) as the federation page shows them."""
    cards = []
    for peer in peers:
        age = peer.heartbeat_age(now)
        backends = [
            BackendCard(
                name=text(b.name),
                attributes=[(text(k), "|".join(text(v) for v in values)) for k, values in sorted(b.attributes.items())],
                slots=_slots(b.total, b.free),
                resources=resource_bars(b.resources),
                discovering=b.discovering,
            )
            for b in peer.backends
        ]
        cards.append(PeerCard(peer.peer_id, peer.is_reachable(now), age is not None, fmt_age(age), peer.ttl_s,
                              backends))
    return cards


# ---------------------------------------------------------------- users


def _units_amount(name: str, units: int) -> int | float:
    return units if name == SLOTS else from_units(name, units)


def amounts(units: Mapping[str, int]) -> list[tuple[str, str]]:
    """Units by resource → (name, amount in its own unit), slots first, then by name."""
    return [(resource_label(name), fmt_amount(units[name]) if name == SLOTS else amount_text(name, _units_amount(name, units[name])))
            for name in sorted(units, key=lambda name: (name != SLOTS, name))]


@dataclass(frozen=True)
class Use:
    """One resource of a user: what its live jobs hold, against its quota (None: no cap)."""

    name: str
    held: int | float
    quota: int | float | None
    step: int  # the bar's width class (0 without a quota)

    @property
    def full(self) -> bool:
        return self.quota is not None and self.held >= self.quota

    @property
    def label(self) -> str:
        return resource_label(self.name)

    @property
    def shown(self) -> str:
        """``2 / 2``, ``3 / —`` (no cap); memory in MiB/GiB."""
        def text(amount: int | float) -> str:
            return fmt_amount(amount) if self.name == SLOTS else amount_text(self.name, amount)
        return f"{text(self.held)} / {'—' if self.quota is None else text(self.quota)}"


@dataclass(frozen=True)
class UserRow:
    """One user on the Users page."""

    user_id: str
    configured: bool  # in the federation config (else: weight 1, no quota, the default max_band)
    max_band: str
    weight: float
    share: float  # weighted dominant share of the federation's advertised totals
    queued: int
    assigned: int
    running: int
    usage: list[Use]

    @property
    def live(self) -> int:
        return self.assigned + self.running

    @property
    def weight_text(self) -> str:
        return fmt_amount(self.weight)

    @property
    def share_text(self) -> str:
        return share_text(self.share)


def _count(counts: Mapping[str, Any], state: str) -> int:
    value = counts.get(state, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def user_rows(users: Iterable[UserConfig], held: Mapping[str, Mapping[str, int]],
              counts: Mapping[str, Mapping[str, int]], totals: Mapping[str, int]) -> list[UserRow]:
    """Every configured user, and every user with live jobs (``default``, or one since
    removed from the config: weight 1, no quota), by id.

    ``held``: each user's live usage in units (``slots``: its live jobs), ``counts``: its
    queued, assigned and running jobs, ``totals``: the federation's (``federation_totals``).
    A user's resources are those its quota caps and those its live jobs hold (slots
    only when capped: the live count says the rest).
    """
    configured = {u.id: u for u in users}
    rows = []
    for user_id in sorted(set(configured) | set(held) | set(counts)):
        user = configured.get(user_id) or UserConfig(user_id)
        usage = held.get(user_id, {})
        caps = user.quota_units()
        names = sorted({name for name, units in usage.items() if units and name != SLOTS} | set(caps))
        uses = [Use(name, _units_amount(name, usage.get(name, 0)),
                    user.quota[name] if name in user.quota else None,
                    bar_step(usage.get(name, 0), caps[name]) if name in caps else 0)
                for name in names]
        mine = counts.get(user_id, {})
        rows.append(UserRow(user_id, user_id in configured, user.max_band, user.weight,
                            dominant_share(usage, totals, user.weight), _count(mine, "queued"),
                            _count(mine, "assigned"), _count(mine, "running"), uses))
    return rows


def users_document(rows: Sequence[UserRow], totals: Mapping[str, int]) -> dict[str, Any]:
    """The Users page as JSON (``/api/users``): amounts in each resource's own unit."""
    return {
        "totals": {name: _units_amount(name, units) for name, units in sorted(totals.items())},
        "users": [{
            "user": row.user_id, "configured": row.configured, "max_band": row.max_band, "weight": row.weight,
            "share": row.share, "queued": row.queued, "assigned": row.assigned, "running": row.running,
            "usage": {use.name: {"held": use.held, "quota": use.quota} for use in row.usage},
        } for row in rows],
    }


# ---------------------------------------------------------------- one job


@dataclass(frozen=True)
class SpecView:
    """A job's spec as shown: env by name only (values may be secrets)."""

    command: list[str]
    name: str
    labels: list[tuple[str, str]]
    env_names: list[str]
    constraints: list[str]
    preferences: list[str]
    resources: list[tuple[str, str]]
    pin: str
    priority: str
    max_retries: str
    deadline_s: str
    max_preemptions: str = str(DEFAULT_MAX_PREEMPTIONS)
    group_by: str = ""  # a gang's node attribute its nodes share


def _constraint(raw: Any) -> str:
    if not isinstance(raw, Mapping):
        return text(raw)
    value = raw.get("value")
    shown = "" if value is None else " " + ("|".join(text(v) for v in value) if isinstance(value, list) else text(value))
    return f"{text(raw.get('key'))} {text(raw.get('op'))}{shown}"


def spec_view(spec: Mapping[str, Any] | Any) -> SpecView:
    spec = spec if isinstance(spec, Mapping) else {}

    def pairs(key: str) -> list[tuple[str, str]]:
        raw = spec.get(key)
        return sorted((text(k), text(v)) for k, v in raw.items()) if isinstance(raw, Mapping) else []

    def listed(key: str) -> list[Any]:
        raw = spec.get(key)
        return raw if isinstance(raw, list) else []

    env = spec.get("env")
    return SpecView(
        command=[redact(text(arg)) for arg in listed("command")],
        name=text(spec.get("name")),
        labels=pairs("labels"),
        env_names=sorted(text(k) for k in env) if isinstance(env, Mapping) else [],
        constraints=[_constraint(c) for c in listed("constraints")],
        preferences=[_constraint(c) for c in listed("preferences")],
        resources=[(k, v) for k, v in pairs("resources")],
        pin=text(spec.get("cluster_pin")),
        priority=text(spec.get("priority", 0)),
        max_retries=text(spec.get("max_retries", "")),
        deadline_s=text(spec.get("deadline_s", "")),
        max_preemptions=text(spec.get("max_preemptions", DEFAULT_MAX_PREEMPTIONS)),
        group_by=text(spec["coschedule"].get("group_by", "")) if isinstance(spec.get("coschedule"), Mapping) else "",
    )


def command_line(command: Any, limit: int = 80) -> str:
    """A list-row's command, joined and cut (redacted)."""
    if not isinstance(command, list):
        return text(command, limit)
    try:
        joined = " ".join(command)
    except TypeError:  # not all strings
        joined = " ".join(text(a) for a in command)
    return text(redact(joined), limit)


def label_pairs(labels: Any) -> list[tuple[str, str]]:
    if not isinstance(labels, Mapping):
        return []
    # Keys are distinct, so sorting the pairs never compares values of mixed types.
    return [(text(k), v if isinstance(v, str) else text(v)) for k, v in sorted(labels.items(), key=_first)]


def _first(pair: tuple[Any, Any]) -> str:
    return text(pair[0])


@dataclass(frozen=True)
class Step:
    """One row of a job's timeline (one changelog entry)."""

    seq: int
    at: str
    offset: str  # since the job's first entry
    from_state: str
    to_state: str
    peer: str
    epoch: int
    actor: str
    detail: str
    preempted_by: str = ""  # a preemption: the job it made room for (``detail`` then says the rest)
    preempted_on: str = ""  # ... and the peer its run was stopped on ("" when the history does not say)
    preempting: tuple[str, ...] = ()  # a placement that preempted these jobs


# The tick's history details for a preemption (``job_preempt_batch``, ``job_assign_batch``).
PREEMPTED_BY = "preempted by "
PLACED_PREEMPTING = "placed; preempted "


def preemption(actor: Any, detail: Any) -> tuple[str, str] | None:
    """(the preempting job, the rest of the detail) of a tick's ``preempted by <job>[; ...]``
    row, else None."""
    if actor != "tick" or not isinstance(detail, str) or not detail.startswith(PREEMPTED_BY):
        return None
    by, _, rest = detail[len(PREEMPTED_BY):].partition(";")
    return (redact(by.strip()), rest.strip()) if by.strip() else None


def preempting(actor: Any, to_state: Any, detail: Any) -> tuple[str, ...]:
    """The jobs a tick's ``placed; preempted <job>, <job>`` row names (else none)."""
    if actor != "tick" or to_state != JobState.ASSIGNED or not isinstance(detail, str) \
            or not detail.startswith(PLACED_PREEMPTING):
        return ()
    return tuple(redact(v.strip()) for v in detail[len(PLACED_PREEMPTING):].split(",") if v.strip())


def timeline(history: Sequence[ChangelogEntry]) -> list[Step]:
    if not history:
        return []
    first = history[0].at
    steps, peer = [], ""
    for row in history:
        stopped = preemption(row.actor, row.detail)
        steps.append(Step(seq=row.seq, at=row.at.strftime("%H:%M:%S.%f")[:-3],
                          offset="+" + _offset((row.at - first).total_seconds()),
                          from_state=text(row.from_state) or "new", to_state=text(row.to_state),
                          peer=text(row.peer_id) or "-", epoch=row.epoch, actor=text(row.actor),
                          detail=redact(text(row.detail if stopped is None else stopped[1])),
                          preempted_by=stopped[0] if stopped else "", preempted_on=peer if stopped else "",
                          preempting=preempting(row.actor, row.to_state, row.detail)))
        if row.peer_id:
            peer = text(row.peer_id)
    return steps


def _offset(seconds: float) -> str:
    return f"{seconds:.3f}s" if seconds < 120 else fmt_age(seconds)


@dataclass(frozen=True)
class Verdict:
    peer_id: str
    code: str
    meaning: str
    detail: str
    match: bool
    short: list[str]


@dataclass(frozen=True)
class Explained:
    """Why a job is where it is (``irisfed explain``'s content)."""

    by: str
    rule: str
    verdicts: list[Verdict]
    more: list[tuple[str, int]]
    placed: str  # "on X at epoch N (by)" for the last placement, else ""
    raw: str = ""  # a stored explanation that is not an object, as (redacted) JSON text
    wait: str = ""  # why it waits when no peer is the reason (``quota``), else ""
    preempting: tuple[str, ...] = ()  # the jobs its last placement preempted


def explained(explanation: Any, history: Sequence[ChangelogEntry] = ()) -> Explained:
    doc = explanation if isinstance(explanation, Mapping) else {}
    verdicts = []
    for peer in doc.get("peers") or []:
        if not isinstance(peer, Mapping):
            continue
        code = text(peer.get("code"))
        short = [f"{text(s.get('resource'))}: asked {text(s.get('asked'))}, {text(s.get('available'))} available"
                 + (f" on {text(s.get('backend'))}" if s.get("backend") else "")
                 for s in peer.get("short") or [] if isinstance(s, Mapping)]
        verdicts.append(Verdict(text(peer.get("peer_id")), code, PEER_CODES.get(code, code),
                                redact(text(peer.get("detail"))), code == "match", short))
    more_raw = doc.get("more")
    more = ([(PEER_CODES.get(text(code), text(code)), int(count)) for code, count in more_raw.items()
             if isinstance(count, int) and not isinstance(count, bool)]
            if isinstance(more_raw, Mapping) else [])
    placed = [row for row in history if row.to_state == JobState.ASSIGNED]
    where = (f"on {text(placed[-1].peer_id) or '-'} at epoch {placed[-1].epoch} ({text(placed[-1].actor)})"
             if placed else "")
    raw = "" if explanation is None or isinstance(explanation, Mapping) else odd_text(explanation)
    victims = preempting(placed[-1].actor, placed[-1].to_state, placed[-1].detail) if placed else ()
    return Explained(text(doc.get("by")), redact(text(doc.get("rule"))), verdicts, more, where, raw,
                     text(doc.get("wait"), 40), victims)


def odd_text(value: Any, limit: int = 2000) -> str:
    """A stored value of an unexpected shape, as JSON text (redacted, cut)."""
    try:
        shown = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        shown = text(value)
    return text(redact(shown), limit)


def is_terminal(state: str) -> bool:
    return state in TERMINAL_STATES


STATES = [s.value for s in JobState]


class JobRows:
    """The Jobs page's rows as HTML, built here rather than in the template: a page is 50
    rows of ~20 values, and Jinja's per-expression cost made rendering most of the page's
    time. Every value is escaped exactly as the template's autoescape and finalize would
    (``_cells``: a row's values at once); tests/browser, tests/unit/test_web_limits.py and
    tests/integration/test_web_pages.py check hostile strings.

    A row's HTML is kept (the last ``keep`` rows, keyed by the row's whole content): every
    viewer re-fetches the same page on each live update, and most rows of it are as
    they were."""

    def __init__(self, job_url: Callable[[str], str], keep: int = 4096) -> None:
        self.job_url = job_url
        self.keep = keep
        self._kept: dict[bytes, str] = {}

    def __call__(self, rows: Iterable[Any]) -> Markup:
        out = []
        kept = self._kept
        for row in rows:
            key = _row_key(row)
            html = kept.get(key)
            if html is None:
                html = kept[key] = job_row_html(row, self.job_url)
                if len(kept) > self.keep:
                    del kept[next(iter(kept))]  # the oldest
            out.append(html)
        return Markup("".join(out))


_row_key = msgspec.msgpack.Encoder().encode


def job_rows_html(rows: Iterable[Any], job_url: Callable[[str], str]) -> Markup:
    """Rows as HTML, none kept (``JobRows`` keeps them)."""
    return Markup("".join(job_row_html(row, job_url) for row in rows))


def job_row_html(row: Any, job_url: Callable[[str], str]) -> str:
    """One row of the Jobs page (a ``JobListRow``), every value escaped."""
    owner = row.owner_peer_id or (f"pinned {row.pinned_peer_id}" if row.pinned_peer_id else "-")
    iso = row.submitted_at.isoformat()
    values = [row.job_id, job_url(row.job_id), text(row.user_id, 40), text(row.name, 60), row.state, owner,
              str(row.epoch), str(row.attempts), iso, iso[:19].replace("T", " "), command_line(row.command, 80),
              text(redact(text(row.reason)), 100), band_name(row.band), str(row.preemptions)]
    for key, value in label_pairs(row.labels):
        values += (text(key, 40), text(value, 40))
    (job_id, url, user, name, state, owner, epoch, attempts, iso, when, command, reason, band, preemptions,
     *pairs) = _cells(values)
    label_html = "".join(f'<code class="label">{pairs[i]}={pairs[i + 1]}</code> ' for i in range(0, len(pairs), 2))
    stopped = (f' <span class="muted" data-testid="job-preemptions" title="times preempted">'
               f"\u00b7 preempted {preemptions}\u00d7</span>" if row.preemptions else "")
    return (f'<tr id="job-{job_id}" data-testid="job-row" data-job-id="{job_id}">'
            f'<th scope="row"><a href="{url}" data-testid="job-link">{job_id}</a></th>'
            f'<td data-testid="job-user">{user}</td>'
            f"<td>{name}</td>"
            f'<td data-testid="job-state" data-state="{state}"><span class="state state-{state}">{state}</span></td>'
            f'<td data-testid="job-band" data-band="{band}">{band}{stopped}</td>'
            f"<td>{owner}</td>"
            f'<td class="num">{epoch}</td>'
            f'<td class="num">{attempts}</td>'
            f'<td><time datetime="{iso}" title="{when}">{when}</time></td>'
            f"<td><code>{command}</code></td>"
            f"<td>{label_html}</td>"
            f"<td>{reason}</td></tr>\n")


# Joins a row's values so they are checked and escaped in one call each: printable, and
# left alone by HTML escaping. A value holding one itself takes the per-value path.
_SEP = "\u00a6"


def _cells(values: list[str]) -> list[str]:
    """``values`` as ``_cell`` prints each (control characters shown, then HTML-escaped)."""
    joined = _SEP.join(values)
    if joined.isprintable() and joined.count(_SEP) == len(values) - 1:
        return str(escape(joined)).split(_SEP)
    return [_cell(value) for value in values]


def _cell(value: Any) -> str:
    """One value as the template would print it: control characters shown, then HTML-escaped."""
    return str(escape(visible(text(value))))
