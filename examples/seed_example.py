"""The seed design's published routing example, unchanged but for its import lines."""

import time

from irisfed.shared.constraints import Constraint, ConstraintOp
from irisfed.shared.federation.peer import build_peers
from irisfed.shared.federation.router import PeerRouter, RoutingRequest, SubmitDisposition


def main() -> SubmitDisposition:
    now = time.time()
    peers = build_peers([
        {"id": "home", "attributes": {"device_type": "cpu"}, "last_heartbeat_at": now},
        {"id": "gpu-west", "attributes": {"device_type": "gpu", "device_variant": "h100"},
         "last_heartbeat_at": now},
        {"id": "tpu-east", "attributes": {"device_type": "tpu"}, "last_heartbeat_at": now},
    ])
    router = PeerRouter(peers)
    constraints = [Constraint(key="device_type", op=ConstraintOp.EQ, value="gpu")]
    request = RoutingRequest(constraints=constraints, local_feasible=False, cluster_pin="")
    plan = router.classify(request)
    print(plan.disposition.value, plan.pinned_peer_id or "-", plan.reason)
    return plan.disposition


if __name__ == "__main__":
    main()
