"""The Helm chart (deploy/helm/otel-straggler) and the example manifests (deploy/kubernetes), each
checked by the program that will read it:

- `helm lint` and `helm template`, with the default values and with everything on;
- every rendered object, and every example manifest, decoded strictly into its Kubernetes API type
  by the checker (deploy/helm/check: unknown, misspelt or mistyped fields fail);
- the rendered PrometheusRule's rules through `promtool check rules`;
- the rendered gateway and agent configs through the collector's own `validate`, with the
  environment their pods give them;
- the chart's copies of the shipped files equal the shipped files.

Each check is also shown to fail, on a copy broken in one field.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from otel_straggler.testing import services

REPO = services.REPO
CHART = REPO / "deploy" / "helm" / "otel-straggler"
EXAMPLES = REPO / "deploy" / "kubernetes"
NAMESPACE = "otel-straggler"

# The chart's copies of shipped files (Helm reads only inside the chart) and their originals.
CHART_COPIES = {
    "gateway.yaml": REPO / "collector-config" / "gateway.yaml",
    "gateway-detector-auth.yaml": REPO / "collector-config" / "gateway-detector-auth.yaml",
    "agent.yaml": REPO / "collector-config" / "agent.yaml",
    "rules.yml": REPO / "collector-config" / "prometheus" / "rules.yml",
    "job-overview.json": REPO / "collector-config" / "grafana" / "dashboards" / "job-overview.json",
}

EVERYTHING_ON = [
    "detector.shards=3",
    "agent.enabled=true",
    "detector.tls.enabled=true",
    "detector.tls.existingSecret=detector-tls",
    "detector.auth.enabled=true",
    "detector.auth.existingSecret=detector-token",
    "gateway.jaegerEndpoint=jaeger-collector.tracing:4317",
    "monitoring.serviceMonitor.enabled=true",
    "monitoring.prometheusRule.enabled=true",
    "monitoring.grafanaDashboards.enabled=true",
]
VALUE_SETS = {
    "defaults": [],
    "everything": EVERYTHING_ON,
    # TLS without the token: the chart derives a TLS-only overlay from the auth overlay
    "tls-only": ["detector.tls.enabled=true", "detector.tls.existingSecret=detector-tls",
                 "detector.persistence.enabled=false"],
}

def _run(argv, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=120, **kwargs)


def render(tools, values: list[str]) -> str:
    argv = [tools.helm, "template", "straggler", CHART, "--namespace", NAMESPACE]
    for value in values:
        argv += ["--set", value]
    result = _run(argv)
    assert result.returncode == 0, result.stderr
    return result.stdout


def objects(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def find(objs: list[dict], kind: str, suffix: str = "") -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"{kind} *{suffix}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def check(tools, tmp_path: Path, text: str, name: str = "objects.yaml") -> subprocess.CompletedProcess:
    path = tmp_path / name
    path.write_text(text)
    return _run([tools.checker, path])


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request, chart_tools):
    return request.param, render(chart_tools, VALUE_SETS[request.param])


# ---------------------------------------------------------------- the chart's files


def test_chart_copies_are_the_shipped_files():
    for name, original in CHART_COPIES.items():
        copy_path = CHART / "files" / name
        assert copy_path.read_bytes() == original.read_bytes(), (
            f"{copy_path.relative_to(REPO)} differs from {original.relative_to(REPO)}: "
            f"cp {original.relative_to(REPO)} {copy_path.relative_to(REPO)}")


def test_every_value_is_documented():
    """Each value in values.yaml has a comment right above it, or sits in a block whose key has one
    (resources: its requests and limits); a heading of a block of documented values needs none."""
    undocumented = []
    parents: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    previous = ""
    for line in (CHART / "values.yaml").read_text().splitlines():
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):\s*(.*)$", line)
        if match:
            indent, key, rest = len(match.group(1)), match.group(2), match.group(3)
            while parents and parents[-1][0] >= indent:
                parents.pop()
            documented = previous.startswith("#") or any(doc for _, doc in parents)
            if rest and not rest.startswith("#") and not documented:
                undocumented.append(key)
            parents.append((indent, documented))
        if line.strip():
            previous = line.strip()
    assert not undocumented, f"values.yaml values without a comment: {undocumented}"


# ---------------------------------------------------------------- helm lint and template


@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_helm_lint(chart_tools, values):
    argv = [chart_tools.helm, "lint", "--strict", CHART, "--namespace", NAMESPACE]
    for value in VALUE_SETS[values]:
        argv += ["--set", value]
    result = _run(argv)
    assert result.returncode == 0, result.stdout + result.stderr


def test_helm_lint_fails_on_a_broken_template(chart_tools, tmp_path):
    broken = tmp_path / "otel-straggler"
    subprocess.run(["cp", "-r", str(CHART), str(broken)], check=True)
    path = broken / "templates" / "gateway-service.yaml"
    path.write_text(path.read_text().replace("{{ .Values.gateway.service.type }}", "{{ .Values.gateway.service.type"))
    result = _run([chart_tools.helm, "lint", "--strict", broken])
    assert result.returncode != 0
    assert "gateway-service.yaml" in result.stdout + result.stderr


def test_defaults_render_what_the_docs_say(chart_tools):
    objs = objects(render(chart_tools, []))
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    assert kinds == [
        ("ConfigMap", "straggler-otel-straggler-gateway"),
        ("Deployment", "straggler-otel-straggler-gateway"),
        ("NetworkPolicy", "straggler-otel-straggler-detector"),
        ("Role", "straggler-otel-straggler-gateway"),
        ("RoleBinding", "straggler-otel-straggler-gateway"),
        ("Service", "straggler-otel-straggler-detector"),
        ("Service", "straggler-otel-straggler-gateway"),
        ("ServiceAccount", "straggler-otel-straggler-gateway"),
        ("StatefulSet", "straggler-otel-straggler-detector"),
    ]
    shards = find(objs, "StatefulSet")
    assert shards["spec"]["replicas"] == 2
    assert shards["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "evidence"
    pod = shards["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = pod["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics", "scheme": "HTTP"}
    assert container["livenessProbe"]["httpGet"]["path"] == "/metrics"
    assert "--prometheus-port=9464" in container["args"]
    assert container["resources"]["requests"]


def test_everything_on(chart_tools):
    objs = objects(render(chart_tools, EVERYTHING_ON))
    assert find(objs, "StatefulSet")["spec"]["replicas"] == 3
    find(objs, "DaemonSet", "-agent")
    find(objs, "ServiceMonitor")
    find(objs, "PrometheusRule")
    dashboards = find(objs, "ConfigMap", "-dashboards")
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    shard = find(objs, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    assert "--auth-token-file=/etc/otel-straggler/auth/token" in shard["args"]
    assert "--tls-cert-file=/etc/otel-straggler/tls/tls.crt" in shard["args"]
    assert "exec" in shard["readinessProbe"]  # the token, which an httpGet probe cannot send
    gateway = find(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert gateway["args"] == ["--config=/etc/otelcol/gateway.yaml", "--config=/etc/otelcol/detector-tls.yaml"]
    token = next(e for e in gateway["env"] if e["name"] == "DETECTOR_BEARER_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "detector-token", "key": "token"}


@pytest.mark.parametrize("values, message", [
    (["detector.auth.enabled=true", "detector.auth.token=x"], "needs detector.tls.enabled"),
    (["detector.tls.enabled=true"], "needs detector.tls.existingSecret"),
])
def test_settings_that_cannot_work_fail_the_render(chart_tools, values, message):
    argv = [chart_tools.helm, "template", "straggler", CHART]
    for value in values:
        argv += ["--set", value]
    result = _run(argv)
    assert result.returncode != 0 and message in result.stderr


# ---------------------------------------------------------------- the checker


def test_rendered_objects_pass_the_checker(chart_tools, rendered, tmp_path):
    name, text = rendered
    result = check(chart_tools, tmp_path, text)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(objects(text))} objects, 0 failed" in result.stdout


@pytest.mark.parametrize("breakage, complaint", [
    # an unknown field
    (lambda o: o["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPrt=4317), "containerPrt"),
    # a field of the wrong case (the API is case-sensitive, Go's encoding/json is not)
    (lambda o: o["spec"]["template"]["spec"]["containers"][0].update(ImagePullPolicy="Always"), "ImagePullPolicy"),
    # a mistyped value
    (lambda o: o["spec"].update(replicas="three"), "replicas"),
    # a selector that misses the pod template
    (lambda o: o["spec"]["selector"]["matchLabels"].update({"app.kubernetes.io/component": "other"}), "selector"),
    # a $(VAR) that the kubelet would leave literal
    (lambda o: o["spec"]["template"]["spec"]["containers"][0]["env"].insert(
        0, {"name": "X", "value": "$(OTEL_TRACES_EXPORTER)"}), "$(OTEL_TRACES_EXPORTER)"),
])
def test_checker_fails_on_a_broken_field(chart_tools, tmp_path, breakage, complaint):
    objs = objects(render(chart_tools, []))
    shards = find(objs, "StatefulSet")
    broken = copy.deepcopy(shards)
    breakage(broken)
    result = check(chart_tools, tmp_path, yaml.safe_dump_all([broken]))
    assert result.returncode == 1, result.stdout
    assert complaint in result.stdout, result.stdout


def test_checker_fails_on_unknown_kinds_and_malformed_custom_resources(chart_tools, tmp_path):
    objs = objects(render(chart_tools, EVERYTHING_ON))
    rule = copy.deepcopy(find(objs, "PrometheusRule"))
    rule["specs"] = rule.pop("spec")
    nameless = copy.deepcopy(find(objs, "ServiceMonitor"))
    del nameless["metadata"]["name"]
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    result = check(chart_tools, tmp_path, yaml.safe_dump_all([rule, nameless, unknown]))
    assert result.returncode == 1
    assert 'unknown top-level field "specs"' in result.stdout
    assert "metadata.name is required" in result.stdout
    assert "unknown kind example.com/v1, Kind=Widget" in result.stdout
    assert "3 objects, 3 failed" in result.stdout


def test_example_manifests_pass_the_checker(chart_tools):
    paths = sorted(EXAMPLES.glob("*.yaml"))
    assert {p.name for p in paths} >= {"trainjob.yaml", "indexed-job.yaml", "instrumentation.yaml"}
    result = _run([chart_tools.checker, *paths])
    assert result.returncode == 0, result.stdout + result.stderr


def test_checker_fails_on_a_broken_example(chart_tools, tmp_path):
    objs = objects((EXAMPLES / "indexed-job.yaml").read_text())
    job = find(objs, "Job")
    env = job["spec"]["template"]["spec"]["containers"][0]["env"]
    # the node name defined after its use: the kubelet would send "k8s.node.name=$(NODE_NAME)"
    env.append(env.pop(next(i for i, e in enumerate(env) if e["name"] == "NODE_NAME")))
    env[0]["valueFrom"]["fieldRef"]["fieldpath"] = env[0]["valueFrom"]["fieldRef"].pop("fieldPath")
    result = check(chart_tools, tmp_path, yaml.safe_dump_all(objs))
    assert result.returncode == 1
    assert "$(NODE_NAME)" in result.stdout
    assert "fieldpath" in result.stdout


def test_checker_fails_on_broken_env_in_custom_resources(chart_tools, tmp_path):
    """A TrainJob's and an Instrumentation's env lists are Kubernetes EnvVars: decoded strictly too."""
    trainjob = find(objects((EXAMPLES / "trainjob.yaml").read_text()), "TrainJob")
    field_ref = trainjob["spec"]["trainer"]["env"][0]["valueFrom"]["fieldRef"]
    field_ref["fieldpath"] = field_ref.pop("fieldPath")
    instrumentation = find(objects((EXAMPLES / "instrumentation.yaml").read_text()), "Instrumentation")
    del instrumentation["spec"]["python"]["env"][0]  # HOST_IP, which the endpoint expands
    result = check(chart_tools, tmp_path, yaml.safe_dump_all([trainjob, instrumentation]))
    assert result.returncode == 1
    assert 'spec.trainer.env: unknown field "[0].valueFrom.fieldRef.fieldpath"' in result.stdout
    assert "$(HOST_IP)" in result.stdout
    assert "2 objects, 2 failed" in result.stdout


def test_examples_set_the_downward_api_attributes():
    for path in ["trainjob.yaml", "indexed-job.yaml"]:
        text = (EXAMPLES / path).read_text()
        for field in ["spec.nodeName", "metadata.name", "metadata.namespace", "status.hostIP"]:
            assert f"fieldPath: {field}" in text, (path, field)
        assert ("k8s.node.name=$(NODE_NAME),k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)"
                in text), path
        assert "OTEL_STRAGGLER_ENABLED" in text


# ---------------------------------------------------------------- promtool


def _rule_groups(chart_tools) -> dict:
    rule = find(objects(render(chart_tools, ["monitoring.prometheusRule.enabled=true"])), "PrometheusRule")
    return rule["spec"]


def test_prometheus_rule_passes_promtool(chart_tools, tmp_path):
    spec = _rule_groups(chart_tools)
    assert spec == yaml.safe_load(CHART_COPIES["rules.yml"].read_text())
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(spec))
    result = _run([chart_tools.promtool, "check", "rules", path])
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_fails_on_a_broken_rule(chart_tools, tmp_path):
    spec = _rule_groups(chart_tools)
    spec["groups"][0]["rules"][0]["expr"] = "max by (training_job_id (straggler_alert_active)"
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(spec))
    result = _run([chart_tools.promtool, "check", "rules", path])
    assert result.returncode != 0


# ---------------------------------------------------------------- the collector's validate


def container_env(container: dict) -> dict[str, str]:
    """The container's environment as the kubelet would give it: downward API and Secret values
    replaced by stand-ins, $(VAR) expanded from the variables above."""
    stand_ins = {"status.podIP": "127.0.0.1"}
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\(([^)]+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"])
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = stand_ins.get(var["valueFrom"]["fieldRef"]["fieldPath"], "x")
        else:
            env[var["name"]] = "secret-stand-in"
    return env


def collector_runs(objs: list[dict], tmp_path: Path):
    """(name, argv of the collector, env) of each collector the chart runs, with its ConfigMap's
    files written where --config points."""
    runs = []
    for kind, suffix in [("Deployment", "-gateway"), ("DaemonSet", "-agent")]:
        workloads = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
        if not workloads:
            continue
        container = workloads[0]["spec"]["template"]["spec"]["containers"][0]
        config = find(objs, "ConfigMap", suffix)
        folder = tmp_path / suffix.strip("-")
        folder.mkdir()
        for name, text in config["data"].items():
            (folder / name).write_text(text)
        argv = [arg.replace("/etc/otelcol/", f"{folder}/") for arg in container["args"]]
        runs.append((suffix.strip("-"), argv, container_env(container)))
    return runs


def validate(tools, argv, env) -> subprocess.CompletedProcess:
    return _run([tools.otelcol, "validate", *argv], env={**os.environ, **env})


def test_rendered_collector_configs_validate(chart_tools, rendered, tmp_path):
    name, text = rendered
    runs = collector_runs(objects(text), tmp_path)
    assert [run[0] for run in runs] == (["gateway", "agent"] if name == "everything" else ["gateway"])
    for collector, argv, env in runs:
        result = validate(chart_tools, argv, env)
        assert result.returncode == 0, f"{collector}: {result.stdout}{result.stderr}"


def test_collector_validate_fails_on_a_broken_rendered_config(chart_tools, tmp_path):
    objs = objects(render(chart_tools, []))
    config = find(objs, "ConfigMap", "-gateway")
    gateway = yaml.safe_load(config["data"]["gateway.yaml"])
    gateway["exporters"]["load_balancing/detector"]["resolver"]["k8s"]["return_hostname"] = True
    config["data"]["gateway.yaml"] = yaml.safe_dump(gateway)
    (_, argv, env), = collector_runs(objs, tmp_path)
    result = validate(chart_tools, argv, env)
    assert result.returncode != 0
    assert "return_hostname" in result.stdout + result.stderr


@pytest.mark.parametrize("jaeger", [False, True])
def test_gateway_config_is_gateway_yaml_with_the_k8s_resolver(chart_tools, jaeger):
    """The rendered gateway config is collector-config/gateway.yaml with the resolver replaced (and,
    without a Jaeger endpoint, the Jaeger pipeline left out): nothing else drifts."""
    values = ["gateway.jaegerEndpoint=jaeger:4317"] if jaeger else []
    config = find(objects(render(chart_tools, values)), "ConfigMap", "-gateway")
    rendered = yaml.safe_load(config["data"]["gateway.yaml"])
    expected = yaml.safe_load(CHART_COPIES["gateway.yaml"].read_text())
    expected["exporters"]["load_balancing/detector"]["resolver"] = {"k8s": {
        "service": f"straggler-otel-straggler-detector.{NAMESPACE}", "ports": [4317], "return_hostnames": True}}
    if not jaeger:
        del expected["exporters"]["otlp_grpc/jaeger"]
        del expected["processors"]["probabilistic_sampler"]
        del expected["service"]["pipelines"]["traces/jaeger"]
    assert rendered == expected
