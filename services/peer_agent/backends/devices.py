"""What a run is told of what it asked, and how a subprocess run's devices are recorded
(docs/design.md §3.7, docs/engines.md "Devices"). Pure, no I/O.

Every backend gives each run ``IRISFED_RESOURCES``: the job's normalised request as
compact JSON (``{"cpu":1,"gpu":2}``). Which device indices a subprocess or simulated
run holds is kept by ``LocalNodes`` (nodes.py); a subprocess run's record names them
(``devices`` of its ``run.json``) so that a later agent run counts them as held while
that process lives.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from irisfed.shared.resources import ResourceError, normalize_request

RESOURCES_VARIABLE = "IRISFED_RESOURCES"


def resources_json(resources: Mapping[str, float]) -> str:
    """A run's request as ``IRISFED_RESOURCES`` carries it: normalised (``cpu`` named,
    whole amounts as integers, sorted), compact JSON. An empty request is the default."""
    try:
        request = normalize_request(dict(resources) if resources else None)
    except ResourceError:  # never for an accepted job's request: passed on as it is
        request = dict(sorted(resources.items()))
    return json.dumps(request, separators=(",", ":"))


def parse_devices(raw: object) -> dict[str, list[int]]:
    """A record's ``devices`` (resource → indices); absent (a record from before
    devices) is none. Raises ValueError or TypeError for anything else malformed."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise TypeError(f"devices must be an object, got {raw!r}")
    parsed = {}
    for name, indices in raw.items():
        if not isinstance(indices, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
            raise TypeError(f"devices.{name} must be a list of indices, got {indices!r}")
        parsed[str(name)] = list(indices)
    return parsed
