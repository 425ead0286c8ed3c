"""NATS users per role with subject permissions, generated from a federation.

Roles and what they may do (``P`` is the subject prefix):

| role | publish | subscribe |
|---|---|---|
| producer (the user ``default``) | P.submit, P.cancel, P.read.* (its own jobs' logs), own objects | _INBOX_producer.> (its replies), P.uevents.default.> (its jobs' events) |
| user-U (each configured user U) | P.submit.U, P.cancel.U, P.read.*.U, own objects | _INBOX_user-U.> (its replies), P.uevents.U.> (its jobs' events) |
| operator | P.submit, P.cancel, P.operator.cancel, P.operator.read.*, P.tick.ping, all objects, log reads | P.events.*, P.uevents.>, P.heartbeat.*, _INBOX_operator.> |
| router | P.assign.*, P.cancel.*, P.events.*, P.uevents.>, P.tick.wake, workspace and log reads, _INBOX_agent-*.> (a fetch's end), replies | P.submit(.*), P.cancel(.*), P.operator.cancel, P.heartbeat.*, P.fetch.*, P.read.>, P.operator.read.*, _INBOX_router.> |
| tick | P.assign.*, P.cancel.* (preemption kills), P.events.*, P.uevents.>, replies | P.heartbeat.*, P.tick.wake, P.tick.ping |
| agent-X | P.heartbeat.X, P.events.*, P.uevents.>, P.fetch.X, outputs at X (write), P.logs.X.> and X's log stream (read, purge) | P.assign.X, P.cancel.X, _INBOX_agent-X.> |

Objects are :func:`object_store_rights`: JetStream API subjects of named buckets, nothing
else of JetStream. Each user has its own workspaces bucket and, at each peer, a bucket
of its outputs from there; "own objects" is writing its workspaces and reading them
and its outputs, no other user's. An agent reads no workspace bucket: it asks on
``P.fetch.X`` (which only agent X may publish) and the router, for a job assigned to
X only, has the store send the bytes to agent X's inbox (which only the router, the
store's answers to the router's requests and X's own replies reach). It writes outputs only at its peer, where readers look only for runs Postgres
says that peer owned (docs/decisions.md, "The object store's rights").
| web | P.operator.cancel (an operator's cancel), P.operator.read.*, log reads | P.events.*, P.uevents.>, P.heartbeat.*, _INBOX_web.> |
| admin | everything | everything |

So a peer agent cannot advertise as another peer nor read another peer's
assignments, a producer can only ask, and a user can only ask for itself: the router
takes the user from the subject, which only that user's credentials may publish
(docs/design.md §3.2). No user id is a peer id (the configuration refuses it), so
``P.cancel.U`` is never also a peer's cancel notices. Replies are private too: a user that
makes requests gets its own inbox prefix, ``_INBOX_<user>`` (:func:`inbox_prefix`),
and may subscribe only below it, never to ``_INBOX.>`` where everyone's replies
would be; our clients derive the prefix from the user in their URL
(:func:`inbox_prefix_for_url`). The router and agents get an inbox for the object
store's answers; the tick and web make no requests, so they get none.
Passwords are random; they live in a 0600 credentials file and reach services in
their URL, never in logs.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from irisfed.services.common.private import write_private
from irisfed.shared.nats_urls import inbox_prefix
from irisfed.shared.users import DEFAULT_USER, USER_ROLE_PREFIX

AGENT_ROLE_PREFIX = "agent-"  # peer P's agent's NATS user is `agent-P`
SERVICE_ROLES = ("producer", "operator", "router", "tick", "web")  # and admin, who may do anything


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False


def user_role(user_id: str) -> str:
    """The NATS user of configured user ``user_id``."""
    return f"{USER_ROLE_PREFIX}{user_id}"


def object_store_rights(prefix: str, users: Iterable[str] = (DEFAULT_USER,), *, read: Iterable[str] = (),
                        write: Iterable[str] = (), peers: Iterable[str | None] = (None,)) -> tuple[str, ...]:
    """What a role publishes to use the object store (docs/design.md §3.5) through
    JetStream's API: for each of ``users`` and each of ``peers`` (None: the user's own
    bucket, else its bucket at that peer), look up and read the buckets of the kinds in
    ``read``, and also write and replace objects in those in ``write`` — and nothing
    else of JetStream (no stream created, changed or deleted). Each user's buckets, and
    each at each peer, are streams of their own, so these rights are the server's
    border between users and between peers. The answers come to the role's own inbox."""
    from irisfed.services.common.objects import bucket

    read, write = tuple(read), tuple(write)
    if not read and not write:
        return ()
    rights = ["$JS.API.INFO"]
    # A wildcard prefix (a test server shared by many federations): any bucket.
    targets = ([("*", "*", True)] if prefix == "*" else
               [(name, f"OBJ_{name}", kind in write)
                for user in dict.fromkeys(users) for peer in dict.fromkeys(peers)
                for kind in dict.fromkeys((*read, *write)) for name in (bucket(prefix, kind, user, peer),)])
    for name, stream, writes in targets:
        # Reads are direct gets only: no consumer, since a consumer delivers to any subject
        # its creator names (the server does not check the creator may publish there),
        # which would let a user speak on another's submit subject.
        rights += [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}",
                   f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>"]
        if writes:
            rights += [f"$JS.API.STREAM.PURGE.{stream}", f"$O.{name}.>"]
    return tuple(dict.fromkeys(rights))


def log_rights(prefix: str, peers: Iterable[str], *, ship: bool = False) -> tuple[str, ...]:
    """Reading ``peers``' log streams (docs/design.md §3.6) by direct gets; with ``ship``,
    also publishing to their log subjects and purging their oldest pieces (an agent, for
    its own peer only: the stream is the peer's, so the purge reaches no one else's)."""
    from irisfed.services.common.logstore import log_stream
    from irisfed.shared.logs import peer_logs_subjects

    peers = tuple(peers)
    streams = ["*"] if prefix == "*" else [log_stream(prefix, peer) for peer in peers]
    rights: list[str] = []
    for stream in streams:
        rights += [f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>"]
        if ship:
            rights.append(f"$JS.API.STREAM.PURGE.{stream}")
    if ship:
        rights += [peer_logs_subjects(prefix, peer) for peer in peers]
    return tuple(rights)


def role_permissions(prefix: str, peer_ids: Iterable[str], user_ids: Iterable[str] = ()) -> dict[str, Permissions]:
    """The permission set of every role for a federation's prefix, peers and users."""
    p = prefix
    user_ids, peer_ids = tuple(user_ids), tuple(peer_ids)
    everyone = (DEFAULT_USER, *user_ids)
    both = ("workspaces", "outputs")

    def own_objects(user: str) -> tuple[str, ...]:
        """A user puts and reads its own workspaces and reads its outputs at every peer."""
        return tuple(dict.fromkeys((
            *object_store_rights(prefix, (user,), read=("workspaces",), write=("workspaces",)),
            *object_store_rights(prefix, (user,), read=("outputs",), peers=peer_ids))))

    # The router reads every user's workspaces and sends a job's to the agent of the
    # job's peer (only, which it checks), on that agent's inbox; an agent reads no
    # workspace bucket and writes outputs at its own peer; the dashboard reads outputs
    # (for a logged-in operator); operators do everything.
    operator = tuple(dict.fromkeys((
        *object_store_rights(prefix, everyone, read=("workspaces",), write=("workspaces",)),
        *object_store_rights(prefix, everyone, read=both, write=both, peers=peer_ids),
        *log_rights(prefix, peer_ids))))
    router = (*object_store_rights(prefix, everyone, read=("workspaces",)),
              *(f"{inbox_prefix(f'agent-{peer_id}')}.>" for peer_id in peer_ids),
              *log_rights(prefix, peer_ids))  # a user's logs, read for it
    web = (*object_store_rights(prefix, everyone, read=("outputs",), peers=peer_ids),  # an operator's download
           *log_rights(prefix, peer_ids))
    own = own_objects(DEFAULT_USER)
    roles = {
        "producer": Permissions((f"{p}.submit", f"{p}.cancel", f"{p}.read.*", *own),
                                (f"{p}.uevents.{DEFAULT_USER}.>", f"{inbox_prefix('producer')}.>")),
        "operator": Permissions((f"{p}.submit", f"{p}.cancel", f"{p}.operator.cancel", f"{p}.operator.read.*",
                                 f"{p}.tick.ping", *operator),
                                (f"{p}.events.*", f"{p}.uevents.>", f"{p}.heartbeat.*",
                                 f"{inbox_prefix('operator')}.>")),
        "router": Permissions((f"{p}.assign.*", f"{p}.cancel.*", f"{p}.events.*", f"{p}.uevents.>", f"{p}.tick.wake",
                               *router),
                              (f"{p}.submit", f"{p}.submit.*", f"{p}.cancel", f"{p}.cancel.*",
                               f"{p}.operator.cancel", f"{p}.heartbeat.*", f"{p}.fetch.*", f"{p}.read.>",
                               f"{p}.operator.read.*",
                               f"{inbox_prefix('router')}.>"),
                              allow_responses=True),
        "tick": Permissions((f"{p}.assign.*", f"{p}.cancel.*", f"{p}.events.*", f"{p}.uevents.>"),
                            (f"{p}.heartbeat.*", f"{p}.tick.wake", f"{p}.tick.ping"), allow_responses=True),
        "web": Permissions((f"{p}.operator.cancel", f"{p}.operator.read.*", *web),
                           (f"{p}.events.*", f"{p}.uevents.>", f"{p}.heartbeat.*", f"{inbox_prefix('web')}.>")),
        "admin": Permissions((">",), (">",)),
    }
    for user_id in user_ids:
        role = user_role(user_id)
        roles[role] = Permissions((f"{p}.submit.{user_id}", f"{p}.cancel.{user_id}", f"{p}.read.*.{user_id}",
                                   *own_objects(user_id)),
                                  (f"{p}.uevents.{user_id}.>", f"{inbox_prefix(role)}.>"))
    for peer_id in peer_ids:
        role = f"agent-{peer_id}"
        agent = (*object_store_rights(prefix, everyone, write=("outputs",), peers=(peer_id,)),
                 *log_rights(prefix, (peer_id,), ship=True))
        roles[role] = Permissions(
            (f"{p}.heartbeat.{peer_id}", f"{p}.events.*", f"{p}.uevents.>", f"{p}.fetch.{peer_id}", *agent),
            (f"{p}.assign.{peer_id}", f"{p}.cancel.{peer_id}", f"{inbox_prefix(role)}.>"))
    return roles


def generate_credentials(roles: Iterable[str]) -> dict[str, str]:
    """A fresh random password per role."""
    return {role: secrets.token_urlsafe(24) for role in roles}


def _list(items: Iterable[str]) -> str:
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"


def render_server_config(permissions: dict[str, Permissions], passwords: dict[str, str]) -> str:
    """The nats-server ``authorization`` block for these roles."""
    users = []
    for role, perms in permissions.items():
        body = (f"publish: {{ allow: {_list(perms.publish)} }}, "
                f"subscribe: {{ allow: {_list(perms.subscribe)} }}")
        if perms.allow_responses:
            body += ", allow_responses: true"
        users.append(f"    {{ user: {json.dumps(role)}, password: {json.dumps(passwords[role])}, "
                     f"permissions: {{ {body} }} }}")
    return "authorization {\n  users: [\n" + "\n".join(users) + "\n  ]\n}\n"


def with_credentials(url: str, user: str, password: str) -> str:
    """Every server of ``url`` (comma-separated) with ``user:password`` in it."""
    urls = []
    for part in url.split(","):
        parts = urlsplit(part.strip())
        host = parts.netloc.rsplit("@", 1)[-1]
        urls.append(urlunsplit(parts._replace(netloc=f"{quote(user)}:{quote(password, safe='')}@{host}")))
    return ",".join(urls)


def role_for_service(command: str, peer_id: str | None = None) -> str:
    return f"agent-{peer_id}" if command == "peer-agent" else command


@dataclass
class NatsAuth:
    """Generated users for one federation: the server config and each role's URL."""

    permissions: dict[str, Permissions]
    passwords: dict[str, str]

    @classmethod
    def create(cls, prefix: str, peer_ids: Iterable[str], user_ids: Iterable[str] = (),
               keep: dict[str, str] | None = None) -> NatsAuth:
        """Users for these roles; ``keep``: passwords to keep for roles that still exist
        (adding a user or a peer then changes no one else's credentials)."""
        permissions = role_permissions(prefix, peer_ids, user_ids)
        fresh = generate_credentials(role for role in permissions if role not in (keep or {}))
        return cls(permissions, {role: (keep or {}).get(role) or fresh[role] for role in permissions})

    def server_config(self) -> str:
        return render_server_config(self.permissions, self.passwords)

    def url(self, base_url: str, role: str) -> str:
        return with_credentials(base_url, role, self.passwords[role])

    def write(self, folder: Path) -> tuple[Path, Path]:
        """``nats-auth.conf`` for the server, ``nats-credentials.json`` (0600) for clients."""
        folder.mkdir(parents=True, exist_ok=True)
        conf, creds = folder / "nats-auth.conf", folder / "nats-credentials.json"
        for path, text in ((conf, self.server_config()), (creds, json.dumps(self.passwords, indent=2))):
            write_private(path, text)
        return conf, creds
