"""The Helm chart (helm/): lints strictly, renders with the default values, with every feature on and
with each storage choice, and what it renders is valid Kubernetes (kubernetes-validate --strict),
clean YAML (yamllint), and what the server expects (its flags, probes, metrics, auth).

helm itself is the real binary (v4), put at .tools/bin/helm by tools/get_helm.py (`make install`)."""
from __future__ import annotations

import argparse
import base64
import functools
import inspect
import json
import subprocess
import sys
import types
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

# The helm binary comes with `make test` (not `make test-fast`), so the chart is checked with the slow tests.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm"
ALL_FEATURES = CHART / "ci" / "all-features-values.yaml"
HELM = ROOT / ".tools" / "bin" / "helm"
RELEASE, NAMESPACE = "rel", "llm"
FULLNAME = f"{RELEASE}-minillm"

# The chart's kubeVersion floor, and the newest release kubernetes-validate knows.
KUBE_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
# Custom resources kubernetes-validate has no schema for; test_service_monitor checks these.
CRD_KINDS = {"ServiceMonitor"}
# MINILLM_* names the server does not take as flags: the models directory (engine/model_store.py).
NON_FLAG_ENV = {"MINILLM_MODELS_DIR"}

# The chart has no default image (none is published): every render names the one the user pushed.
IMAGE = ("--set", "image.repository=registry.example.com/minillm")

CASES: dict[str, tuple[str, ...]] = {
    "default": IMAGE,
    "all-features": ("-f", str(ALL_FEATURES)),
    "pvc": (*IMAGE, "--set", "storage.type=pvc"),
    "existing-claim": (*IMAGE, "--set",
                       "storage.type=existingClaim,storage.existingClaim=weights,storage.readOnly=true",
                       "--set", "model.name=/models/Llama-3.2-1B-Instruct"),
    "host-path": (*IMAGE, "--set", "storage.type=hostPath"),
    "existing-api-key-secret": (*IMAGE, "--set", "apiKeys.existingSecret=minillm-keys"),
    "tensor-parallel": (*IMAGE, "--set", "engine.tensorParallelSize=4,shm.sizeLimit=32Gi"),
    "cpu-only": (*IMAGE, "--set", "gpu.count=0,shm.enabled=false,preStopSleepSeconds=0,tolerations=null"),
}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    if not HELM.exists():
        pytest.fail(f"{HELM} is missing: run `make install` (or `{sys.executable} tools/get_helm.py`)")
    result = subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


@functools.cache
def render_text(*args: str) -> str:
    return helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args).stdout


@functools.cache
def render(*args: str) -> tuple[dict, ...]:
    return tuple(doc for doc in yaml.safe_load_all(render_text(*args)) if doc)


def only(docs: tuple[dict, ...], kind: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


def pod_spec(docs: tuple[dict, ...]) -> dict:
    return only(docs, "Deployment")["spec"]["template"]["spec"]


def server(docs: tuple[dict, ...]) -> dict:
    [container] = pod_spec(docs)["containers"]
    return container


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def secret_value(docs: tuple[dict, ...], ref: dict) -> str:
    [secret] = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == ref["name"]]
    return base64.b64decode(secret["data"][ref["key"]]).decode()


def server_flags() -> set[str]:
    """The dests of `minillm serve`'s flags (each read from MINILLM_<DEST>)."""
    from app.settings import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return {a.dest for a in parser._actions if a.dest != "help"}


# ---- lint, validate, yamllint --------------------------------------------------------------------


@pytest.mark.parametrize("values", [(), ("-f", str(ALL_FEATURES))], ids=["default", "all-features"])
def test_lint_strict(values: tuple[str, ...]) -> None:
    result = helm("lint", "--strict", str(CHART), *values)
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("case", CASES)
def test_rendered_manifests_validate_strictly(case: str) -> None:
    docs = render(*CASES[case])
    assert {"Deployment", "Service", "Pod"} <= {d["kind"] for d in docs}
    for doc in docs:
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                assert doc["kind"] in CRD_KINDS, f"no schema for {doc['kind']} {doc['apiVersion']}"
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{case}: {doc['kind']}/{doc['metadata']['name']} against {version}: "
                            f"{'.'.join(map(str, e.path))}: {e.message}")


def yamllint_problems(text: str, config: YamlLintConfig) -> list[str]:
    return [f"{p.line}:{p.column} {p.level} {p.message} ({p.rule})" for p in linter.run(text, config)]


@pytest.mark.parametrize("case", CASES)
def test_rendered_manifests_pass_yamllint(case: str) -> None:
    # The repo's rules, less line-length: rendered manifests embed files (the dashboard JSON).
    config = YamlLintConfig(f"extends: {ROOT / '.yamllint.yaml'}\nrules:\n  line-length: disable\n")
    assert yamllint_problems(render_text(*CASES[case]), config) == []


@pytest.mark.parametrize("path", [CHART / "values.yaml", ALL_FEATURES, CHART / "Chart.yaml"], ids=lambda p: p.name)
def test_values_files_pass_yamllint(path: Path) -> None:
    config = YamlLintConfig(file=str(ROOT / ".yamllint.yaml"))
    assert yamllint_problems(path.read_text(), config) == []


def test_schema_rejects_bad_values() -> None:
    result = helm("lint", "--strict", str(CHART), "--set", "storage.type=nfs,engine.maxNumSeq=8,replicaCount=-1",
                  check=False)
    assert result.returncode != 0
    for complaint in ("/storage/type", "maxNumSeq", "/replicaCount"):
        assert complaint in result.stdout + result.stderr


def test_schema_knows_exactly_the_server_flags() -> None:
    """engine.* and server.* in the values are the server's flags (a typo fails the schema, so the
    schema must list every flag); model, served name and keys have their own values."""
    props = json.loads((CHART / "values.schema.json").read_text())["properties"]
    snake = lambda name: "".join(f"_{c.lower()}" if c.isupper() else c for c in name)  # noqa: E731
    in_chart = {snake(k) for k in [*props["engine"]["properties"], *props["server"]["properties"]]}
    in_chart |= {"model", "served_model_name", "api_key"}
    flags = server_flags()
    assert flags - in_chart == set(), "server flags the chart cannot set"
    assert in_chart - flags == set(), "chart values that are no server flag"


# ---- what the server needs -----------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_env_names_are_server_flags(case: str) -> None:
    names = {n for n in env_of(server(render(*CASES[case]))) if n.startswith("MINILLM_")}
    flags = {f"MINILLM_{f.upper()}" for f in server_flags()}
    assert names - flags - NON_FLAG_ENV == set()
    assert "MINILLM_MODELS_DIR" in (ROOT / "engine" / "model_store.py").read_text()


def test_server_reads_the_rendered_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The all-features env, secrets resolved, is what the server's own settings parser sees."""
    from app.settings import from_env

    docs = render(*CASES["all-features"])
    for name, entry in env_of(server(docs)).items():
        if name.startswith("MINILLM_"):
            value = entry["value"] if "value" in entry else secret_value(docs, entry["valueFrom"]["secretKeyRef"])
            monkeypatch.setenv(name, value)
    settings = from_env()
    assert settings.engine.model == "/models/meta-llama/Llama-3.2-1B-Instruct"
    assert settings.model_name == "llama-3.2-1b-instruct"
    assert (settings.engine.dtype, settings.engine.max_num_seqs, settings.engine.max_model_len) == ("bfloat16", 128, 32768)
    assert settings.engine.gpu_memory_utilization == 0.85 and settings.engine.kv_cache_memory == "40GiB"
    assert settings.engine.enable_prefix_caching is False
    assert (settings.port, settings.max_queue, settings.max_body_bytes) == (8000, 512, 10485760)
    assert (settings.shutdown_grace, settings.log_level) == (60.0, "debug")
    assert settings.api_keys == ["sk-first-key", "sk-second-key"]


def test_default_served_model_name_matches_the_server() -> None:
    from app.settings import ServerSettings
    from engine.config import EngineConfig

    for case in ("default", "existing-claim"):
        env = env_of(server(render(*CASES[case])))
        expected = ServerSettings(engine=EngineConfig(model=env["MINILLM_MODEL"]["value"])).model_name
        assert env["MINILLM_SERVED_MODEL_NAME"]["value"] == expected


@pytest.mark.parametrize(("case", "gpus"), [("default", 1), ("all-features", 2), ("tensor-parallel", 4),
                                            ("cpu-only", None)])
def test_gpu_requests_equal_limits(case: str, gpus: int | None) -> None:
    resources = server(render(*CASES[case]))["resources"]
    assert resources["requests"].get("nvidia.com/gpu") == resources["limits"].get("nvidia.com/gpu") == gpus


def test_tensor_parallel_size_sets_env_and_shm() -> None:
    docs = render(*CASES["tensor-parallel"])
    assert env_of(server(docs))["MINILLM_TENSOR_PARALLEL_SIZE"]["value"] == "4"
    [shm] = [v for v in pod_spec(docs)["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}


@pytest.mark.parametrize("case", ["default", "all-features"])
def test_probes(case: str) -> None:
    container = server(render(*CASES[case]))
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port_names["http"] == int(env_of(container)["MINILLM_PORT"]["value"])
    probes = {kind: container[f"{kind}Probe"] for kind in ("startup", "liveness", "readiness")}
    assert {k: p["httpGet"]["path"] for k, p in probes.items()} == {
        "startup": "/ready", "liveness": "/health", "readiness": "/ready"}
    assert all(p["httpGet"]["port"] == "http" for p in probes.values())
    startup = probes["startup"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 10 * 60, "minutes for weight loading"


@pytest.mark.parametrize("case", CASES)
def test_non_root_security_context(case: str) -> None:
    spec = pod_spec(render(*CASES[case]))
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == 10001  # the Dockerfile's USER
    assert spec["automountServiceAccountToken"] is False
    for container in spec["containers"] + spec.get("initContainers", []):
        ctx = container["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"]
        assert ctx["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/tmp", "/models"} <= mounts  # the writable places


@pytest.mark.parametrize("case", ["default", "all-features"])
def test_dev_shm_is_a_memory_emptydir(case: str) -> None:
    docs = render(*CASES[case])
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    [mount] = [m for m in server(docs)["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[mount["name"]]["emptyDir"]["medium"] == "Memory"


def test_termination_grace_exceeds_the_drain() -> None:
    for case in ("default", "all-features"):
        container = server(docs := render(*CASES[case]))
        grace = float(env_of(container)["MINILLM_SHUTDOWN_GRACE"]["value"])
        pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pod_spec(docs)["terminationGracePeriodSeconds"] > grace + pre_stop
    result = helm("template", RELEASE, str(CHART), *IMAGE, "--set", "terminationGracePeriodSeconds=30",
                  check=False)
    assert result.returncode != 0 and "must exceed" in result.stderr


def test_image_must_be_given() -> None:
    """No image is published, so the chart has no default: without image.repository rendering fails
    and says how to build and push one; with it, the tag defaults to the chart's appVersion."""
    result = helm("template", RELEASE, str(CHART), check=False)
    assert result.returncode != 0
    assert "image.repository is required" in result.stderr and "docker push" in result.stderr
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert server(render(*CASES["default"]))["image"] == f"registry.example.com/minillm:{app_version}"
    tagged = render(*IMAGE, "--set", "image.tag=v2", *CASES["all-features"])
    assert server(tagged)["image"] == pod_spec(tagged)["initContainers"][0]["image"] == "registry.example.com/minillm:v2"


@pytest.mark.parametrize(("case", "volume"), [
    ("default", {"emptyDir": {"sizeLimit": "20Gi"}}),
    ("pvc", {"persistentVolumeClaim": {"claimName": f"{FULLNAME}-models"}}),
    ("existing-claim", {"persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}),
    ("host-path", {"hostPath": {"path": "/var/lib/minillm/models", "type": "DirectoryOrCreate"}}),
])
def test_model_storage(case: str, volume: dict) -> None:
    docs = render(*CASES[case])
    [models] = [v for v in pod_spec(docs)["volumes"] if v["name"] == "models"]
    assert models == {"name": "models", **volume}
    assert env_of(server(docs))["MINILLM_MODELS_DIR"]["value"] == "/models"
    claims = [d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert claims == ([f"{FULLNAME}-models"] if case == "pvc" else [])


def test_download_init_container(monkeypatch: pytest.MonkeyPatch) -> None:
    """The init container's script, run against a stand-in huggingface_hub, downloads the repo into
    the directory the server loads, with arguments the real snapshot_download accepts."""
    from huggingface_hub import snapshot_download  # the real one (the module loads it lazily)

    docs = render(*CASES["all-features"])
    [init] = pod_spec(docs)["initContainers"]
    env = env_of(init)
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
    assert env["MODEL_DIR"]["value"] == env_of(server(docs))["MINILLM_MODEL"]["value"]
    assert {m["name"] for m in init["volumeMounts"]} >= {"models"}
    calls: list[dict] = []
    stub = types.ModuleType("huggingface_hub")
    stub.snapshot_download = lambda **kwargs: calls.append(kwargs) or kwargs["local_dir"]
    monkeypatch.setitem(sys.modules, "huggingface_hub", stub)
    for name, entry in env.items():
        if "value" in entry:
            monkeypatch.setenv(name, entry["value"])
    assert init["command"][:2] == ["python", "-c"]
    exec(compile(init["command"][2], "download-model", "exec"), {})
    assert calls == [{"repo_id": "meta-llama/Llama-3.2-1B-Instruct", "revision": "main",
                      "local_dir": "/models/meta-llama/Llama-3.2-1B-Instruct",
                      "allow_patterns": ["*.json", "*.safetensors", "tokenizer*"]}]
    inspect.signature(snapshot_download).bind(**calls[0])
    result = helm("template", RELEASE, str(CHART), *IMAGE, "--set", "model.download.enabled=true", check=False)
    assert result.returncode != 0 and "model.download.repoId is required" in result.stderr


def test_api_keys_come_from_a_secret() -> None:
    assert "MINILLM_API_KEY" not in env_of(server(render(*CASES["default"])))  # no keys: no auth
    docs = render(*CASES["all-features"])
    ref = env_of(server(docs))["MINILLM_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert secret_value(docs, ref) == "sk-first-key,sk-second-key"
    docs = render(*CASES["existing-api-key-secret"])
    ref = env_of(server(docs))["MINILLM_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "minillm-keys", "key": "api-keys"}
    assert [d for d in docs if d["kind"] == "Secret"] == []  # the chart does not make one


def test_service_selects_the_server_pods_only() -> None:
    docs = render(*CASES["all-features"])
    selector = only(docs, "Service")["spec"]["selector"]
    matches = lambda labels: selector.items() <= labels.items()  # noqa: E731
    assert matches(only(docs, "Deployment")["spec"]["template"]["metadata"]["labels"])
    assert only(docs, "Deployment")["spec"]["selector"]["matchLabels"] == selector
    assert only(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == selector
    assert not matches(only(docs, "Pod")["metadata"]["labels"])  # the helm test pod
    assert only(docs, "Service")["spec"]["ports"][0]["targetPort"] == "http"


def exposed_metrics() -> dict[str, str]:
    """Sample name → type of everything app/metrics.py exposes."""
    from app.metrics import Metrics
    from engine.llm_engine import EngineStats

    fields = inspect.signature(EngineStats).parameters
    metrics = Metrics("m", lambda: EngineStats(**{name: 1 for name in fields}))
    metrics.ttft.labels("m").observe(0.1)
    return {s.name: family.type for family in metrics.registry.collect() for s in family.samples}


def test_hpa_scales_on_an_exposed_gauge() -> None:
    docs = render(*CASES["all-features"])
    hpa = only(docs, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    [metric] = hpa["metrics"]
    assert metric["type"] == "Pods"
    assert exposed_metrics().get(metric["pods"]["metric"]["name"]) == "gauge"
    assert "replicas" not in only(docs, "Deployment")["spec"]  # the HPA owns the count


def test_service_monitor() -> None:
    docs = render(*CASES["all-features"])
    monitor = only(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= only(docs, "Service")["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in only(docs, "Service")["spec"]["ports"]}
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "10s"
    assert not [d for d in render(*CASES["default"]) if d["kind"] in CRD_KINDS]  # off by default: no CRDs


def test_network_policy_lets_the_test_pod_in() -> None:
    docs = render(*CASES["all-features"])
    [rule] = only(docs, "NetworkPolicy")["spec"]["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    client = rule["from"][0]["podSelector"]["matchLabels"]
    assert client.items() <= only(docs, "Pod")["metadata"]["labels"].items()


def test_dashboards_configmap() -> None:
    source = ROOT / "grafana" / "minillm.json"
    assert (CHART / "dashboards" / "minillm.json").resolve() == source.resolve()  # a symlink, not a copy
    docs = render(*CASES["all-features"])
    [configmap] = [d for d in docs if d["kind"] == "ConfigMap"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert json.loads(configmap["data"]["minillm.json"]) == json.loads(source.read_text())


def test_helm_test_pod_lists_the_models() -> None:
    docs = render(*CASES["all-features"])
    pod = only(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    [container] = pod["spec"]["containers"]
    env = env_of(container)
    service = only(docs, "Service")
    assert env["URL"]["value"] == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert env["MODEL"]["value"] == env_of(server(docs))["MINILLM_SERVED_MODEL_NAME"]["value"]
    assert env["MINILLM_API_KEY"] == env_of(server(docs))["MINILLM_API_KEY"]
    script = container["command"][-1]
    assert '"$URL/v1/models"' in script and 'grep -qF "\\"id\\":\\"$MODEL\\""' in script


@pytest.mark.parametrize("case", ["default", "all-features"])
def test_notes(case: str) -> None:
    out = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client", *CASES[case]).stdout
    notes = out[out.index("NOTES:"):]
    model = env_of(server(render(*CASES[case])))["MINILLM_SERVED_MODEL_NAME"]["value"]
    assert f"port-forward service/{FULLNAME}" in notes
    assert "curl http://localhost:8000/v1/chat/completions" in notes and f'"model": "{model}"' in notes
    assert "from openai import OpenAI" in notes and f'model="{model}"' in notes
    assert ("get secret" in notes) == (case == "all-features")
