"""A Postgres primary that HANGS (its machine black-holed: connections stay open, not a
byte moves, nothing is reset) while Patroni fails over to the synchronous standby.

Every Patroni node's port is reached through a TcpProxy of its own, and the services'
multi-host URL names the proxies. The leader's proxy is stalled (``TcpProxy.stall``:
connections accepted and held, silent) and the leader's Patroni and postmaster are
SIGKILLed, so Patroni promotes the standby while the old primary's address keeps
swallowing connections for the rest of the test.

What must hold (docs/operations.md, "High availability"; docs/design.md invariant 13):

- every submit is answered (``unavailable`` while there is no primary) within about
  twice ``--submit-timeout``: never silence;
- once the standby is promoted the federation acknowledges again, without a restart,
  with the hanging primary listed first (compose lists ``pg-1`` first; the services'
  pools moving off a hung connection with the standby listed first is
  tests/integration/test_db_timeouts.py's);
- every acknowledged submit is on the new primary and ends;
- ``irisfed.client``'s reads (``get``) answer, or fail ``unavailable``, rather than
  hang on the black-holed primary, and read the new primary once it is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import pytest

from irisfed.shared.lifecycle import TERMINAL_STATES
from irisfed.tooling.ha import PatroniCluster, PatroniNode
from irisfed.tooling.proxy import TcpProxy
from tests.e2e.conftest import Federation
from tests.infra.ha import fresh_federation, other_node, retrying, start_simulated
from tests.infra.probes import returns
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

SUBMIT_TIMEOUT_S = 2.0  # the router's default --submit-timeout
# The documented answer bound is about twice --submit-timeout; a little slack for a
# loaded two-core machine. A request not answered within this is "silence".
REPLY_BOUND_S = 2 * SUBMIT_TIMEOUT_S + 3.0
PRODUCERS = 4
# How long after the standby's promotion the federation may take to acknowledge again.
# Generous (a bound on a hang, not an expectation): the services' own --db-timeout is 15 s.
RECOVER_WITHIN_S = 120.0


def _url_via(proxies: list[TcpProxy], database: str) -> str:
    hosts = ",".join(f"127.0.0.1:{p.port}" for p in proxies)
    return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"


@pytest.fixture
async def hung_world(patroni, tmp_path, servers, subject_prefix, nats_client):
    """A fresh database on a healthy Patroni cluster, one proxy per node, and a
    federation whose services are not started yet (the test picks the URL's order)."""
    async with fresh_federation(patroni, tmp_path, servers, subject_prefix, nats_client, "hung") as fed:
        proxies = {node.name: TcpProxy("127.0.0.1", node.pg_port) for node in patroni.nodes}
        try:
            yield fed, patroni, proxies, fed.database_url.rsplit("/", 1)[1].split("?")[0]
        finally:
            for proxy in proxies.values():
                proxy.restore(drop=True)
                proxy.close()


async def _start(fed: Federation, url: str) -> None:
    fed.database_url = url  # every service (and the CLI) through the proxies, in this order
    await start_simulated(fed, "--submit-timeout", str(SUBMIT_TIMEOUT_S))


class Producers:
    """``PRODUCERS`` producers, each submitting new jobs one after another, each retried
    with its job_id until acknowledged; every request waits ``REPLY_BOUND_S``."""

    def __init__(self, fed: Federation, prefix: str) -> None:
        self.fed = fed
        self.prefix = prefix
        self.stop = asyncio.Event()
        self.acked: dict[str, float] = {}  # job_id -> when the acknowledged request was sent
        self.silent: list[tuple[str, float]] = []  # (job_id, when sent) of requests never answered
        self.errors: dict[str, int] = {}
        self.tasks: list[asyncio.Task] = []

    def body(self, job_id: str) -> dict:
        return {"job_id": job_id, "command": ["true"], "labels": {"sim.duration_s": "0.05"}}

    async def _one(self, worker: int) -> None:
        n = 0
        while not self.stop.is_set():
            job_id = f"{self.prefix}-{worker}-{n}"
            while not self.stop.is_set():
                sent = time.monotonic()
                reply = await self.fed.request("submit", self.body(job_id), timeout=REPLY_BOUND_S)
                if reply is None:
                    self.silent.append((job_id, sent))
                elif "error" in reply:
                    code = reply["error"]["code"]
                    self.errors[code] = self.errors.get(code, 0) + 1
                else:
                    self.acked.setdefault(job_id, sent)
                    break
                await asyncio.sleep(0.2)
            n += 1

    def start(self) -> None:
        self.tasks = [asyncio.ensure_future(self._one(i)) for i in range(PRODUCERS)]

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)

    def acked_after(self, when: float) -> int:
        return sum(1 for sent in self.acked.values() if sent > when)


async def _fail_over_a_hanging_primary(fed: Federation, cluster: PatroniCluster, proxies: dict[str, TcpProxy],
                                       leader: PatroniNode) -> None:
    """Producers running throughout: black-hole the leader, kill it, wait for the promotion
    and for acknowledgements on the new primary; then check what every producer saw."""
    producers = Producers(fed, f"h{uuid.uuid4().hex[:4]}")
    producers.start()
    try:
        await wait_for(lambda: returns(len(producers.acked) >= 20), "20 acknowledgements before the fault",
                       timeout=60)
        proxies[leader.name].stall()  # its machine black-holed: connections held open, silent
        killed_at = time.monotonic()
        old = await asyncio.to_thread(cluster.kill_leader)
        assert old is leader
        new = await asyncio.to_thread(cluster.wait_leader, 120.0, old)
        promoted_at = time.monotonic()
        assert new is not old
        try:
            await wait_for(lambda: returns(producers.acked_after(promoted_at) >= 10),
                           "10 submits acknowledged on the new primary", timeout=RECOVER_WITHIN_S)
        except AssertionError:
            raise AssertionError(
                f"no federation recovery: {producers.acked_after(promoted_at)} submits acknowledged in "
                f"{RECOVER_WITHIN_S:.0f}s after {new.name} was promoted while the old primary {old.name} "
                f"hangs (URL {fed.database_url}); errors {producers.errors}; unanswered {len(producers.silent)};"
                f"\nrouter log tail:\n{_tail(fed, 'router')}") from None
    finally:
        await producers.finish()
    silent_after_fault = [(j, round(t - killed_at, 1)) for j, t in producers.silent if t > killed_at]
    assert producers.silent == [], (
        f"submits left unanswered for {REPLY_BOUND_S:.0f}s (the router answers within ~2x --submit-timeout): "
        f"{silent_after_fault[:10]} (s after the fault), {len(producers.silent)} in all")
    assert set(producers.errors) <= {"unavailable"}, producers.errors
    # Nothing acknowledged is lost: every acknowledged job is on the new primary, and ends.
    stored = {r.job_id: r.state for r in await retrying(fed.store.job_list_states)}
    missing = sorted(set(producers.acked) - set(stored))
    assert not missing, f"acknowledged but not on the new primary: {missing[:10]}"

    async def all_ended():
        rows = {r.job_id: r.state for r in await retrying(fed.store.job_list_states)}
        left = [j for j in producers.acked if rows.get(j) not in TERMINAL_STATES]
        return not left or None
    await wait_for(all_ended, f"{len(producers.acked)} acknowledged jobs to end", timeout=180)


def _tail(fed: Federation, name: str, lines: int = 12) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(fed.log(name).splitlines()[-lines:])
    return ""


async def test_a_hanging_primary_listed_first_fails_over_and_submits_are_acknowledged_again(hung_world):
    """compose's URL lists pg-1 first; pg-1 is the primary and its machine black-holes.
    The services must still reach pg-2 once it is promoted: a host that swallows the
    connection attempt must not cost every attempt its whole connect budget."""
    fed, cluster, proxies, database = hung_world
    leader = cluster.leader()
    standby = other_node(cluster, leader)
    await _start(fed, _url_via([proxies[leader.name], proxies[standby.name]], database))
    await _fail_over_a_hanging_primary(fed, cluster, proxies, leader)


async def test_the_client_reads_of_a_hanging_primary_fail_unavailable_then_read_the_new_one(hung_world):
    """``irisfed.client``'s ``get`` on a pool whose connection goes to the primary that then
    hangs: it must raise ``UnavailableError`` (the services bound every statement by
    --db-timeout, 15 s), not hang for ever; after the promotion it reads the job from the
    new primary. The standby is listed first, so connecting anew is not what is tested."""
    from irisfed.client import Client, UnavailableError

    fed, cluster, proxies, database = hung_world
    leader = cluster.leader()
    standby = other_node(cluster, leader)
    url = _url_via([proxies[standby.name], proxies[leader.name]], database)
    await _start(fed, url)
    reply = await fed.submit({"job_id": "read-me", "command": ["true"], "labels": {"sim.duration_s": "0.05"}})
    assert "error" not in reply, reply
    client = await Client.connect(fed.nats_url_for("operator"), url, prefix=fed.prefix)
    try:
        assert (await client.get("read-me")).job_id == "read-me"  # its pool now holds a connection to the leader
        proxies[leader.name].stall()
        old = await asyncio.to_thread(cluster.kill_leader)
        outcome = None
        try:
            await asyncio.wait_for(client.get("read-me"), timeout=90)
            outcome = "answered"
        except UnavailableError:
            outcome = "unavailable"
        except TimeoutError:
            outcome = "hung"
        assert outcome != "hung", (
            "client.get() on a primary that hangs never returned in 90 s (no statement timeout on "
            "irisfed.client's pool): a producer's get/wait/watch blocks for ever on a black-holed primary")
        await asyncio.to_thread(cluster.wait_leader, 120.0, old)

        async def read_again():
            with contextlib.suppress(UnavailableError, TimeoutError):
                return (await asyncio.wait_for(client.get("read-me"), timeout=20)).job_id == "read-me"
            return False
        await wait_for(read_again, "client.get to read the new primary", timeout=120)
    finally:
        await client.close()
