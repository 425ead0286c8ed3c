"""Every README snippet marked ``<!-- snippet: NAME [file=F] [requires=A,B] [check=K] -->``
runs exactly as written against a real ``irisfed up`` (started here from nothing, in a
folder of its own, as a new user would):

- a ``sh`` snippet runs with bash (``-e -o pipefail``) in the folder where ``irisfed up``
  runs, with this venv's ``bin`` first on PATH (``irisfed``, ``python3``), as after
  ``pip install -e .`` and activating the venv; it evaluates ``irisfed env`` itself, as
  the README says to;
- a snippet with ``file=F`` is saved as F there, for the ``sh`` snippet that runs it;
- ``requires=`` names programs it needs: without them it is skipped, except that under
  CI (``CI=true``) a missing ``node``/``npm`` fails (CI has them); the ``nats`` CLI is
  not installed by CI, and the README says so;
- ``check=submit-request``: a JSON body that the router's strict decoder must accept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from irisfed.shared.messages import SubmitRequest, decode_request
from tests.e2e.conftest import ROOT

pytestmark = pytest.mark.e2e

README = ROOT / "README.md"
MARKER = re.compile(
    r"^<!-- snippet: (?P<name>[\w-]+)(?P<attrs>(?: [\w-]+=\S+)*) -->\n```(?P<lang>\w*)\n(?P<body>.*?)\n```$",
    re.MULTILINE | re.DOTALL)
IN_CI = os.environ.get("CI") == "true"
# Programs CI has: a snippet needing one of these fails under CI when it is missing.
CI_HAS = {"node", "npm"}

# What each snippet that runs must print (regular expressions, searched line by line).
EXPECTED: dict[str, list[str]] = {
    "producer-node-run": [r"^\S+: queue$", r"^\S+: queue in sha256:[0-9a-f]{64}$"],
    "python-client-run": [
        r"^\S+: queue \(rule 3",                   # submitted, queued for a GPU peer
        r"^  running on gpu-west: ",               # watched through its states...
        r"^  succeeded on gpu-west: exit code 0$",  # ...to the end
        r"^  gpu-west: insufficient_resources gpu: asked 64, at most 8",  # a reject's verdicts
        r"^  conflict: ",                          # an error reply as an exception
        r"^succeeded exit=0$",                     # the sync client
    ],
}


@dataclass(frozen=True)
class Snippet:
    name: str
    lang: str
    body: str
    attrs: dict[str, str]

    @property
    def file(self) -> str | None:
        return self.attrs.get("file")

    @property
    def requires(self) -> list[str]:
        return [r for r in self.attrs.get("requires", "").split(",") if r]

    @property
    def runs(self) -> bool:
        return self.lang == "sh" and not self.file and "check" not in self.attrs


def readme_snippets(text: str) -> dict[str, Snippet]:
    snippets: dict[str, Snippet] = {}
    for match in MARKER.finditer(text):
        attrs = dict(pair.split("=", 1) for pair in match["attrs"].split())
        snippet = Snippet(match["name"], match["lang"], match["body"], attrs)
        assert snippet.name not in snippets, f"two README snippets are named {snippet.name}"
        snippets[snippet.name] = snippet
    return snippets


SNIPPETS = readme_snippets(README.read_text())
RUNNABLE = sorted(name for name, snippet in SNIPPETS.items() if snippet.runs)


# ---------------------------------------------------------------- the snippets themselves


def test_every_marker_is_read_and_every_runnable_snippet_has_expectations():
    markers = len(re.findall(r"^<!-- snippet:", README.read_text(), re.MULTILINE))
    assert len(SNIPPETS) == markers, "a <!-- snippet: --> marker not directly before a fence"
    assert set(RUNNABLE) == set(EXPECTED), "give each runnable snippet its expected output here"
    runners = "\n".join(SNIPPETS[name].body for name in RUNNABLE)
    for snippet in SNIPPETS.values():
        if snippet.file:
            assert re.search(rf"\b{re.escape(snippet.file)}\b", runners), f"no snippet runs {snippet.file}"


def test_the_submit_body_example_is_a_valid_request():
    bodies = [s for s in SNIPPETS.values() if s.attrs.get("check") == "submit-request"]
    assert bodies
    for snippet in bodies:
        decode_request(SubmitRequest, snippet.body.encode())


# ---------------------------------------------------------------- irisfed up, from nothing


@dataclass
class Up:
    folder: Path
    env: dict[str, str]

    def run(self, script: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=self.folder, env=self.env,
                              capture_output=True, text=True, timeout=timeout, check=False)


def _wait_ready(up: Up, process: subprocess.Popen, log: Path) -> None:
    """Until `irisfed up` has printed its start lines and every service answers."""
    deadline = time.monotonic() + 300  # a bound on a hang, not an assertion about speed
    while "Ctrl-C stops everything" not in log.read_text(errors="replace"):
        assert process.poll() is None, log.read_text(errors="replace")
        assert time.monotonic() < deadline, log.read_text(errors="replace")
        time.sleep(0.2)
    probes = ["irisfed health router", "irisfed health tick"] + [
        f"irisfed health peer-agent --peer-id {peer}" for peer in ("home", "gpu-west", "tpu-east")]
    for probe in probes:
        while (result := up.run(probe, timeout=60)).returncode != 0:
            assert process.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, f"{probe}: {result.stdout}{result.stderr}"
            time.sleep(0.3)


def _stop(process: subprocess.Popen, state: Path) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
    try:  # anything it started and did not stop: by its PID
        pids = json.loads((state / "pids.json").read_text())
    except (OSError, ValueError):
        return
    for pid in pids["servers"] + list(pids["children"].values()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    relocated = state / "postgres" / "DATA_LOCATION"
    if relocated.exists():  # root with a 0700 temp dir: the cluster lived elsewhere
        shutil.rmtree(relocated.read_text().strip(), ignore_errors=True)


@pytest.fixture(scope="module")
def irisfed_up(tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IRISFED_", "NATS_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    state = folder / ".irisfed"
    log = folder / "up.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "irisfed.cli", "up", "--no-live"], cwd=folder,
                                   env={**env, "PYTHONPATH": str(ROOT)}, stdout=out, stderr=subprocess.STDOUT)
    up = Up(folder, env)
    try:
        _wait_ready(up, process, log)
        for snippet in SNIPPETS.values():
            if snippet.file:
                (folder / snippet.file).write_text(snippet.body + "\n")
        yield up
    finally:
        _stop(process, state)


def _have(program: str, up: Up) -> bool:
    return shutil.which(program, path=up.env["PATH"]) is not None


@pytest.mark.parametrize("name", RUNNABLE)
def test_readme_snippet_runs_as_written(name, irisfed_up):
    snippet = SNIPPETS[name]
    missing = [program for program in snippet.requires if not _have(program, irisfed_up)]
    if missing:
        reason = f"README snippet {name} needs {', '.join(missing)}, which is not installed here"
        if IN_CI and CI_HAS.intersection(missing):
            pytest.fail(reason + " (CI has it)")
        pytest.skip(reason)
    if "npm install nats" in snippet.body:
        # The registry may be out of reach from a developer's machine: say so rather than fail.
        prepared = irisfed_up.run("npm install nats")
        if prepared.returncode != 0:
            reason = f"`npm install nats` failed: {prepared.stderr.strip()[-500:]}"
            if IN_CI:
                pytest.fail(reason)
            pytest.skip(reason)
    result = irisfed_up.run(snippet.body)
    output = result.stdout + result.stderr
    print(output)  # shown with the test's report (pytest -rP, or on failure)
    assert result.returncode == 0, f"README snippet {name} failed:\n{output}"
    for pattern in EXPECTED[name]:
        assert re.search(pattern, result.stdout, re.MULTILINE), \
            f"README snippet {name}: no line matches {pattern!r} in:\n{output}"


def test_irisfed_up_keeps_the_producer_credentials_private(irisfed_up):
    state = irisfed_up.folder / ".irisfed"
    for name in ("producer.json", "connect.json"):
        assert (state / name).stat().st_mode & 0o777 == 0o600, name
    exports = irisfed_up.run('eval "$(irisfed env)"; printf "%s\\n%s" "$NATS_USER" "$NATS_PASSWORD"')
    user, password = exports.stdout.split("\n")
    assert user == "producer" and password
    assert password not in (irisfed_up.folder / "up.log").read_text()  # never on the screen
    assert "export NATS_URL=nats://127.0.0.1:" in irisfed_up.run("irisfed env").stdout


def test_irisfed_up_creates_the_object_store(irisfed_up):
    """The buckets workspaces and outputs will live in (docs/design.md §3.5) exist once
    `irisfed up` is ready, and hold what is put there."""
    import asyncio
    import json
    from urllib.parse import quote, urlsplit

    from irisfed.services.common.bus import connect_client
    from irisfed.services.common.objects import ObjectStore

    connect = json.loads((irisfed_up.folder / ".irisfed" / "connect.json").read_text())
    passwords = json.loads((irisfed_up.folder / ".irisfed" / "nats" / "nats-credentials.json").read_text())
    server = urlsplit(connect["nats_url"])
    admin_url = f"nats://admin:{quote(passwords['admin'], safe='')}@{server.hostname}:{server.port}"

    async def check() -> tuple[str, int, bytes]:
        nc = await connect_client(admin_url)
        try:
            store = await ObjectStore(nc).open()
            digest, size, _ = await store.put_workspace(b"print(1)\n")
            return digest, size, await store.get_workspace(digest)
        finally:
            await nc.close()

    digest, size, data = asyncio.run(check())
    assert digest.startswith("sha256:") and size == 9 and data == b"print(1)\n"
