"""``irisfed up`` says ready only once the router has heard every configured peer
(``_await_ready``), on a stand-in client: what each router answer means."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import pytest

from irisfed.cli import up
from irisfed.errors import UnavailableError
from irisfed.shared.messages import DryRunReply, PeerVerdictMsg

pytestmark = pytest.mark.unit

CONFIG = SimpleNamespace(peer_ids=["home", "gpu-west"], subject_prefix="p")


def _reply(disposition: str, *codes: tuple[str, str], waiting: bool = False) -> DryRunReply:
    verdicts = [PeerVerdictMsg(peer, code) for peer, code in codes]
    return DryRunReply("probe", disposition, "rejected" if disposition == "reject" else "queued", "", "r",
                       verdicts=[] if waiting else verdicts, waiting_verdicts=verdicts if waiting else [])


class _Client:
    def __init__(self, answers):
        self.answers, self.asked = list(answers), []

    async def submit(self, command, **options):
        self.asked.append((command, options))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.fixture
def router(monkeypatch):
    """``answer(*replies)``: the stand-in client answers them in turn (the last for ever)."""
    monkeypatch.setattr(up, "READY_TIMEOUT_S", 0.5)
    monkeypatch.setattr(up, "READY_POLL_S", 0.01)
    made = {}

    def answer(*replies):
        client = _Client(replies)

        def connect(*args, **kwargs):
            made["kwargs"] = kwargs

            @contextlib.asynccontextmanager
            async def opened():
                yield client
            return opened()

        monkeypatch.setattr("irisfed.client.Client.connect", connect)
        made["client"] = client
        return made
    return answer


def _wait(tmp_path):
    return asyncio.run(up._await_ready("nats://x", CONFIG, tmp_path))


def test_peers_never_heard_are_not_ready_though_the_router_names_them(router, tmp_path):
    router(_reply("reject", ("home", "unreachable"), ("gpu-west", "unreachable")))
    assert _wait(tmp_path) == ["home", "gpu-west"]


def test_ready_once_every_peer_is_judged_after_the_router_first_answers(router, tmp_path):
    made = router(UnavailableError("no router answered"), _reply("reject", ("home", "unreachable")),
                  _reply("reject", ("home", "missing_attribute"), ("gpu-west", "unreachable")),
                  _reply("reject", ("home", "missing_attribute"), ("gpu-west", "missing_attribute")))
    assert _wait(tmp_path) == []
    assert len(made["client"].asked) == 4
    command, options = made["client"].asked[0]
    assert command == ["true"] and options["dry_run"] is True and options["constraints"] == [up.READY_PROBE]


def test_a_peer_still_discovering_its_engine_counts_as_heard(router, tmp_path):
    router(_reply("queue", ("home", "discovering"), ("gpu-west", "missing_attribute"), waiting=True))
    assert _wait(tmp_path) == []


def test_one_peer_left_unheard_is_named(router, tmp_path):
    router(_reply("reject", ("home", "missing_attribute"), ("gpu-west", "unreachable")))
    assert _wait(tmp_path) == ["gpu-west"]


def test_the_probe_asks_as_the_default_user_whatever_the_shell_exports(router, tmp_path, monkeypatch):
    monkeypatch.setenv("IRISFED_USER", "alice")
    made = router(_reply("reject", ("home", "missing_attribute"), ("gpu-west", "missing_attribute")))
    assert _wait(tmp_path) == []
    assert made["kwargs"]["user"] == "default" and made["kwargs"]["state_dir"] == tmp_path
