"""A NATS cluster just started may not have its nodes current yet: JetStream refuses a
replicated bucket or log stream with "no suitable peers for placement" (10005). That is
the store starting, tried again within ``ensure_buckets``' ``wait_s``, not a refusal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from nats.js import errors as js_errors

from irisfed.services.common.objects import StoreUnavailable, ensure_buckets


class _Cluster:
    """A JetStream context whose cluster places nothing for the first ``refusals`` asks."""

    def __init__(self, refusals: int, only: str = "") -> None:
        self.refusals, self.only = refusals, only  # only: refuse just streams named with it
        self.ages: dict[str, float | None] = {}  # stream -> its max age

    def jetstream(self):
        return self

    @property
    def streams(self) -> set[str]:
        return set(self.ages)

    async def stream_info(self, name: str):
        if name not in self.ages:
            raise js_errors.NotFoundError(code=404, err_code=10059, description="stream not found")
        return SimpleNamespace(config=SimpleNamespace(max_age=self.ages[name]))

    def _place(self, name: str, max_age: float | None) -> None:
        if self.refusals > 0 and self.only in name:
            self.refusals -= 1
            raise js_errors.BadRequestError(code=400, err_code=10005, description="no suitable peers for placement")
        self.ages[name] = max_age

    async def create_object_store(self, bucket: str, config) -> None:
        self._place(f"OBJ_{bucket}", config.ttl)

    async def add_stream(self, config) -> None:
        self._place(config.name, config.max_age)


@pytest.mark.parametrize("only", ["", "logs"], ids=["buckets", "log-streams"])
async def test_too_few_nodes_ready_is_the_store_starting_and_is_tried_again(only):
    cluster = _Cluster(refusals=2, only=only)
    await ensure_buckets(cluster, "t", replicas=3, peers=["gpu-west"], wait_s=30)
    assert cluster.refusals == 0
    assert cluster.streams == {"OBJ_t-workspaces", "OBJ_t-outputs__gpu-west", "t-logs__gpu-west"}


@pytest.mark.parametrize("only", ["", "logs"], ids=["buckets", "log-streams"])
async def test_too_few_nodes_ready_without_waiting_says_so(only):
    with pytest.raises(StoreUnavailable, match="does not have 3 nodes ready"):
        await ensure_buckets(_Cluster(refusals=1, only=only), "t", replicas=3, peers=["gpu-west"], wait_s=0)
