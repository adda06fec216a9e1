"""Every shipped config is checked by the program that will read it."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from otel_straggler.testing import services

CONFIG_DIR = services.CONFIG_DIR
REPO = services.REPO

# Each collector config as it is meant to run: a base file and the overlays merged on top.
COLLECTOR_RUNS = {
    "gateway": ["gateway.yaml"],
    "agent": ["agent.yaml"],
    "gateway+detector-auth": ["gateway.yaml", "gateway-detector-auth.yaml"],
    "gateway+compose": ["gateway.yaml", "compose-gateway.yaml"],
}
OVERLAY_ENV = {"DETECTOR_BEARER_TOKEN": "token", "DETECTOR_CA_FILE": "ca.pem"}


def test_every_collector_config_is_covered():
    shipped = {p.name for p in CONFIG_DIR.glob("*.yaml")} - {"builder-config.yaml"}
    covered = {name for files in COLLECTOR_RUNS.values() for name in files}
    assert shipped == covered, "add new collector configs to COLLECTOR_RUNS so they are validated"


@pytest.mark.services
@pytest.mark.parametrize("run", sorted(COLLECTOR_RUNS))
def test_collector_config_validates(run, pipeline_binaries, tmp_path):
    collector = services.Collector([CONFIG_DIR / f for f in COLLECTOR_RUNS[run]], tmp_path, OVERLAY_ENV)
    result = collector.validate()
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.services
def test_collector_validate_names_a_bad_key(pipeline_binaries, tmp_path):
    broken = tmp_path / "broken.yaml"
    config = yaml.safe_load((CONFIG_DIR / "gateway.yaml").read_text())
    config["exporters"]["load_balancing/detector"]["routing_atributes"] = ["training.cohort"]
    broken.write_text(yaml.safe_dump(config))
    result = services.Collector([broken], tmp_path).validate()
    assert result.returncode != 0
    assert "routing_atributes" in result.stdout + result.stderr


@pytest.mark.services
def test_collector_has_exactly_the_manifest_components(pipeline_binaries):
    result = subprocess.run([str(pipeline_binaries.otelcol), "components"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    listed = yaml.safe_load(result.stdout)
    manifest = yaml.safe_load((CONFIG_DIR / "builder-config.yaml").read_text())
    for kind in ("receivers", "processors", "exporters", "extensions"):
        built = {entry["module"] for entry in listed[kind]}
        wanted = {entry["gomod"] for entry in manifest[kind]}
        assert built == wanted, kind
    versions = {entry["gomod"].split()[1] for kind in ("receivers", "processors", "exporters", "extensions")
                for entry in manifest[kind]}
    assert versions == {manifest["dist"]["version"] if manifest["dist"]["version"].startswith("v")
                        else "v" + manifest["dist"]["version"]}, "one collector release for every component"


@pytest.mark.services
def test_jaeger_config_validates(pipeline_binaries):
    result = subprocess.run([str(pipeline_binaries.jaeger), "validate", f"--config={CONFIG_DIR / 'jaeger' / 'jaeger.yaml'}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.services
def test_prometheus_config_and_rules(pipeline_binaries):
    prometheus_dir = CONFIG_DIR / "prometheus"
    for argv in (["check", "config", "prometheus.yml"], ["check", "rules", "rules.yml"],
                 ["test", "rules", "rules_test.yml"]):
        result = subprocess.run([str(pipeline_binaries.promtool)] + argv, cwd=prometheus_dir,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"promtool {' '.join(argv)}\n{result.stdout}{result.stderr}"


def test_every_alert_has_a_unit_test():
    rules = yaml.safe_load((CONFIG_DIR / "prometheus" / "rules.yml").read_text())
    tests = yaml.safe_load((CONFIG_DIR / "prometheus" / "rules_test.yml").read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule}
    tested = {case["alertname"] for test in tests["tests"] for case in test.get("alert_rule_test", [])}
    assert alerts == tested
    assert {"TrainingStragglerDetected", "TrainingRankSilent", "StragglerDetectorDown"} <= alerts



def test_every_alert_says_what_to_look_at_first():
    """Each page carries a next_step annotation (what to look at first); a node whose ranks are
    slow together has its own alert."""
    rules = yaml.safe_load((CONFIG_DIR / "prometheus" / "rules.yml").read_text())
    alerts = [rule for group in rules["groups"] for rule in group["rules"] if "alert" in rule]
    missing = [rule["alert"] for rule in alerts if not str(rule.get("annotations", {}).get("next_step", "")).strip()]
    assert not missing, f"alerts without a next_step annotation: {missing}"
    assert "TrainingNodeDegraded" in {rule["alert"] for rule in alerts}

def _generator():
    spec = importlib.util.spec_from_file_location("generate_dashboards", CONFIG_DIR / "grafana" / "generate_dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dashboards_are_generated(tmp_path):
    generator = _generator()
    assert generator.main(["--out", str(tmp_path)]) == 0
    committed = sorted(p.name for p in (CONFIG_DIR / "grafana" / "dashboards").glob("*.json"))
    assert committed == sorted(p.name for p in tmp_path.glob("*.json"))
    for name in committed:
        assert (tmp_path / name).read_text() == (CONFIG_DIR / "grafana" / "dashboards" / name).read_text(), (
            f"{name} is stale: run python collector-config/grafana/generate_dashboards.py")


def test_jaeger_links_name_the_dashboards_job_and_a_rank_each_linked_series_keeps():
    """A link to a rank's traces needs the job and the rank: the job is the dashboard's (a single
    choice); the rank a label of the clicked series, so no linked panel may group it away, or in a
    table whose labels became columns (which takes them off the value), its `rank` column."""
    import re

    for path in (CONFIG_DIR / "grafana" / "dashboards").glob("*.json"):
        dashboard = json.loads(path.read_text())
        job_variable = next(variable for variable in dashboard["templating"]["list"] if variable["name"] == "job_id")
        assert not job_variable["multi"] and not job_variable["includeAll"]
        linked = 0
        for panel in dashboard["panels"]:
            links = [link for link in panel.get("fieldConfig", {}).get("defaults", {}).get("links", [])
                     if "/search?" in link["url"]]
            if not links:
                continue
            linked += 1
            transformations = {t["id"]: t.get("options", {}) for t in panel.get("transformations", [])}
            assert "groupingToMatrix" not in transformations, panel["title"]
            if "labelsToFields" in transformations:
                renamed = transformations.get("organize", {}).get("renameByName", {})
                expected_rank = "${__data.fields.rank}"
                assert renamed.get("training_rank") == "rank", panel["title"]
            else:
                expected_rank = "${__field.labels.training_rank}"
            for link in links:
                assert "${job_id" in link["url"] and "training.job.id" in link["url"]
                assert expected_rank in link["url"], panel["title"]
            for target in panel["targets"]:
                for grouping in re.findall(r"\bby \(([^)]*)\)", target["expr"]):
                    assert "training_rank" in grouping, (panel["title"], target["expr"])
        assert linked >= 4


def test_dashboards_use_the_provisioned_data_sources():
    provisioned = yaml.safe_load((CONFIG_DIR / "grafana" / "provisioning" / "datasources" / "datasources.yml").read_text())
    uids = {source["uid"] for source in provisioned["datasources"]}
    assert {"prometheus", "jaeger"} <= uids
    for path in (CONFIG_DIR / "grafana" / "dashboards").glob("*.json"):
        dashboard = json.loads(path.read_text())
        titles = [panel["title"] for panel in dashboard["panels"]]
        assert len(titles) == len(set(titles)), "panel titles are unique"
        for panel in dashboard["panels"]:
            assert panel["datasource"]["uid"] in uids
            assert all(target["datasource"]["uid"] in uids for target in panel["targets"])
    titles = " ".join(title.lower() for title, _ in _generator().panel_queries())
    for wanted in ("active", "hangs", "rank × stage", "verdict timeline", "detector"):
        assert wanted in titles


def _compose_config() -> dict:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose not installed (scripts/services.sh build installs it)")
    result = subprocess.run(["docker-compose", "-f", str(REPO / "docker-compose.yml"), "config"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_docker_compose_file_is_valid():
    config = _compose_config()
    assert {"collector", "jaeger", "prometheus", "grafana", "detector", "trainer"} <= set(config["services"])
    assert config["services"]["collector"]["image"].startswith("otel/opentelemetry-collector-contrib:")
    manifest = yaml.safe_load((CONFIG_DIR / "builder-config.yaml").read_text())
    assert config["services"]["collector"]["image"].endswith(":" + manifest["dist"]["version"].lstrip("v")), (
        "the contrib image runs the same release as our distribution")
    trainer_env = config["services"]["trainer"]["environment"]
    assert trainer_env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4317"


def test_docker_compose_mounts_only_configs_the_tests_run():
    """Every file the stack mounts is one these tests run for real (collector configs with the
    collector, jaeger.yaml with Jaeger, prometheus/ with Prometheus and promtool, grafana/ checked
    above). A new mount must be added here together with a test that runs it."""
    config = _compose_config()
    tested = {
        CONFIG_DIR,                                   # COLLECTOR_RUNS, run in test_gateway_* too
        CONFIG_DIR / "jaeger" / "jaeger.yaml",        # test_jaeger_config_validates, Stack
        CONFIG_DIR / "prometheus",                    # promtool and the Prometheus of Stack
        CONFIG_DIR / "grafana" / "provisioning",      # test_dashboards_use_the_provisioned_data_sources
        CONFIG_DIR / "grafana" / "dashboards",        # test_dashboards_are_generated, panel queries
    }
    mounted = set()
    for name, service in config["services"].items():
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            if source.startswith("/") or source.startswith("."):
                mounted.add(Path(source).resolve())
    assert mounted == {p.resolve() for p in tested}
    assert {"gateway.yaml", "compose-gateway.yaml"} <= {
        Path(arg.split("=", 1)[1]).name for arg in config["services"]["collector"]["command"]}


@pytest.mark.parametrize("service", ["detector", "trainer"])
def test_docker_compose_commands_use_existing_flags(service):
    command = _compose_config()["services"][service]["command"]
    subcommand, flags = command[0], [arg.split("=", 1)[0] for arg in command[1:] if arg.startswith("--")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "otel_straggler", subcommand, "--help"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    missing = [flag for flag in flags if flag not in result.stdout]
    assert not missing, f"`otel-straggler {subcommand}` has no {missing}"
