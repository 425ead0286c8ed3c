"""A group-commit batch against a real router: what each producer is told when part of it fails."""

import asyncio
import json
import uuid

from nats.aio.msg import Msg

from irisfed.services.common.store import Store
from irisfed.services.router.plan import plan_new_job
from irisfed.services.router.service import _Pending
from irisfed.shared.errors import Unavailable
from irisfed.shared.messages import SubmitRequest, decode_request


def test_committed_jobs_are_acknowledged_even_when_answering_a_repeat_fails(router, monkeypatch):
    first = router.request("submit", json.dumps({"command": ["true"], "job_id": "old"}).encode())
    assert first["job_id"] == "old"

    async def connection_lost(self, job_ids, statement_timeout_s=None):
        # What the store raises when the connection breaks in the middle of the statement.
        raise Unavailable("database unavailable: connection was closed in the middle of operation")

    monkeypatch.setattr(Store, "job_get_submitted", connection_lost)  # the read after the insert fails

    async def batch_with_a_failing_repeat() -> dict[str, dict]:
        r = router.router
        inbox = f"_T.{uuid.uuid4().hex}"
        replies: dict[str, dict] = {}
        both = asyncio.Event()

        async def on_reply(msg):
            replies[msg.subject.rsplit(".", 1)[1]] = json.loads(msg.data)
            if len(replies) == 2:
                both.set()

        await router.client.subscribe(f"{inbox}.*", cb=on_reply)
        await router.client.flush()
        for job_id in ("new", "old"):
            request = decode_request(SubmitRequest, json.dumps({"command": ["true"], "job_id": job_id}).encode())
            job, reply = plan_new_job(request, r._route(request), job_id)
            # Both queued before any writer runs: one batch.
            r.queue.put_nowait(_Pending(job, reply, Msg(router.service_nc, reply=f"{inbox}.{job_id}"),
                                        r.clock.monotonic()))
        await asyncio.wait_for(both.wait(), 10)
        return replies

    replies = router.run(batch_with_a_failing_repeat())
    assert replies["new"]["job_id"] == "new" and "error" not in replies["new"]  # it is committed: say so
    assert replies["old"]["error"]["code"] == "unavailable"
    assert "same job_id" in replies["old"]["error"]["message"]
    assert router.rows() == 4  # old and new, each with its changelog row
