"""deploy/docker-compose.yml, deploy/compose.host.yml and deploy/Dockerfile agree with the code they run.

No Docker engine is needed: the compose files are read as YAML, every service's command is run as
``epd <command> --help``, and every ``EPD_*`` variable they set must be a field of that service's settings.
tests/test_docker.py runs the stack for real where an engine is.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.decode.settings import DecodeSettings
from services.encoder.settings import EncoderSettings
from services.frontend.settings import FrontendSettings
from services.prefill.settings import PrefillSettings
from shared.settings import parse_settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
HOST_FILE = DEPLOY / "compose.host.yml"
DOCKERFILE = DEPLOY / "Dockerfile"

SETTINGS = {
    "encoder": EncoderSettings,
    "prefill": PrefillSettings,
    "decode": DecodeSettings,
    "frontend": FrontendSettings,
}
SCALABLE = ("encoder", "prefill", "decode")
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


@pytest.fixture(scope="module")
def host_services() -> dict:
    return yaml.load(HOST_FILE.read_text(), Loader=_ComposeLoader)["services"]


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


def test_nats_runs_jetstream_on_a_volume(compose, services):
    nats = services["nats"]
    assert nats["image"].split(":")[0] in ("nats", "docker.io/nats", "docker.io/library/nats")
    command = epd_command(nats)
    assert "-js" in command
    store = command[command.index("-sd") + 1]
    volumes = {mount.split(":")[1]: mount.split(":")[0] for mount in nats["volumes"]}
    assert volumes.get(store) in (compose.get("volumes") or {}), "the JetStream store is not on a named volume"


@pytest.mark.parametrize("name", SETTINGS)
def test_service_built_from_our_dockerfile(services, name):
    build = services[name]["build"]
    context = (COMPOSE_FILE.parent / build["context"]).resolve()
    assert context == ROOT
    assert (context / build["dockerfile"]).resolve() == DOCKERFILE


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
    published = [str(port).rsplit(":", 1) for port in frontend["ports"]]
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
# (~4 s of CPU), so four separate processes would cost four times that on a 2-core CI machine.
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


@pytest.mark.parametrize("name", [*SCALABLE, "frontend"])
def test_every_epd_service_has_a_healthcheck_on_its_health_endpoint(services, name):
    env = environment(services[name])
    check = " ".join(services[name]["healthcheck"]["test"])
    assert f"http://127.0.0.1:{env['EPD_HEALTH_PORT']}/ready" in check


def test_the_language_worker_is_there_but_off_by_default(services):
    language = services["language"]
    assert epd_command(language) == ["language"] and language["profiles"] == ["language"]
    assert environment(language) == environment(services["decode"])
    for name in ("encoder", "prefill", "decode", "frontend"):
        assert "profiles" not in services[name], f"{name} must start by default"


def test_host_overlay_keeps_every_socket_on_loopback(services, host_services):
    """deploy/compose.host.yml: each service on the host network, listening and advertising 127.0.0.1."""
    assert set(host_services) == set(services)
    for name, service in host_services.items():
        assert service["network_mode"] == "host", name
        if name == "nats":
            command = epd_command(service)
            assert command[command.index("-a") + 1] == "127.0.0.1"
            continue
        env = environment(service)
        assert env["EPD_NATS_URL"] == "nats://127.0.0.1:4222"
        assert env["EPD_DATA_HOST"] == env["EPD_DATA_ADVERTISE"] == "127.0.0.1"
        if name != "frontend":  # replicas share the host's ports: a fixed health port would collide
            assert env["EPD_HEALTH_PORT"] == "0" and service["healthcheck"] == {"disable": True}
    frontend = host_services["frontend"]
    assert frontend["ports"] == []
    settings = parse_settings(FrontendSettings, [interpolate(a) for a in epd_command(frontend)[1:]], "epd frontend")
    assert settings.host == "127.0.0.1" and settings.port == 8000


@pytest.mark.parametrize("name", SETTINGS)
def test_host_overlay_environment_names_settings_fields(host_services, name):
    for key in environment(host_services[name]):
        assert key[len("EPD_"):].lower() in SETTINGS[name].model_fields, f"{name}: {key}"
