"""deploy/k8s renders, validates against the Kubernetes schemas, and agrees with the code it runs.

No cluster runs here. What runs: ``kubectl kustomize`` renders every overlay (with credentials from
``epd credentials``), kubernetes-validate checks every object against the API schemas of the oldest and
newest Kubernetes we claim (strict: an unknown field is an error), the ScaledObject against KEDA's CRD
schema (deploy/k8s/schemas), nats-server parses the rendered NATS configuration, and each container's
command and environment parse into that service's settings. The manifests' own files are validated
too, so that part runs even where kubectl does not.
"""

from __future__ import annotations

import base64
import copy
import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from launcher.credentials import ROLES, StackCredentials
from launcher.natsserver import nats_server_binary
from services.decode.settings import DecodeSettings
from services.encoder.settings import EncoderSettings
from services.frontend.metrics import FrontendMetrics
from services.frontend.settings import FrontendSettings
from services.prefill.settings import PrefillSettings
from shared.settings import parse_settings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "gpu-language")
KUBERNETES = ("1.28", kubernetes_validate.utils.latest_version())  # oldest we claim, newest the validator knows
WORKERS = ("encoder", "prefill", "decode", "language")
SETTINGS = {"encoder": EncoderSettings, "prefill": PrefillSettings, "decode": DecodeSettings,
            "frontend": FrontendSettings}
NATS_FLUSH_SECONDS = 5  # shared.service: the NATS drain after the work drain
KUSTOMIZE_KINDS = ("Kustomization", "Component")


def language_settings():
    try:
        from services.language.settings import LanguageSettings
    except ImportError:
        return None
    return LanguageSettings


# ---------------------------------------------------------------- rendering

@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """deploy/k8s copied, with credentials written where credentials/kustomization.yaml reads them."""
    copied = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, copied, ignore=shutil.ignore_patterns("*.env", "nats-auth.conf"))
    StackCredentials.generate("epd").write(copied / "credentials")
    return copied


def kubectl() -> str:
    found = shutil.which("kubectl")
    if not found:
        message = "kubectl is not installed: it renders the kustomizations (kubectl kustomize)"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must render them")
        pytest.skip(message)
    return found


@pytest.fixture(scope="module")
def rendered(tree) -> dict[str, list[dict]]:
    out = {}
    for name in ("base", *(f"overlays/{o}" for o in OVERLAYS)):
        run = subprocess.run([kubectl(), "kustomize", str(tree / name)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, f"{name}: {run.stderr}"
        out[name.removeprefix("overlays/")] = [d for d in yaml.safe_load_all(run.stdout) if d]
    return out


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def epd_deployments(objects: list[dict]) -> dict[str, dict]:
    """component (frontend, encoder, ...) → its Deployment."""
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in by_kind(objects, "Deployment").values()
            if d["metadata"]["labels"].get("app.kubernetes.io/name") == "epd"}


def container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def environment(objects: list[dict], deployment: dict) -> dict[str, str]:
    """What the container starts with: its ConfigMaps and Secrets (envFrom), then its own ``env``."""
    configmaps, secrets = by_kind(objects, "ConfigMap"), by_kind(objects, "Secret")
    env: dict[str, str] = {}
    for source in container(deployment).get("envFrom", []):
        if "configMapRef" in source:
            env.update(configmaps[source["configMapRef"]["name"]]["data"])
        else:
            secret = secrets[source["secretRef"]["name"]]
            env.update({k: base64.b64decode(v).decode() for k, v in secret["data"].items()})
    for item in container(deployment).get("env", []):
        # a downward-API value (the pod IP) is stood in for by a documentation address (TEST-NET-1)
        env[item["name"]] = item.get("value", "192.0.2.7" if "valueFrom" in item else "")
    return env


# ---------------------------------------------------------------- schemas

@cache
def keda_schema() -> dict:
    crd = next(d for d in yaml.safe_load_all((K8S / "schemas" / "keda.sh_scaledobjects.yaml").read_text()) if d)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    return strict(version["schema"]["openAPIV3Schema"])


def strict(schema: dict) -> dict:
    """A CRD's OpenAPI schema as strict JSON Schema: an object with listed properties takes no others
    (the API server would prune them silently: a typo'd field would simply vanish)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def validate(obj: dict) -> None:
    """Against the Kubernetes API schemas (every version in KUBERNETES), or KEDA's for a ScaledObject."""
    if obj["apiVersion"].startswith("keda.sh/"):
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        jsonschema.Draft7Validator(keda_schema()).validate(obj)
        return
    for version in KUBERNETES:
        kubernetes_validate.validate(obj, version, strict=True)


def source_objects() -> list[tuple[Path, dict]]:
    objects = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.parent.name == "schemas":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") not in KUSTOMIZE_KINDS:
                objects.append((path, doc))
    return objects


@pytest.mark.parametrize("path, obj", source_objects(),
                         ids=lambda v: str(v.relative_to(K8S)) if isinstance(v, Path) else v["kind"])
def test_every_manifest_file_validates(path, obj):
    """Without rendering: every object written under deploy/k8s is valid as written."""
    validate(obj)


@pytest.mark.parametrize("overlay", ("base", *OVERLAYS))
def test_rendered_manifests_validate(rendered, overlay):
    assert rendered[overlay]
    for obj in rendered[overlay]:
        try:
            validate(obj)
        except (jsonschema.ValidationError, kubernetes_validate.utils.SchemaNotFoundError) as err:
            raise AssertionError(f"{overlay}: {obj['kind']}/{obj['metadata']['name']}: {err}") from None


def test_the_validator_refuses_what_is_wrong(rendered):
    """The validation above is real: a typo'd field, a wrong type and a bad ScaledObject all fail."""
    deployment = copy.deepcopy(epd_deployments(rendered["gpu"])["encoder"])
    probe = container(deployment)["readinessProbe"]
    probe["httpGett"] = probe.pop("httpGet")
    with pytest.raises(jsonschema.ValidationError):
        validate(deployment)
    deployment = copy.deepcopy(epd_deployments(rendered["gpu"])["encoder"])
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "60"
    with pytest.raises(jsonschema.ValidationError):
        validate(deployment)
    scaled = copy.deepcopy(next(iter(by_kind(rendered["gpu"], "ScaledObject").values())))
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 16  # KEDA takes strings only
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)


# ---------------------------------------------------------------- what the manifests mean

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_worker_kind_and_the_frontend_are_deployed(rendered, overlay):
    kinds = set(epd_deployments(rendered[overlay]))
    language = overlay.endswith("language")
    assert kinds == ({"frontend", "encoder", "language"} if language else {"frontend", "encoder", "prefill", "decode"})
    frontend = by_kind(rendered[overlay], "Service")["epd-frontend"]
    pods = epd_deployments(rendered[overlay])["frontend"]["spec"]["selector"]["matchLabels"]
    assert frontend["spec"]["selector"] == pods


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_commands_and_environment_parse_into_each_services_settings(rendered, overlay, monkeypatch):
    objects = rendered[overlay]
    for kind, deployment in epd_deployments(objects).items():
        settings_cls = SETTINGS.get(kind) or (language_settings() if kind == "language" else None)
        args = [str(a) for a in container(deployment)["args"]]
        assert args[0] == kind
        if settings_cls is None:
            continue  # `epd language` is not in this tree yet
        for key in [k for k in os.environ if k.startswith("EPD_")]:
            monkeypatch.delenv(key)
        env = environment(objects, deployment)
        for key, value in env.items():
            assert key.startswith("EPD_") and key[4:].lower() in settings_cls.model_fields, f"{kind}: {key}"
            monkeypatch.setenv(key, value)
        settings = parse_settings(settings_cls, args[1:], f"epd {kind}")
        nats = by_kind(objects, "Service")["epd-nats"]
        assert settings.nats_url == f"nats://{nats['metadata']['name']}:{nats['spec']['ports'][0]['port']}"
        assert settings.nats_user == kind
        assert settings.health_port  # the probes reach it on the pod's IP: it listens on data_host
        assert settings.data_host == "0.0.0.0" and settings.data_advertise == "192.0.2.7"  # the pod's IP


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_mean_what_they_say(rendered, overlay):
    """Liveness and startup ask /live (the event loop answers), readiness /ready (serving), on the port
    the service's health endpoint listens on."""
    objects = rendered[overlay]
    for kind, deployment in epd_deployments(objects).items():
        c = container(deployment)
        port = int(environment(objects, deployment)["EPD_HEALTH_PORT"])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for probe, path in (("startupProbe", "/live"), ("livenessProbe", "/live"), ("readinessProbe", "/ready")):
            get = c[probe]["httpGet"]
            assert get["path"] == path, f"{kind} {probe}"
            assert ports[get["port"]] == port, f"{kind} {probe} probes another port than the health endpoint's"
        assert c["livenessProbe"]["timeoutSeconds"] >= 2


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_grace_period_outlasts_the_drain(rendered, overlay):
    objects = rendered[overlay]
    for kind, deployment in epd_deployments(objects).items():
        drain = float(environment(objects, deployment)["EPD_DRAIN_SECONDS"])
        pre_stop = container(deployment).get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        waits = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= waits + drain + NATS_FLUSH_SECONDS + 10, f"{kind}: SIGKILL would come mid-drain"
    nats = by_kind(objects, "StatefulSet")["epd-nats"]
    config = by_kind(objects, "ConfigMap")["epd-nats-config"]["data"]["nats.conf"]
    lame_duck = re.search(r"lame_duck_duration: (\d+)s", config)
    assert nats["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > int(lame_duck[1])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_request_gpus_where_there_are_gpus(rendered, overlay):
    for kind, deployment in epd_deployments(rendered[overlay]).items():
        resources = container(deployment)["resources"]
        gpus = resources.get("limits", {}).get("nvidia.com/gpu")
        if overlay == "cpu" or kind == "frontend":
            assert gpus is None, kind
        else:
            assert gpus == "1" and resources["requests"]["nvidia.com/gpu"] == "1", kind


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_deployment_has_a_disruption_budget_of_its_own(rendered, overlay):
    budgets = by_kind(rendered[overlay], "PodDisruptionBudget")
    for kind, deployment in epd_deployments(rendered[overlay]).items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        mine = [b for b in budgets.values() if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(mine) == 1, f"{kind}: {len(mine)} budgets"
        assert mine[0]["spec"].get("maxUnavailable") == 1  # evictions go on, one pod at a time


@pytest.mark.parametrize("overlay", ("gpu", "gpu-language"))
def test_encoders_autoscale_on_their_in_flight_jobs(rendered, overlay):
    objects = rendered[overlay]
    scaled = by_kind(objects, "ScaledObject")["epd-encoder"]
    encoder = epd_deployments(objects)["encoder"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == encoder["metadata"]["name"]
    assert "replicas" not in encoder["spec"], "a fixed replica count fights the autoscaler on every apply"
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    query = trigger["metadata"]["query"]
    metric = re.match(r'avg\((\w+)\{service="([\w-]+)", stat="(\w+)"\}\)$', query)
    assert metric, query
    name, service, stat = metric.groups()
    assert name == FrontendMetrics().service_stat._name  # the frontend publishes it
    assert service == "epd-encoder" and stat in ("in_flight", "queue_depth")
    from services.encoder.encoder import Encoder
    from services.encoder.settings import EncoderSettings
    from shared.bus.subjects import Subjects
    from shared.dataplane.plane import DataPlane

    settings = EncoderSettings()
    reported = Encoder(settings, Subjects(), "encoder-test", DataPlane.from_settings(settings)).stats()
    assert stat in reported, "the encoder's stats do not report it"


def test_models_volume_reaches_every_pod_that_loads_the_model(rendered):
    for overlay in ("gpu", "gpu-language"):
        claims = by_kind(rendered[overlay], "PersistentVolumeClaim")
        for kind, deployment in epd_deployments(rendered[overlay]).items():
            volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
            claim = volumes["models"]["persistentVolumeClaim"]["claimName"]
            assert claim in claims and volumes["models"]["persistentVolumeClaim"]["readOnly"], kind
            env = environment(rendered[overlay], deployment)
            assert env["EPD_MODEL"].startswith("/models/"), kind


def test_nats_runs_jetstream_with_per_role_users(rendered, tmp_path):
    """nats-server itself parses the rendered configuration (``-t``), authorization included."""
    objects = rendered["gpu"]
    nats = by_kind(objects, "StatefulSet")["epd-nats"]
    pod = nats["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    config = by_kind(objects, "ConfigMap")[volumes["config"]["configMap"]["name"]]["data"]["nats.conf"]
    auth = by_kind(objects, "Secret")[volumes["auth"]["secret"]["secretName"]]["data"]["nats-auth.conf"]
    assert mounts["/etc/nats/nats.conf"]["subPath"] == "nats.conf"
    assert mounts["/etc/nats/nats-auth.conf"]["subPath"] == "nats-auth.conf"
    assert re.search(r"jetstream \{\s*store_dir: /data", config) and "/data" in mounts
    assert nats["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == mounts["/data"]["name"]
    text = base64.b64decode(auth).decode()
    for role in ("encoder", "prefill", "decode", "frontend"):
        assert f'user: "{role}"' in text
    here = config.replace("/var/run/nats/", f"{tmp_path}/").replace("/data", str(tmp_path))  # the pod's paths
    (tmp_path / "nats.conf").write_text(here)
    (tmp_path / "nats-auth.conf").write_text(text)
    run = subprocess.run([nats_server_binary(), "-c", str(tmp_path / "nats.conf"), "-t"], capture_output=True,
                         text=True, timeout=30, env={**os.environ, "SERVER_NAME": "epd-nats-0"})
    assert run.returncode == 0, run.stdout + run.stderr


def test_each_role_gets_its_own_credentials(rendered):
    objects = rendered["gpu"]
    users = {}
    for kind, deployment in epd_deployments(objects).items():
        env = environment(objects, deployment)
        users[kind] = (env["EPD_NATS_USER"], env["EPD_NATS_PASSWORD"])
        assert env["EPD_NATS_USER"] == kind and len(env["EPD_NATS_PASSWORD"]) >= 24
    assert len({password for _, password in users.values()}) == len(users)


def test_the_language_template_replaces_prefill_and_decode(rendered):
    objects = rendered["gpu-language"]
    deployments = epd_deployments(objects)
    assert "prefill" not in deployments and "decode" not in deployments
    language = container(deployments["language"])
    assert language["args"] == ["language"]
    assert {b["metadata"]["name"] for b in by_kind(objects, "PodDisruptionBudget").values()} == {
        "epd-frontend", "epd-encoder", "epd-language"}
    # Everything else as in E/P/D: the same probes, grace, GPU and volumes as a decode worker.
    decode = epd_deployments(rendered["gpu"])["decode"]
    same = lambda d: {k: v for k, v in container(d).items() if k not in ("name", "args", "envFrom")}  # noqa: E731
    assert same(deployments["language"]) == same(decode)


def test_credentials_stay_out_of_git():
    ignored = (K8S / "credentials" / ".gitignore").read_text().split()
    assert "*.env" in ignored and "nats-auth.conf" in ignored
    kustomization = yaml.safe_load((K8S / "credentials" / "kustomization.yaml").read_text())
    files = [f for g in kustomization["secretGenerator"] for f in g.get("files", []) + g.get("envs", [])]
    assert set(files) <= {"nats-auth.conf", *(f"{role}.env" for role in ROLES)}, "a file epd credentials does not write"
