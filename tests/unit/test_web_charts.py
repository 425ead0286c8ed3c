"""The charts' series: rates per minute, and levels walked back from the counts now."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from irisfed.services.web import charts
from irisfed.shared.records import ChangelogPoint, ChartCount

NOW = datetime(2026, 11, 30, 12, 30, 15, tzinfo=UTC)  # 15 s into the current minute
THIS_MINUTE = NOW.replace(second=0)


def move(minutes_ago: int, from_state: str | None, to_state: str, n: int = 1, peer: str | None = None) -> ChartCount:
    return ChartCount("move", THIS_MINUTE - timedelta(minutes=minutes_ago), from_state, to_state, peer, n)


def now(state: str, n: int, peer: str | None = None) -> ChartCount:
    return ChartCount("now", NOW, None, state, peer, n)


def test_levels_walk_back_from_the_counts_now():
    rows = [
        move(10, None, "queued", 5),  # five submitted ten minutes ago
        move(5, "queued", "assigned", 3, "gpu"),
        move(5, "assigned", "running", 3, "gpu"),
        move(2, "running", "succeeded", 2, "gpu"),
        move(0, "running", "queued", 1, None),  # its peer lost: the store names the peer it ran on ...
        now("queued", 3), now("running", 0, "gpu"),
    ]
    rows[4] = move(0, "running", "queued", 1, "gpu")  # ... as changelog_count_by_minute does
    minutes, queued_now, running_now = charts.fold(rows)
    data = charts.series(NOW, minutes, queued_now, running_now)
    assert len(data["t"]) == 60 and data["t"][-1] == int(THIS_MINUTE.timestamp())
    queued = data["queued"]
    assert queued[-1] == 3 and queued[-2] == 2 and queued[-6] == 2 and queued[-7] == 5 and queued[-11] == 5
    assert queued[-12] == 0 and queued[0] == 0
    gpu = {s["peer"]: s["values"] for s in data["running"]}["gpu"]
    assert gpu[-1] == 0 and gpu[-2] == 1 and gpu[-3] == 1 and gpu[-4] == 3 and gpu[-6] == 3 and gpu[-7] == 0


def test_rates_per_second_and_the_current_minute_so_far():
    minutes, q, r = charts.fold([move(1, "running", "succeeded", 120), move(0, "running", "failed", 30),
                                 move(0, None, "rejected", 9)],
                                {THIS_MINUTE - timedelta(minutes=1): 60, THIS_MINUTE: 15})
    data = charts.series(NOW, minutes, q, r)
    assert data["submits"][-2] == 1.0 and data["submits"][-1] == 1.0  # 15 in the 15 s so far
    assert data["completions"][-2] == 2.0 and data["completions"][-1] == 2.0  # a reject is no completion


def test_levels_never_dip_below_zero_and_many_peers_are_summed():
    rows = [move(0, None, "queued", 4), now("queued", 1)]  # a late commit: more left than the counts allow
    rows += [now("running", i + 1, f"p{i:02}") for i in range(12)]
    minutes, q, r = charts.fold(rows)
    data = charts.series(NOW, minutes, q, r, max_peers=3)
    assert min(data["queued"]) == 0 and data["queued"][-1] == 1
    assert [s["peer"] for s in data["running"]] == ["p11", "p10", "p09", charts.OTHER]
    assert data["running"][-1]["values"][-1] == sum(range(1, 10))


def test_settled_minutes_are_kept_and_fresh_ones_replace_them():
    kept = {100: charts.Minute(submits=1), 160: charts.Minute(submits=2), 220: charts.Minute(submits=3)}
    fresh = {220: charts.Minute(submits=30), 280: charts.Minute(submits=40)}
    merged = charts.merge(kept, fresh, since=220, first=160)
    assert {t: m.submits for t, m in merged.items()} == {160: 2, 220: 30, 280: 40}


class Changelog:
    """Positions with times (and gaps, as identity columns have after rollbacks)."""

    def __init__(self, points: list[tuple[int, datetime]]) -> None:
        self.points = sorted(points)
        self.probes = 0

    async def probe(self, seq: int) -> ChangelogPoint | None:
        self.probes += 1
        return next((ChangelogPoint(s, at) for s, at in self.points if s >= seq), None)


T0 = datetime(2026, 11, 30, tzinfo=UTC)


@pytest.mark.parametrize("target_s, expected", [(-5, 1), (0, 1), (1, 4), (250, 500), (999, 1000), (1000, 1001)])
async def test_bisecting_positions_finds_where_a_time_starts(target_s, expected):
    points = [(1, T0)] + [(2 * i, T0 + timedelta(seconds=i)) for i in range(2, 500)] + [(1000, T0 + timedelta(seconds=999))]
    log = Changelog(points)
    found = await charts.first_seq_from(log.probe, 1, 1000, T0 + timedelta(seconds=target_s))
    first_row = next((seq for seq, _ in log.points if seq >= found), 1001)
    assert first_row == expected  # reading from `found` on starts at the first row that young
    assert log.probes <= 14  # log2 of the range, and one look at the end
