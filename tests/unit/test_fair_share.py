"""Fair share and quotas in placement (shared/fair_share.py): the order users' jobs go in."""

from hypothesis import given
from hypothesis import strategies as st

from irisfed.shared.fair_share import FairShareRun, federation_totals, within_quota
from irisfed.shared.federation.peer import Backend, FederationPeer
from irisfed.shared.placement import PlacementRun
from irisfed.shared.resources import Amount, Resources
from irisfed.shared.rooms import Placement, QueuedJob
from irisfed.shared.users import QUOTA, UserConfig, UserTable, quota_units

NOW = 100.0


def peer(peer_id="p", slots=4, **resources):
    offered = {name: Amount(total, total) for name, total in resources.items()}
    return FederationPeer(peer_id, (Backend("main", {}, total=slots, free=slots, resources=offered),),
                          last_heartbeat_at=NOW - 1, ttl_s=6)


def jobs(user, count, waited=0.0, **resources):
    request = Resources(resources or None)
    return [QueuedJob(f"{user}-{i}", 0, resources=request, waited_s=waited - i * 0.001) for i in range(count)]


def run(peers, users=(), held=None, live=None):
    return FairShareRun(PlacementRun(peers, live or {}, NOW), UserTable.of(users), held or {})


def order(placements):
    return [p.job_id.split("-")[0] for p in placements]


def test_totals_count_slots_and_advertised_resources():
    peers = [peer("a", slots=4, gpu=8, cpu=16), peer("b", slots=2, cpu=4)]
    assert federation_totals(peers) == {"slots": 6, "gpu": 8, "cpu": 20_000}
    gone = FederationPeer("c", peers[0].backends, last_heartbeat_at=NOW - 100, ttl_s=6)
    assert federation_totals([*peers, gone], NOW) == federation_totals(peers)
    assert run([*peers, gone]).totals == {"slots": 6, "gpu": 8, "cpu": 20_000}


def test_one_user_is_placed_in_its_own_order():
    placements, waiting = run([peer(slots=3)]).place({"alice": jobs("alice", 5)})
    assert [p.job_id for p in placements] == ["alice-0", "alice-1", "alice-2"]
    assert [w.job_id for w in waiting] == ["alice-3", "alice-4"]


def test_a_newcomer_gets_room_before_a_backlog_older_than_it():
    # Alice queued long ago and holds 2 of 4 slots; bob's newer jobs go first until he
    # holds as much.
    fair = run([peer(slots=6)], held={"alice": {"slots": 2}}, live={("p", "main"): 2})
    placements, _ = fair.place({"alice": jobs("alice", 10, waited=100), "bob": jobs("bob", 10, waited=1)})
    assert order(placements) == ["bob", "bob", "alice", "bob"]


def test_equal_shares_go_to_whoever_waited_longest():
    placements, _ = run([peer(slots=4)]).place({"alice": jobs("alice", 5, waited=1),
                                                 "bob": jobs("bob", 5, waited=9)})
    assert order(placements) == ["bob", "alice", "bob", "alice"]


def test_weights_scale_the_share():
    users = [UserConfig("alice"), UserConfig("bob", weight=3)]
    placements, _ = run([peer(slots=8)], users).place({"alice": jobs("alice", 20, waited=9),
                                                        "bob": jobs("bob", 20, waited=1)})
    assert order(placements).count("bob") == 6 and order(placements).count("alice") == 2


def test_the_dominant_resource_decides():
    # Alice's jobs each take half the GPUs; bob's a slot. After one alice job she holds
    # 50% of the gpu, so bob's cheap jobs take the rest of the slots first.
    fair = run([peer(slots=8, gpu=4, cpu=64)])
    placements, _ = fair.place({"alice": jobs("alice", 2, waited=9, gpu=2, cpu=1),
                                "bob": jobs("bob", 8, waited=1, cpu=1)})
    assert order(placements)[:2] == ["alice", "bob"]
    assert order(placements).index("alice", 1) > 3


def test_priorities_order_only_their_own_user():
    # Alice's high priority does not jump bob's queue: the tick hands each user's jobs
    # in that user's order and fair share picks the user.
    alice = [QueuedJob("alice-urgent", 0, waited_s=0.5)] + jobs("alice", 3, waited=0.4)
    placements, _ = run([peer(slots=5)], held={"alice": {"slots": 3}}, live={("p", "main"): 3}).place(
        {"alice": alice, "bob": jobs("bob", 3, waited=0.1)})
    assert [p.job_id for p in placements] == ["bob-0", "bob-1"]


def test_quota_holds_back_a_user_and_says_why():
    users = [UserConfig("alice", quota={"gpu": 2})]
    placements, waiting = run([peer(slots=8, gpu=8, cpu=64)], users).place(
        {"alice": jobs("alice", 4, gpu=1, cpu=1), "bob": jobs("bob", 2, gpu=1, cpu=1)})
    assert sorted(p.job_id for p in placements) == ["alice-0", "alice-1", "bob-0", "bob-1"]
    assert [(w.job_id, w.code) for w in waiting] == [("alice-2", QUOTA), ("alice-3", QUOTA)]
    assert waiting[0].reason == "quota: this job's 1 gpu would take alice over its quota of 2 gpu"


def test_quota_counts_what_the_user_already_holds_and_later_batches():
    users = [UserConfig("alice", quota={"slots": 3})]
    fair = run([peer(slots=8)], users, held={"alice": {"slots": 2}})
    placements, waiting = fair.place({"alice": jobs("alice", 2)})
    assert [p.job_id for p in placements] == ["alice-0"] and waiting[0].code == QUOTA
    placements, waiting = fair.place({"alice": [QueuedJob("alice-later", 0)]})
    assert placements == [] and waiting[0].code == QUOTA
    fair.release("alice", Placement("alice-0", 0, "p", "main"), None)
    placements, _ = fair.place({"alice": [QueuedJob("alice-again", 0)]})
    assert [p.job_id for p in placements] == ["alice-again"]


def test_within_quota_keeps_placements_in_order_until_the_cap():
    users = UserTable.of([UserConfig("alice", quota={"gpu": 3})])
    gpu = Resources({"gpu": 1})
    placed = [(Placement(f"a{i}", 0, "p", "main"), "alice", gpu) for i in range(3)]
    placed.append((Placement("b0", 0, "p", "main"), "bob", gpu))
    kept, over = within_quota(placed, users, {"alice": {"gpu": 1, "slots": 1}})
    assert [p.job_id for p in kept] == ["a0", "a1", "b0"]
    assert [(w.job_id, w.code) for w in over] == [("a2", QUOTA)]


@given(st.lists(st.tuples(st.sampled_from(["alice", "bob", "carol"]), st.integers(0, 3)), max_size=40),
       st.integers(0, 4), st.integers(1, 12))
def test_no_run_ever_places_a_user_over_its_quota(requests, held_gpu, slots):
    users = [UserConfig("alice", quota={"gpu": 3}), UserConfig("bob", quota={"gpu": 1, "slots": 2})]
    table = UserTable.of(users)
    by_user: dict[str, list[QueuedJob]] = {}
    for n, (user, gpu) in enumerate(requests):
        by_user.setdefault(user, []).append(QueuedJob(f"{user}-{n}", 0, resources=Resources({"gpu": gpu, "cpu": 0})))
    held = {"alice": {"gpu": held_gpu, "slots": 1}}
    placements, waiting = run([peer(slots=slots, gpu=100)], users, held=held).place(by_user)
    gpu_of = {job.job_id: job.resources.get("gpu") for js in by_user.values() for job in js}
    for user in ("alice", "bob"):
        mine = [p.job_id for p in placements if p.job_id.startswith(user)]
        quota = table.get(user).quota
        gpu_now = held.get(user, {}).get("gpu", 0) + sum(gpu_of[j] for j in mine)
        assert gpu_now <= max(quota_units("gpu", quota["gpu"]), held.get(user, {}).get("gpu", 0))
        if "slots" in quota:
            assert len(mine) <= quota["slots"]
    assert len(placements) + len(waiting) == len(requests)


def test_a_claim_takes_an_equal_part_of_the_batch_and_more_with_many_users():
    from irisfed.shared.fair_share import CLAIM_BATCHES_AT_MOST, claim_share

    assert claim_share(1000, 1) == 1000
    assert claim_share(1000, 2) == 500
    assert claim_share(1000, 100) == 10
    assert claim_share(1000, 1000) == 10  # ten batches' worth at most in one claim
    assert claim_share(1000, 100_000) == 1
    assert claim_share(2, 1) == 2 and claim_share(2, 2) == 2  # never more of one user than a batch
    assert all(claim_share(1000, n) * n <= CLAIM_BATCHES_AT_MOST * 1000 or claim_share(1000, n) == 1
               for n in range(1, 20_000, 7))
