"""The live view's per-client cap, the Jobs page's row escaping (a row's values escaped
at once must print exactly as each escaped alone), and odd stored explanations. Pure."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import given
from hypothesis import strategies as st

from irisfed.services.web import present
from irisfed.services.web.live import Broker, Refused, sse_lines
from irisfed.shared.records import JobListRow

NOW = datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)


def test_one_client_gets_its_share_of_streams_and_no_more():
    broker = Broker(max_viewers=5, viewers_per_client=2)
    mine = [broker.join("10.0.0.1"), broker.join("10.0.0.1")]
    assert all(mine) and broker.join("10.0.0.1") is None
    assert broker.refusal("10.0.0.1") is Refused.CLIENT_FULL
    assert broker.join("10.0.0.2") is not None and broker.refusal("10.0.0.3") is None
    broker.leave(mine[0])
    broker.leave(mine[0])  # twice: counted once
    assert broker.refusal("10.0.0.1") is None and broker.join("10.0.0.1") is not None
    assert broker.join("10.0.0.3") is not None and broker.join("10.0.0.4") is not None  # 5 open
    assert broker.refusal("10.0.0.9") is Refused.FULL and broker.join("10.0.0.9") is None
    broker.close()
    assert broker.refusal("10.0.0.9") is Refused.FULL


def test_one_ipv6_client_cannot_take_every_live_slot_by_changing_its_address() -> None:
    broker = Broker(max_viewers=20, viewers_per_client=2)
    # A host picks any address of its /64 (privacy addresses, or simply at will).
    taken = [broker.join(f"2001:db8:1:2::{i:x}") for i in range(10)]
    assert sum(viewer is not None for viewer in taken) == 2
    assert broker.refusal("2001:db8:1:2:ffff::1") is Refused.CLIENT_FULL
    assert broker.join("2001:db8:1:3::1") is not None  # another network is another client
    # The same IPv4 client written as an IPv4-mapped IPv6 address is the same client.
    assert broker.join("192.0.2.7") is not None and broker.join("::ffff:192.0.2.7") is not None
    assert broker.join("::ffff:c000:207") is None
    # A refused client gets its share back as its streams end.
    for viewer in taken:
        if viewer is not None:
            broker.leave(viewer)
    assert broker.join("2001:db8:1:2::99") is not None


def test_without_a_per_client_share_the_cap_is_the_total():
    broker = Broker(max_viewers=3)
    assert all(broker.join() for _ in range(3)) and broker.refusal() is Refused.FULL


def test_a_batch_is_formatted_once_for_every_viewer():
    broker = Broker()
    broker.job_changed("j1")
    batch = broker.flush()
    assert sse_lines(batch) is sse_lines(batch)


# ---------------------------------------------------------------- rows

cell_text = st.text(st.characters(codec="utf-8"), max_size=30) | st.sampled_from([
    "<script>alert(1)</script>", '"><img src=x onerror=alert(1)>', "a\u00a6b", "\u00a6", "x\x1b[31m", "\u202e",
    "tab\there", "line\nbreak", "&amp;", "'single'"])


@given(st.lists(cell_text, min_size=1, max_size=12))
def test_a_rows_values_escaped_at_once_print_as_each_alone(values):
    assert present._cells(values) == [present._cell(v) for v in values]


def list_row(**changes) -> JobListRow:
    values = dict(job_id="j-1", name="n", state="running", owner_peer_id="gpu", pinned_peer_id=None, epoch=1,
                  attempts=1, priority=0, submitted_at=NOW, updated_at=NOW, exit_code=None, reason="",
                  command=["python", "train.py"], labels={"team": "vision"})
    values.update(changes)
    return JobListRow(**values)


def test_rows_show_hostile_values_as_text():
    hostile = '"><img src=x onerror=alert(1)>'
    html = present.job_rows_html([list_row(name=hostile, reason="<b>x</b> nats://u:pw@h:4222",
                                           command=["sh", "-c", hostile], labels={hostile: hostile, "a": 1},
                                           owner_peer_id=None, pinned_peer_id="<p>")],
                                 lambda job_id: "/jobs/" + present.path_part(job_id))
    assert "<img" not in html and "<b>" not in html and "<p>" not in html and "pw@h" not in html
    assert "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;" in html
    assert "nats://u:***@h:4222" in html and "pinned &lt;p&gt;" in html
    assert '<code class="label">a=1</code>' in html
    assert 'title="2026-01-02 03:04:05"' in html and 'datetime="2026-01-02T03:04:05.678000+00:00"' in html


def test_rows_read_odd_commands_and_labels():
    html = present.job_rows_html([list_row(command={"not": "a list"}, labels=["not", "a", "map"]),
                                  list_row(job_id="j-2", command=["run", 3, None])], lambda job_id: job_id)
    assert "<code>{&#39;not&#39;: &#39;a list&#39;}</code>" in html and "<code>run 3 </code>" in html


def test_path_parts():
    assert present.path_part("job-1_a.b~c") == "job-1_a.b~c"
    assert present.path_part("a/b?c d") == "a%2Fb%3Fc%20d"


# ---------------------------------------------------------------- explanations


def test_an_explanation_that_is_not_an_object_is_text():
    assert present.explained(["a", "<b>"]).raw == '["a", "<b>"]'
    assert present.explained("nats://u:pw@h:4222").raw == '"nats://u:***@h:4222"'
    assert present.explained(42).raw == "42" and present.explained(42).verdicts == []
    assert present.explained("x" * 5000).raw.endswith("…") and len(present.explained("x" * 5000).raw) == 2000
    assert present.explained(None).raw == "" and present.explained({"by": "tick"}).raw == ""


def test_kept_rows_are_reused_only_while_the_row_is_the_same():
    rows = present.JobRows(lambda job_id: "/jobs/" + job_id, keep=2)
    first = rows([list_row()])
    assert rows([list_row()]) == first and len(rows._kept) == 1
    moved = rows([list_row(state="succeeded", attempts=2)])
    assert 'data-state="succeeded"' in moved and moved != first and len(rows._kept) == 2
    rows([list_row(job_id="j-2"), list_row(job_id="j-3")])
    assert len(rows._kept) == 2  # the oldest went
    assert rows([list_row(), list_row(job_id="j-2")]) == present.job_rows_html(
        [list_row(), list_row(job_id="j-2")], lambda job_id: "/jobs/" + job_id)
