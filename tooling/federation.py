"""One harness for local federations: their TOML from data, and a supervisor.

``irisfed up``, the chaos suite, the benchmarks and the end-to-end tests all run
a federation on this machine the same way:

- :func:`render_config` / :func:`write_config` turn a federation described as
  data (:class:`Peer` entries and top-level settings) into its TOML file, checked
  by the same parser the services use, so no caller builds TOML from strings;
- :class:`Supervisor` starts processes by name and stops them by their own PID
  (SIGTERM, then SIGKILL), restarts one the same way it was started, and closes
  the proxies and servers it was handed;
- :class:`LocalFederation` starts router, tick and peer agents as
  ``python -m irisfed.services.<name>`` under a supervisor, each with the NATS user of
  its role and its own Postgres URL.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from irisfed.services.common.db_roles import peer_role
from irisfed.services.common.nats_auth import NatsAuth
from irisfed.shared.config import DATABASE_URL_ENV, NATS_URL_ENV, FederationConfig, parse_config
from irisfed.shared.postgres import with_login
from irisfed.tooling.proxy import TcpProxy, proxy_for
from irisfed.tooling.servers import ServerProcess

STOP_TIMEOUT_S = 15.0  # SIGTERM, then SIGKILL after this long
DUMP_WAIT_S = 1.0  # after asking an overrunning child for its stacks, before SIGKILL

# ---------------------------------------------------------------- the TOML file


@dataclass(frozen=True)
class Peer:
    """One ``[[peers]]`` entry; ``None`` leaves a key out (the parser's default)."""

    id: str
    attributes: Mapping[str, str | Sequence[str]] = field(default_factory=dict)
    slots: int | None = None
    backend: str | None = None
    resources: Mapping[str, int | float] = field(default_factory=dict)
    slurm_partition: str | None = None
    ray_address: str | None = None
    # Subprocess/simulated: its nodes, ``[{count, resources, attributes}]`` (shared.nodes).
    nodes: Sequence[Mapping[str, Any]] = ()
    gang_start_timeout_s: float | None = None


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else "nan" if math.isnan(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, Sequence):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_value(key)


def render_config(peers: Iterable[Peer], comment: str = "", users: Iterable[Mapping[str, Any]] = (),
                  **settings: Any) -> str:
    """The federation's TOML: ``settings`` (``local_cluster``, ``heartbeat_ttl_s`` ...) then
    one ``[[peers]]`` table per peer and one ``[[users]]`` table per user (its keys as
    given: ``id``, ``weight``, ``quota`` ...); ``comment`` lines go on top. Raises
    ConfigError when the parser the services use would refuse the result."""
    lines = [f"# {line}".rstrip() for line in comment.splitlines()]
    lines += [f"{key} = {_toml_value(value)}" for key, value in settings.items() if value is not None]
    for peer in peers:
        lines += ["", "[[peers]]", f"id = {_toml_value(peer.id)}"]
        if peer.attributes:
            lines.append(f"attributes = {_toml_value(peer.attributes)}")
        if peer.slots is not None:
            lines.append(f"slots = {peer.slots}")
        if peer.backend is not None:
            lines.append(f"backend = {_toml_value(peer.backend)}")
        if peer.resources:
            lines.append(f"resources = {_toml_value(peer.resources)}")
        for key in ("slurm_partition", "ray_address", "gang_start_timeout_s"):
            if getattr(peer, key) is not None:
                lines.append(f"{key} = {_toml_value(getattr(peer, key))}")
        if peer.nodes:
            lines.append(f"nodes = {_toml_value(list(peer.nodes))}")
    for user in users:
        lines += ["", "[[users]]", *(f"{key} = {_toml_value(value)}" for key, value in user.items())]
    text = "\n".join(lines) + "\n"
    parse_config(tomllib.loads(text))  # what the services will say about it, said now
    return text


def write_config(path: Path, peers: Iterable[Peer], comment: str = "", users: Iterable[Mapping[str, Any]] = (),
                 **settings: Any) -> FederationConfig:
    """Render (see :func:`render_config`) to ``path``; return it as the services will read it."""
    text = render_config(peers, comment, users, **settings)
    path.write_text(text)
    return parse_config(tomllib.loads(text))


def login_role_urls(database_url: str, peer_ids: Iterable[str], passwords: Mapping[str, str]) -> dict[str, str]:
    """Service name (router, tick, web, a peer id) → ``database_url`` as its own login role
    (``irisfed db-roles``: ``passwords`` maps each login role to its password)."""
    roles = {"router": "irisfed_svc_router", "tick": "irisfed_svc_tick", "web": "irisfed_svc_web",
             **{peer: peer_role(peer) for peer in peer_ids}}
    return {name: with_login(database_url, role, passwords[role]) for name, role in roles.items()}


# ---------------------------------------------------------------- processes


@dataclass
class Launch:
    """How a child was started, so it can be started again the same way."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path
    cwd: Path | None = None
    started_at: float = 0.0  # time.monotonic() of the latest start
    restarts: int = 0


class StopOverrun(UserWarning):
    """A child did not exit within its stop timeout of SIGTERM and was SIGKILLed."""


@dataclass(frozen=True)
class Overrun:
    """A child the supervisor had to SIGKILL after SIGTERM (its stacks are in its log)."""

    name: str
    pid: int
    argv: list[str]
    log_path: Path


class Supervisor:
    """Child processes by name, stopped by their own PID; the proxies and servers handed to it.

    ``processes`` holds the children started and not yet stopped or killed (one
    that exited by itself stays until :meth:`restart`, :meth:`stop` or a caller
    takes it out). Children run in sessions of their own, so a Ctrl-C reaches the
    caller only; each appends its output to its log file.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: dict[str, subprocess.Popen] = {}
        self.launches: dict[str, Launch] = {}
        self.proxies: list[TcpProxy] = []
        self.servers: list[ServerProcess] = []
        self.overruns: list[Overrun] = []  # children SIGKILLed by stop/stop_all: a shutdown bug

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str], *, cwd: Path | None = None,
              log_path: Path | None = None) -> subprocess.Popen:
        launch = Launch(list(argv), dict(env), log_path or self.log_dir / f"{name}.log", cwd)
        self.launches[name] = launch
        return self._launch(name, launch)

    def restart(self, name: str) -> subprocess.Popen:
        """Start ``name`` again with its last command line and environment."""
        launch = self.launches[name]
        launch.restarts += 1
        return self._launch(name, launch)

    def _launch(self, name: str, launch: Launch) -> subprocess.Popen:
        launch.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(launch.log_path, "ab") as log:
            process = subprocess.Popen(launch.argv, env=launch.env, cwd=launch.cwd, stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        launch.started_at = time.monotonic()
        self.processes[name] = process
        return process

    def running(self, name: str) -> bool:
        process = self.processes.get(name)
        return process is not None and process.poll() is None

    def exited(self) -> list[str]:
        """Children that ended by themselves (never by :meth:`stop` or :meth:`kill`)."""
        return [name for name, process in self.processes.items() if process.poll() is not None]

    def stop(self, name: str, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, and SIGKILL if it is not gone within ``timeout``; its exit code."""
        process = self.processes.pop(name)
        self._terminate({name: process}, timeout)
        return process.returncode

    def kill(self, name: str) -> None:
        """Crash it (SIGKILL to its own PID): no clean-up of any kind."""
        process = self.processes.pop(name, None)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def stop_all(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Every child at once: SIGTERM to all, then wait for each (SIGKILL after ``timeout``)."""
        self._terminate(dict(self.processes), timeout)
        self.processes.clear()

    def proxy(self, url: str) -> TcpProxy:
        """A proxy in front of the server ``url`` names, closed with the supervisor."""
        made = proxy_for(url)
        self.proxies.append(made)
        return made

    def add_server(self, server: ServerProcess) -> ServerProcess:
        """A server to stop (by its PID) after every child, in reverse order of adding."""
        self.servers.append(server)
        return server

    def pids(self) -> dict[str, Any]:
        return {"servers": [s.pid for s in self.servers],
                "children": {name: p.pid for name, p in self.processes.items()}}

    def close(self) -> None:
        """Children first (with every proxy let through, so they can say goodbye), then
        the proxies, then the servers."""
        for proxy in self.proxies:
            proxy.restore()
        self.stop_all()
        for proxy in self.proxies:
            proxy.close()
        self.proxies.clear()
        for server in reversed(self.servers):
            server.stop()
        self.servers.clear()

    def _terminate(self, processes: Mapping[str, subprocess.Popen], timeout: float) -> None:
        """:func:`_terminate`, and each child it had to SIGKILL recorded in :attr:`overruns`,
        noted at the end of its log (after the stacks it wrote there) and warned about."""
        names = {id(process): name for name, process in processes.items()}
        for process in _terminate(list(processes.values()), timeout):
            name = names[id(process)]
            launch = self.launches.get(name)
            log_path = launch.log_path if launch else self.log_dir / f"{name}.log"
            overrun = Overrun(name, process.pid, [str(a) for a in process.args], log_path)
            self.overruns.append(overrun)
            with contextlib.suppress(OSError), open(log_path, "a") as log:
                log.write(f"harness: SIGKILLed {name}: no exit within {timeout:g} s of SIGTERM\n")
            warnings.warn(f"{name} (pid {process.pid}) did not exit within {timeout:g} s of SIGTERM and was "
                          f"killed; its stacks are in {log_path}; argv {overrun.argv}", StopOverrun, stacklevel=3)


def _terminate(processes: list[subprocess.Popen], timeout: float) -> list[subprocess.Popen]:
    """SIGTERM to all, then wait for each (the timeout counts from the SIGTERM); those
    still running then get SIGUSR1 and SIGUSR2 (stack dumps), then SIGKILL. Returns them."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    overran = []
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            overran.append(process)
    for process in overran:
        # Threads first (faulthandler, answered even by a blocked loop or a finished one);
        # then the tasks, which a finished loop no longer answers (SIGUSR2 then ends it).
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=DUMP_WAIT_S / 2)
        if process.poll() is None:
            process.kill()
        process.wait()
    return overran


# ---------------------------------------------------------------- services

# Any other name: a peer's agent.
SERVICE_MODULES = {"router": "irisfed.services.router", "tick": "irisfed.services.tick", "web": "irisfed.services.web"}


def nats_role(name: str) -> str:
    """The NATS user service ``name`` (router, tick or a peer id) connects as."""
    return name if name in SERVICE_MODULES else f"agent-{name}"


def harness_env(**extra: str) -> dict[str, str]:
    """This process's environment without any IRISFED_ setting, plus ``extra``.

    Children run ``python -m irisfed...`` with this interpreter, so they import the
    same installed irisfed as this process; nothing is added to ``PYTHONPATH`` (a
    folder there would put other top-level names ahead of site-packages)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IRISFED_")}
    return {**env, **extra}


class LocalFederation:
    """Router, tick and peer agents as local processes, started by name under a supervisor.

    ``start("router")``, ``start("tick")``, ``start(peer_id)``: ``python -m
    irisfed.services.<...> --config CONFIG`` with ``args`` and the call's own flags, the
    NATS URL of its role (its own user when ``auth`` is given) and its Postgres
    URL (``db_urls[name]`` when set, e.g. its own login role, else
    ``database_url``). ``child_name`` maps a service to its supervisor name and
    log file (``irisfed up`` calls its agents ``agent-<peer>``).
    """

    def __init__(self, supervisor: Supervisor, config_path: Path, database_url: str, nats_url: str, *,
                 env: Mapping[str, str], work_dir: Path, auth: NatsAuth | None = None, args: Sequence[str] = (),
                 cwd: Path | None = None, child_name: Callable[[str], str] = str, log_prefix: str = "") -> None:
        self.supervisor = supervisor
        self.config_path = config_path
        self.database_url = database_url
        self.nats_url = nats_url  # without credentials
        self.auth = auth
        self.db_urls: dict[str, str] = {}
        self.base_env = dict(env)
        self.work_dir = work_dir
        self.args = list(args)
        self.cwd = cwd
        self.child_name = child_name
        self.log_prefix = log_prefix

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        return self.supervisor.processes

    def nats_url_for(self, role: str) -> str:
        return self.auth.url(self.nats_url, role) if self.auth else self.nats_url

    def database_url_for(self, name: str) -> str:
        """The Postgres URL service ``name`` connects with."""
        return self.db_urls.get(name, self.database_url)

    def argv(self, name: str, *extra: str) -> list[str]:
        args = [sys.executable, "-m", SERVICE_MODULES.get(name, "irisfed.services.peer_agent"),
                "--config", str(self.config_path), *self.args, *extra]
        if name not in SERVICE_MODULES:
            args += ["--peer-id", name, "--work-dir", str(self.work_dir)]
        return args

    def start(self, name: str, *extra: str, env: Mapping[str, str] | None = None) -> subprocess.Popen:
        """Start service ``name`` (router, tick or a peer id); ``env`` overrides (e.g. a proxy's URL)."""
        env = {**self.base_env, NATS_URL_ENV: self.nats_url_for(nats_role(name)),
               DATABASE_URL_ENV: self.database_url_for(name), **(env or {})}
        child = self.child_name(name)
        return self.supervisor.start(child, self.argv(name, *extra), env, cwd=self.cwd,
                                     log_path=self.supervisor.log_dir / f"{self.log_prefix}{child}.log")
