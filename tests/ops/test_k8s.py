"""The Kubernetes manifests in scripts/k8s/: ``kubectl kustomize`` renders them, every
object passes Kubernetes 1.32's JSON schema in strict mode (no unknown fields), and
they agree with the agent they start (its CLI flags, health service names, ports,
environment variables).

No API server is available, so ``kubectl apply --dry-run=client`` (which asks one
for its resource types) cannot run; the schema check uses the schemas that the
``kubernetes-validate`` package ships (generated from Kubernetes' OpenAPI), offline.
What an API server adds beyond them (admission, defaults, cross-field rules) is not
checked (the README says so).
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from hypermesh.agent.ops.health import LIVENESS_SERVICE
from hypermesh.cli.agent import agent_start
from hypermesh.config import AgentConfig
from hypermesh.tls import TlsFiles

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "scripts" / "k8s"
NAMESPACE = "hypermesh"
TLS_DIR = "/etc/hypermesh/tls"  # where the init container leaves the node's certificate
KUBERNETES = "1.32.0"  # the schema version checked against (kubectl here is v1.32)


def load() -> dict[tuple[str, str], dict[str, Any]]:
    docs: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert isinstance(doc, dict), f"{path.name}: a document is not a mapping"
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def typed(obj: Any, path: str, kind: type | tuple[type, ...]) -> Any:
    """The value at ``path`` (dotted, ``[n]`` for list items), checked to be a ``kind``."""
    value = obj
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if part.startswith("["):
            assert isinstance(value, list), f"{path}: {part} of a non-list"
            value = value[int(part[1:-1])]
        else:
            assert isinstance(value, dict) and part in value, f"{path}: no {part!r}"
            value = value[part]
    assert isinstance(value, kind), f"{path}: {value!r} is not {kind}"
    return value


@pytest.fixture(scope="module")
def docs() -> dict[tuple[str, str], dict[str, Any]]:
    return load()


@pytest.fixture(scope="module")
def pod(docs: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    return typed(docs[("DaemonSet", "hypermesh-agent")], "spec.template.spec", dict)


@pytest.fixture(scope="module")
def container(pod: dict[str, Any]) -> dict[str, Any]:
    (c,) = typed(pod, "containers", list)
    return c


def test_every_document_is_a_resource_in_the_namespace(
    docs: dict[tuple[str, str], dict[str, Any]],
) -> None:
    api = {"Namespace": "v1", "ConfigMap": "v1", "Secret": "v1", "DaemonSet": "apps/v1"}
    assert {kind for kind, _ in docs} == set(api)
    for (kind, name), doc in docs.items():
        assert doc["apiVersion"] == api[kind], (kind, name)
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
        if kind not in ("Namespace",):
            assert doc["metadata"].get("namespace") == NAMESPACE, (kind, name)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    """What ``kubectl kustomize scripts/k8s`` (what ``kubectl apply -k`` applies) renders."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "the Kubernetes test needs kubectl (scripts/setup.sh installs it)"
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"kubectl kustomize failed:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc is not None]


def test_kubectl_kustomize_renders_the_manifests_unchanged(
    rendered: list[dict[str, Any]], docs: dict[tuple[str, str], dict[str, Any]]
) -> None:
    assert {(d["kind"], d["metadata"]["name"]): d for d in rendered} == docs


def test_every_object_passes_the_kubernetes_schema_strictly(
    rendered: list[dict[str, Any]],
) -> None:
    for doc in rendered:
        try:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {exc.message} "
                        f"at {'.'.join(map(str, exc.path))}")


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (lambda c, p: c.update(imagePullPolice="Always"), "imagePullPolice"),  # a typo
        (lambda c, p: p.update(hostNetwork="yes"), "'yes' is not of type 'boolean'"),
        (lambda c, p: c["ports"][0].update(containerPort="7070"), "is not of type 'integer'"),
        (lambda c, p: c.pop("name"), "'name' is a required property"),
    ],
)
def test_the_schema_check_catches_mistakes(
    rendered: list[dict[str, Any]], change: Any, complaint: str
) -> None:
    ds = copy.deepcopy(next(d for d in rendered if d["kind"] == "DaemonSet"))
    pod = ds["spec"]["template"]["spec"]
    change(pod["containers"][0], pod)
    with pytest.raises(kubernetes_validate.ValidationError, match=re.escape(complaint)):
        kubernetes_validate.validate(ds, KUBERNETES, strict=True)


def test_daemonset_shape(docs: dict[tuple[str, str], dict[str, Any]]) -> None:
    ds = docs[("DaemonSet", "hypermesh-agent")]
    selector = typed(ds, "spec.selector.matchLabels", dict)
    labels = typed(ds, "spec.template.metadata.labels", dict)
    assert selector and selector.items() <= labels.items()  # else the API server rejects it
    assert typed(ds, "spec.updateStrategy.type", str) in ("RollingUpdate", "OnDelete")
    for key, value in typed(ds, "spec.template.metadata.annotations", dict).items():
        assert isinstance(value, str), f"annotation {key}: {value!r} must be a string"


def test_fuse_device_and_privileges(pod: dict[str, Any], container: dict[str, Any]) -> None:
    volumes = {v["name"]: v for v in typed(pod, "volumes", list)}
    mounts = {m["name"]: m["mountPath"] for m in typed(container, "volumeMounts", list)}
    assert volumes["fuse"]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    assert mounts["fuse"] == "/dev/fuse"
    assert typed(container, "securityContext.privileged", bool) is True
    assert set(mounts) <= set(volumes)
    assert typed(pod, "hostNetwork", bool) is True  # the registered address is the node's


def _args(container: dict[str, Any]) -> list[str]:
    args = typed(container, "args", list)
    for a in args:
        assert isinstance(a, str), f"arg {a!r} must be a string (quote numbers)"
    return args


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_args_are_what_the_agent_accepts(pod: dict[str, Any], container: dict[str, Any]) -> None:
    args = _args(container)
    assert typed(container, "command", list) == ["hypermesh"] and args[:2] == ["agent", "start"]
    env = {e["name"]: e for e in typed(container, "env", list)}
    used = set(re.findall(r"\$\((\w+)\)", " ".join(args)))
    assert used <= set(env), f"args use undefined variables: {used - set(env)}"
    fields = {"NODE_NAME": "spec.nodeName", "POD_IP": "status.podIP"}
    for name in used:
        assert env[name]["valueFrom"]["fieldRef"]["fieldPath"] == fields[name]
    # Parse the arguments with the real command line, as the container would.
    values = {"NODE_NAME": "gpu-node-1", "POD_IP": "10.0.0.7"}
    resolved = [re.sub(r"\$\((\w+)\)", lambda m: values[m[1]], a) for a in args[2:]]
    params = agent_start.make_context("start", resolved).params
    tls = params["tls_ca"], params["tls_cert"], params["tls_key"]
    assert all(path.startswith(TLS_DIR + "/") for path in tls)  # the init step's volume
    cfg = AgentConfig.lan(
        name=params["name"], listen=params["listen"], metrics_listen=params["metrics_listen"],
        slots=params["slots"], kill_grace=params["grace"], cache_size=params["cache_size"],
        work_dir=params["work_dir"], health_listen=params["health_listen"],
        tls=TlsFiles(*map(Path, tls)), insecure=params["insecure"],
    )
    assert cfg.listen == "10.0.0.7:7070" and cfg.name == "gpu-node-1"
    mounts = {m["name"]: m["mountPath"] for m in typed(container, "volumeMounts", list)}
    assert mounts["tls"] == TLS_DIR
    # Room for the tasks' grace period and the drain's own steps before SIGKILL.
    assert typed(pod, "terminationGracePeriodSeconds", int) > cfg.kill_grace + 10


def test_probes_use_grpc_health_on_the_plaintext_health_port(container: dict[str, Any]) -> None:
    """Kubelet's grpc probes show no client certificate: they ask --health-listen."""
    args = _args(container)
    ports = {p["name"]: p["containerPort"] for p in typed(container, "ports", list)}
    assert _flag(args, "--listen").endswith(f":{ports['grpc']}")
    assert _flag(args, "--metrics-listen").endswith(f":{ports['metrics']}")
    assert _flag(args, "--health-listen").endswith(f":{ports['health']}")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        grpc_probe = typed(container, f"{probe}.grpc", dict)
        assert typed(grpc_probe, "port", int) == ports["health"]  # a number: names not allowed
        assert set(grpc_probe) <= {"port", "service"}
    assert container["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE
    assert container["startupProbe"]["grpc"]["service"] == LIVENESS_SERVICE
    assert container["readinessProbe"]["grpc"].get("service", "") == ""  # follows the state


def test_metrics_annotations_match_the_port(
    docs: dict[tuple[str, str], dict[str, Any]], container: dict[str, Any]
) -> None:
    annotations = docs[("DaemonSet", "hypermesh-agent")]["spec"]["template"]["metadata"][
        "annotations"
    ]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert annotations["prometheus.io/port"] == str(ports["metrics"])
    assert annotations["prometheus.io/path"] == "/metrics"


def test_configuration_is_what_the_agent_reads(
    docs: dict[tuple[str, str], dict[str, Any]], container: dict[str, Any]
) -> None:
    sources = {
        next(iter(ref)): ref[next(iter(ref))]["name"]
        for ref in typed(container, "envFrom", list)
    }
    config = docs[("ConfigMap", sources["configMapRef"])]
    secret = docs[("Secret", sources["secretRef"])]
    source = "\n".join(p.read_text() for p in (ROOT / "hypermesh").rglob("*.py"))
    source += "\n".join(p.read_text() for p in (ROOT / "chunkfs").rglob("*.py"))
    for key, value in typed(config, "data", dict).items():
        assert isinstance(value, str), f"ConfigMap {key}: quote the value"
        assert f'"{key}"' in source, f"ConfigMap key {key} is not an environment variable " \
            "hypermesh reads"
    assert set(typed(secret, "stringData", dict)) >= {"AWS_ACCESS_KEY_ID",
                                                        "AWS_SECRET_ACCESS_KEY"}
