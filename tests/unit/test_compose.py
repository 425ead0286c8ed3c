"""compose.yaml cannot be run here (no Docker engine), so check it is consistent."""

from pathlib import Path

import pytest
import yaml

from irisfed.cli import build_parser
from irisfed.shared.config import load_config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
NATS_NODES = ("nats-1", "nats-2", "nats-3")


def parses(command: list[str]) -> bool:
    assert command[0] == "irisfed", command
    try:
        build_parser().parse_args(command[1:])
    except SystemExit:
        return False
    return True


def test_topology_has_every_role():
    assert {"nats-1", "nats-2", "nats-3", "postgres", "migrate", "router", "tick", "web"} <= set(SERVICES)
    agents = [name for name, svc in SERVICES.items() if "peer-agent" in svc.get("command", [])]
    assert len(agents) == 2
    attrs = [tuple(svc["command"][i + 1] for i, a in enumerate(svc["command"]) if a == "--attr")
             for name, svc in SERVICES.items() if name in agents]
    assert attrs[0] != attrs[1]  # the two peers advertise different hardware


@pytest.mark.parametrize("name", [n for n, s in SERVICES.items() if s.get("image") == "irisfed:latest"])
def test_every_irisfed_command_is_a_real_subcommand(name):
    service = SERVICES[name]
    assert parses(service["command"]), service["command"]
    health = service.get("healthcheck", {}).get("test")
    if health:
        assert health[0] == "CMD" and parses(health[1:]), health


def test_one_image_built_from_the_repo_dockerfile():
    ours = [s for s in SERVICES.values() if s.get("image", "").startswith("irisfed")]
    assert {s["image"] for s in ours} == {"irisfed:latest"}
    builders = [s for s in ours if "build" in s]
    assert len(builders) == 1 and (ROOT / builders[0]["build"] / "Dockerfile").exists()


def test_dependencies_and_health_checks_are_consistent():
    for name, service in SERVICES.items():
        assert "restart" in service, f"{name} has no restart policy"
        if service["restart"] != "no":  # one-shot jobs (migrate, roles) have nothing to probe
            assert "healthcheck" in service, f"{name} has no health check"
        for dependency, rule in service.get("depends_on", {}).items():
            assert dependency in SERVICES, f"{name} depends on unknown {dependency}"
            condition = rule["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in SERVICES[dependency]
            if condition == "service_completed_successfully":
                assert SERVICES[dependency]["restart"] == "no"
    for name in ("router", "tick", "web"):
        assert SERVICES[name]["depends_on"]["roles"]["condition"] == "service_completed_successfully"
    assert SERVICES["roles"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_mounted_federation_config_is_valid_and_names_the_agents():
    config = load_config(ROOT / "deploy" / "federation.toml")
    for service in SERVICES.values():
        command = service.get("command", [])
        if "peer-agent" in command:
            assert command[command.index("--peer-id") + 1] in config.peer_ids


def test_the_dashboard_reads_its_operator_token_from_a_secret_file():
    web = SERVICES["web"]
    flag = web["command"].index("--operator-token-file")
    secret = web["command"][flag + 1].removeprefix("/run/secrets/")
    assert secret in web["secrets"] and secret in COMPOSE["secrets"]
    assert "IRISFED_WEB_OPERATOR_TOKEN" not in web.get("environment", {})
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "deploy/secrets/" in ignored  # a token made for compose is never committed


def _secret_file(service: dict, env: str) -> str:
    """The file (under deploy/secrets) that ``env`` (…_FILE) names in ``service``."""
    mounted = service["environment"][env]
    name = mounted.removeprefix("/run/secrets/")
    assert name in service["secrets"], (env, service["secrets"])
    return COMPOSE["secrets"][name]["file"].removeprefix("./deploy/secrets/")


def test_every_service_connects_as_its_own_role_and_user_from_secret_files(tmp_path):
    from irisfed.cli.compose_secrets import service_roles, write_secrets

    config = load_config(ROOT / "deploy" / "federation.toml")
    write_secrets(config, tmp_path)
    roles = service_roles(config)
    connecting = {name: svc for name, svc in SERVICES.items()
                  if svc.get("image") == "irisfed:latest" and name not in ("migrate", "roles", "buckets")}
    assert set(connecting) == set(roles)  # one service per role: router, tick, web, an agent per peer
    seen_users = set()
    for name, service in connecting.items():
        role, user = roles[name]
        env = service["environment"]
        assert "IRISFED_DATABASE_URL" not in env and "IRISFED_NATS_URL" not in env  # no URL in the clear
        db_url = (tmp_path / _secret_file(service, "IRISFED_DATABASE_URL_FILE")).read_text()
        nats_url = (tmp_path / _secret_file(service, "IRISFED_NATS_URL_FILE")).read_text()
        assert db_url.startswith(f"postgresql://{role}:"), (name, db_url.split(":")[1])
        assert nats_url.startswith(f"nats://{user}:"), name
        seen_users.add(user)
    assert len(seen_users) == len(connecting)
    for name in ("migrate", "roles"):  # only these two hold the owner's URL
        assert _secret_file(SERVICES[name], "IRISFED_DATABASE_URL_FILE") == "admin.database-url"
    assert not any("admin_database_url" in svc.get("secrets", []) for svc in connecting.values())
    # Only the one-shot `buckets` holds NATS's admin (it creates the object store's streams).
    assert _secret_file(SERVICES["buckets"], "IRISFED_NATS_URL_FILE") == "admin.nats-url"
    assert not any("admin_nats_url" in svc.get("secrets", []) for svc in connecting.values())
    assert all("-js" in SERVICES[f"nats-{n}"]["command"] for n in (1, 2, 3))  # JetStream on every node
    for secret in COMPOSE["secrets"].values():
        assert (tmp_path / secret["file"].removeprefix("./deploy/secrets/")).exists(), secret


def test_no_password_is_written_in_compose():
    text = (ROOT / "compose.yaml").read_text()
    assert "irisfed:irisfed" not in text and "POSTGRES_PASSWORD:" not in text
    assert SERVICES["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/postgres_password"
    for node in NATS_NODES:
        assert "/run/secrets/nats_conf" in SERVICES[node]["command"]
    assert SERVICES["roles"]["command"][:3] == ["irisfed", "db-roles", "--passwords"]


def test_secret_files_are_private_and_kept_when_run_again(tmp_path):
    from irisfed.cli.compose_secrets import write_secrets

    config = load_config(ROOT / "deploy" / "federation.toml")
    first = {p.name: p.read_text() for p in write_secrets(config, tmp_path)}
    again = {p.name: p.read_text() for p in write_secrets(config, tmp_path)}
    assert first == again
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in tmp_path.iterdir())


def test_each_configured_user_gets_its_own_nats_credentials(tmp_path):
    from irisfed.cli.compose_secrets import write_secrets
    from irisfed.shared.config import parse_config

    config = parse_config({"peers": [{"id": "home"}], "local_cluster": "home",
                           "users": [{"id": "alice"}, {"id": "bob", "quota": {"gpu": 2}}]})
    write_secrets(config, tmp_path)
    for user in ("alice", "bob"):
        url = (tmp_path / f"user-{user}.nats-url").read_text()
        assert url.startswith(f"nats://user-{user}:")
        assert oct((tmp_path / f"user-{user}.nats-url").stat().st_mode & 0o777) == "0o600"
    conf = (tmp_path / "nats.conf").read_text()
    assert '"irisfed.submit.alice", "irisfed.cancel.alice"' in conf
    assert '"_INBOX_user-bob.>"' in conf


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_nats_is_a_cluster_of_three_every_service_waits_for():
    routes = set()
    for node in NATS_NODES:
        command = SERVICES[node]["command"]
        assert _flag(command, "--cluster_name") == "irisfed"
        assert _flag(command, "--name") == node  # a name per node: its logs and /routez tell them apart
        routes.add(_flag(command, "--routes"))
        assert "healthcheck" in SERVICES[node]
    # The same routes on every node, naming every node (a node ignores its route to itself).
    assert routes == {",".join(f"nats://{node}:6222" for node in NATS_NODES)}
    for name, service in SERVICES.items():
        if {"router", "tick", "peer-agent"} & set(service.get("command", [])):
            assert all(service["depends_on"][node]["condition"] == "service_healthy" for node in NATS_NODES), name


def test_secret_urls_name_every_nats_node_and_keep_a_multi_host_database(tmp_path):
    from irisfed.cli.compose_secrets import write_secrets

    config = load_config(ROOT / "deploy" / "federation.toml")
    ha = "postgresql://pg-1:5432,pg-2:5432/irisfed?target_session_attrs=read-write"
    write_secrets(config, tmp_path, database=ha)
    router_nats = (tmp_path / "router.nats-url").read_text().strip().split(",")
    assert [url.rsplit("@", 1)[1] for url in router_nats] == [f"{node}:4222" for node in NATS_NODES]
    router_db = (tmp_path / "router.database-url").read_text().strip()
    assert router_db.startswith("postgresql://irisfed_svc_router:")
    assert router_db.endswith("@pg-1:5432,pg-2:5432/irisfed?target_session_attrs=read-write")


def test_compose_secrets_refuses_credentials_in_the_server_urls_and_writes_nothing(tmp_path):
    from irisfed.cli.compose_secrets import write_secrets
    from irisfed.shared.errors import ConfigError

    config = load_config(ROOT / "deploy" / "federation.toml")
    with pytest.raises(ConfigError, match="leave out the user and password"):
        write_secrets(config, tmp_path / "out", database="postgresql://u:secret@pg-1:5432/irisfed")
    with pytest.raises(ConfigError, match="--nats-url"):
        write_secrets(config, tmp_path / "out", nats="nats://u:secret@n1:4222")
    assert not (tmp_path / "out").exists()
