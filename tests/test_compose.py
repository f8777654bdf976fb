"""deploy/docker-compose.yml, its overlays (compose.host.yml, compose.auth.yml) and deploy/Dockerfile agree
with the code they run.

No Docker engine is needed: the compose files are read as YAML, every service's command is run as
``epd <command> --help``, every ``EPD_*`` variable they set must be a field of that service's settings, and
NATS's command line, as the overlays give it, is run with the real nats-server and the users `epd
credentials` writes. tests/test_docker.py runs the stacks for real where an engine is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nats
import pytest
import yaml

from services.decode.settings import DecodeSettings
from services.encoder.settings import EncoderSettings
from launcher.credentials import StackCredentials
from launcher.natsserver import nats_server_binary
from services.frontend.settings import FrontendSettings
from services.language.settings import LanguageSettings
from services.prefill.settings import PrefillSettings
from shared.settings import parse_settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
HOST_FILE = DEPLOY / "compose.host.yml"
AUTH_FILE = DEPLOY / "compose.auth.yml"
DOCKERFILE = DEPLOY / "Dockerfile"

SETTINGS = {
    "encoder": EncoderSettings,
    "language": LanguageSettings,
    "prefill": PrefillSettings,
    "decode": DecodeSettings,
    "frontend": FrontendSettings,
}
SCALABLE = ("encoder", "language", "prefill", "decode")
INTERPOLATION = re.compile(r"\$\{(?P<name>\w+)(?::?-(?P<default>[^}]*))?\}")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


class _ComposeLoader(yaml.SafeLoader):
    """Compose's YAML: ``!reset`` (an override that empties a value) read as the empty value."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: [] if isinstance(node, yaml.SequenceNode) else None)


def overlay(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)


@pytest.fixture(scope="module")
def host_services() -> dict:
    return overlay(HOST_FILE)["services"]


@pytest.fixture(scope="module")
def auth() -> dict:
    return overlay(AUTH_FILE)


def interpolate(value: str) -> str:
    """The value compose would use with no variables set: ``${NAME:-default}`` → default."""
    return INTERPOLATION.sub(lambda m: m["default"] or "", str(value)).replace("$$", "$")


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the KEY=VALUE list form
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {key: interpolate(value) for key, value in env.items()}


def epd_command(service: dict) -> list[str]:
    command = service["command"]
    return command.split() if isinstance(command, str) else [str(part) for part in command]


def epd_executable() -> str:
    beside_python = Path(sys.executable).parent / "epd"
    found = str(beside_python) if beside_python.exists() else shutil.which("epd")
    assert found, "the `epd` console script is not installed (pip install -e .)"
    return found


def test_stack_services_present(services):
    assert {"nats", *SETTINGS} <= set(services)


def test_the_default_layout_is_epd_ups_and_split_is_a_profile(services):
    """E/PD by default, as `epd up --pd joined`; prefill and decode (E/P/D) behind the `split` profile."""
    for name in ("nats", "encoder", "language", "frontend"):
        assert "profiles" not in services[name], f"{name} must start by default"
    for name in ("prefill", "decode"):
        assert services[name]["profiles"] == ["split"]
    assert environment(services["language"]) == environment(services["decode"]) == environment(services["encoder"])


def test_nats_runs_from_the_epd_image_with_jetstream_on_a_volume_it_owns(compose, services):
    nats_service = services["nats"]
    assert nats_service["image"] == services["frontend"]["image"]  # one image: nothing else to pull
    assert nats_service["entrypoint"] == ["epd-nats"] and "user" not in nats_service  # the image's user, epd
    command = epd_command(nats_service)
    assert "-js" in command
    store = command[command.index("-sd") + 1]
    volumes = {mount.split(":")[1]: mount.split(":")[0] for mount in nats_service["volumes"]}
    assert volumes.get(store) in (compose.get("volumes") or {}), "the JetStream store is not on a named volume"
    # A new volume takes its mount point's owner from the image: the image must give the store to epd.
    assert re.search(rf"^RUN .*install -d -o epd -g epd\b.* {re.escape(store)}$", DOCKERFILE.read_text(), re.M)
    assert not nats_service.get("ports"), "NATS is published nowhere: only the compose network reaches it"


def test_one_service_builds_the_image_the_others_run(services):
    builders = [name for name, service in services.items() if "build" in service]
    assert builders == ["frontend"]  # always started, whatever the profiles
    build = services["frontend"]["build"]
    context = (COMPOSE_FILE.parent / build["context"]).resolve()
    assert context == ROOT and (context / build["dockerfile"]).resolve() == DOCKERFILE
    arguments = set(re.findall(r"^ARG (\w+)", DOCKERFILE.read_text(), re.M))
    assert set(build["args"]) <= arguments
    assert {"BASE", "TORCH", "TORCH_BACKEND", "TORCH_FIND_LINKS"} <= set(build["args"])
    for name, service in services.items():
        assert service["image"] == services["frontend"]["image"], name
        if name != "frontend":
            assert service["pull_policy"] == "never", f"{name} would try to pull an image only built here"


@pytest.mark.parametrize("name", SETTINGS)
def test_service_reaches_nats_and_serves_data_to_other_containers(services, name):
    env = environment(services[name])
    assert env["EPD_NATS_URL"] == "nats://nats:4222"
    assert env["EPD_DATA_HOST"] == "0.0.0.0"
    assert env["EPD_DATA_ADVERTISE"] == "auto"  # each replica advertises its own IP


@pytest.mark.parametrize("name", SCALABLE)
def test_workers_scale_with_no_other_change(services, name):
    service = services[name]
    assert "container_name" not in service, "a fixed name forbids --scale"
    assert not service.get("ports"), "a host port forbids --scale"
    assert "replicas" not in (service.get("deploy") or {}), "a fixed replica count overrides --scale"


def test_frontend_serves_port_8000_on_all_interfaces(services):
    frontend = services["frontend"]
    settings = parse_settings(FrontendSettings, epd_command(frontend)[1:], "epd frontend")
    assert settings.host == "0.0.0.0"
    published = [interpolate(port).rsplit(":", 1) for port in frontend["ports"]]
    assert ["8000", str(settings.port)] in published


@pytest.mark.parametrize("name", SETTINGS)
def test_environment_names_settings_fields(services, name):
    fields = SETTINGS[name].model_fields
    for key in environment(services[name]):
        assert key.startswith("EPD_"), f"{name}: {key} is not an EPD_* setting"
        assert key[len("EPD_"):].lower() in fields, f"{name}: {key} is no field of {SETTINGS[name].__name__}"


@pytest.mark.parametrize("name", SETTINGS)
def test_command_and_environment_parse_into_settings(services, name, monkeypatch):
    """What the container would start with: its environment plus its flags, validated by the service."""
    for key in [key for key in os.environ if key.startswith("EPD_")]:
        monkeypatch.delenv(key)
    for key, value in environment(services[name]).items():
        monkeypatch.setenv(key, value)
    command = epd_command(services[name])
    assert command[0] == name
    settings = parse_settings(SETTINGS[name], command[1:], f"epd {name}")
    assert settings.nats_url == "nats://nats:4222"


# Runs the installed `epd` script once per command inside one interpreter: each start imports torch
# (~4 s of CPU), so separate processes would cost that many times over on a 2-core CI machine.
HELP_DRIVER = """
import runpy, sys
script, commands = sys.argv[1], sys.argv[2:]
for command in commands:
    sys.argv = ["epd", command, "--help"]
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    print(f"@@exit {command} {code}", flush=True)
"""


def test_every_command_is_an_epd_command(services):
    """``epd <command> --help`` exits 0 for each service's command."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("EPD_")}
    commands = [epd_command(services[name])[0] for name in SETTINGS]
    run = subprocess.run([sys.executable, "-c", HELP_DRIVER, epd_executable(), *commands], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    codes = dict(line.split()[1:] for line in run.stdout.splitlines() if line.startswith("@@exit "))
    assert codes == {command: "0" for command in commands}, run.stdout + run.stderr
    for command in commands:
        assert f"usage: epd {command}" in run.stdout


def test_dockerfile_installs_cpu_torch_and_runs_epd_unprivileged():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG BASE=python:3\.11-slim$", text, re.M) and re.search(r"^FROM \$\{BASE\}$", text, re.M)
    assert re.search(r'^ARG TORCH="?torch==\d', text, re.M)
    assert re.search(r"^ARG TORCH_BACKEND=cpu$", text, re.M)
    assert re.search(r"^USER (?!root\b)\w+", text, re.M)
    assert re.search(r'^ENTRYPOINT \["epd"\]', text, re.M)
    for source in re.findall(r"^COPY (?!--)(.+) \S+$", text, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), f"the Dockerfile copies {path}, which does not exist"


def test_the_build_context_holds_what_the_dockerfile_copies():
    """BuildKit sends only what deploy/Dockerfile.dockerignore lets through: every COPY source must pass."""
    kept = [line[1:].rstrip("/") for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
            if line.startswith("!")]
    for source in re.findall(r"^COPY (?!--)(.+) \S+$", DOCKERFILE.read_text(), re.M):
        for path in source.split():
            assert path in kept, f"the Dockerfile copies {path}, which Dockerfile.dockerignore leaves out"


def test_nats_entry_point_is_in_the_image_and_executable():
    script = DEPLOY / "nats-entrypoint.sh"
    assert os.access(script, os.X_OK)
    assert re.search(r"^COPY deploy/nats-entrypoint\.sh /usr/local/bin/epd-nats$", DOCKERFILE.read_text(), re.M)
    assert subprocess.run(["sh", "-n", str(script)]).returncode == 0


@pytest.mark.parametrize("name", [*SCALABLE, "frontend"])
def test_every_epd_service_has_a_healthcheck_on_its_health_endpoint(services, name):
    env = environment(services[name])
    check = " ".join(services[name]["healthcheck"]["test"])
    assert f"http://127.0.0.1:{env['EPD_HEALTH_PORT']}/ready" in check


def test_host_overlay_keeps_every_socket_on_loopback(services, host_services):
    """deploy/compose.host.yml: each service on the host network, listening and advertising 127.0.0.1."""
    assert set(host_services) == set(services)
    for name, service in host_services.items():
        assert service["network_mode"] == "host", name
        if name == "nats":
            command = epd_command(service)
            assert command[command.index("-a") + 1] == "127.0.0.1"
            assert command[command.index("-sd") + 1] == epd_command(services["nats"])[
                epd_command(services["nats"]).index("-sd") + 1]  # the same store, on the same volume
            continue
        env = environment(service)
        assert env["EPD_NATS_URL"] == "nats://127.0.0.1:4222"
        assert env["EPD_DATA_HOST"] == env["EPD_DATA_ADVERTISE"] == "127.0.0.1"
        if name != "frontend":  # replicas share the host's ports: a fixed health port would collide
            assert env["EPD_HEALTH_PORT"] == "0" and service["healthcheck"] == {"disable": True}
    frontend = host_services["frontend"]
    assert frontend["ports"] == []
    assert frontend["build"] == {"network": "host"}  # an engine with no bridge builds on the host's network
    settings = parse_settings(FrontendSettings, [interpolate(a) for a in epd_command(frontend)[1:]], "epd frontend")
    assert settings.host == "127.0.0.1" and settings.port == 8000


@pytest.mark.parametrize("name", SETTINGS)
def test_host_overlay_environment_names_settings_fields(host_services, name):
    for key in environment(host_services[name]):
        assert key[len("EPD_"):].lower() in SETTINGS[name].model_fields, f"{name}: {key}"


def test_auth_overlay_gives_each_service_its_own_roles_credentials(services, auth, tmp_path):
    """Each epd service reads the env file `epd credentials` writes for its own role."""
    written = {path.name for path in StackCredentials.generate("epd").write(tmp_path)}
    overlay_services = auth["services"]
    assert set(overlay_services) == set(services)
    for name in SETTINGS:
        (env_file,) = overlay_services[name]["env_file"]
        assert interpolate(env_file) == f"./secrets/{name}.env" and f"{name}.env" in written
    assert interpolate(auth["secrets"]["nats-auth"]["file"]) == "./secrets/nats-auth.conf"


def test_auth_overlay_mounts_the_users_where_epd_nats_reads_them(auth):
    nats_service = auth["services"]["nats"]
    (secret,) = nats_service["secrets"]
    assert secret == {"source": "nats-auth", "target": "nats-auth.conf"}  # /run/secrets/nats-auth.conf
    script = (DEPLOY / "nats-entrypoint.sh").read_text()
    assert "secret=/run/secrets/nats-auth.conf" in script and "private=/run/nats " in script
    assert nats_service["tmpfs"] == ["/run/nats"]  # the copy only epd may read stays in memory
    # Root for the copy alone, with only the capabilities it needs; epd-nats drops to epd before NATS runs.
    assert nats_service["user"] == "root" and nats_service["cap_drop"] == ["ALL"]
    assert set(nats_service["cap_add"]) <= {"CHOWN", "DAC_OVERRIDE", "FOWNER", "SETUID", "SETGID"}
    assert "exec setpriv --reuid=epd --regid=epd" in script


def test_overlays_touch_different_keys_so_either_order_merges_the_same(host_services, auth):
    for name, service in auth["services"].items():
        shared = set(service) & set(host_services.get(name, {}))
        assert not shared, f"{name}: both overlays set {shared}; the later file would win"


def test_nats_as_the_overlays_start_it_listens_on_loopback_and_refuses_anonymous_clients(tmp_path,
                                                                                         host_services):
    """The host overlay's nats-server command, plus the users file epd-nats passes with -c, run for real:
    loopback only (clients and monitor), a client without credentials refused, a role's user let in."""
    secrets = tmp_path / "secrets"
    credentials = StackCredentials.generate("epd")
    credentials.write(secrets)
    assert {oct(path.stat().st_mode & 0o777) for path in secrets.iterdir()} == {"0o600"}
    random = {"NATS_PORT": "-1", "NATS_MONITOR_PORT": "-1"}  # nats-server picks free ports, written below
    command = [INTERPOLATION.sub(lambda m: random.get(m["name"], m["default"] or ""), part)
               for part in epd_command(host_services["nats"])]
    command[command.index("-sd") + 1] = str(tmp_path / "store")
    server = subprocess.Popen([nats_server_binary(), "-c", str(secrets / "nats-auth.conf"), *command,
                               "--ports_file_dir", str(tmp_path)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        ports = asyncio.run(_listening(tmp_path / f"nats-server_{server.pid}.ports"))
        assert [url.split("//")[1].rsplit(":", 1)[0] for url in ports["nats"] + ports["monitoring"]] == [
            "127.0.0.1", "127.0.0.1"]
        asyncio.run(_check_nats(ports["nats"][0], credentials))
    finally:
        server.terminate()
        server.wait(timeout=10)


async def _listening(ports_file: Path) -> dict:
    for _ in range(200):
        if ports_file.exists():
            with contextlib.suppress(ValueError):
                return json.loads(ports_file.read_text())
        await asyncio.sleep(0.05)
    raise AssertionError("nats-server did not start listening")


async def _check_nats(url: str, credentials: StackCredentials) -> None:
    nc = await nats.connect(url, user="encoder", password=credentials.passwords["encoder"],
                            allow_reconnect=False, connect_timeout=2)
    await nc.close()
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
