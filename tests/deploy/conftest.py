"""Fixtures for the Helm chart's tests: Helm and the manifest checker (deploy/helm/check), built by
`scripts/services.sh build` in the background, and the collector and promtool of the pipeline tests.

These tests go last in a run: a cold Helm build takes minutes, and `scripts/services.sh build`
leaves it running in the background while the rest of the suite runs; by the time the suite gets
here it is usually done, and `scripts/services.sh await-helm` waits for it otherwise.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest

from otel_straggler.testing import services

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if HERE in Path(str(item.fspath)).resolve().parents]
    for item in mine:
        if "chart_tools" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.services)
    if mine:
        items[:] = [item for item in items if item not in mine] + mine


@dataclasses.dataclass(frozen=True)
class Tools:
    helm: Path
    checker: Path
    otelcol: Path
    promtool: Path


def _missing(message: str):
    if os.environ.get("CI"):
        pytest.fail(message)  # CI builds them first: missing there is a failure, never a skip
    pytest.skip(message)


@pytest.fixture(scope="session")
def chart_tools() -> Tools:
    built = services.cache_dir() / "bin"
    helm = Path(os.environ.get("HELM_BIN") or built / "helm")
    checker = Path(os.environ.get("K8S_CHECK_BIN") or built / "k8s-check")
    if not (os.environ.get("HELM_BIN") and os.environ.get("K8S_CHECK_BIN")):
        waited = subprocess.run(["bash", str(services.REPO / "scripts" / "services.sh"), "await-helm"],
                                capture_output=True, text=True)
        if waited.returncode != 0:
            _missing("helm and k8s-check not built, run `scripts/services.sh build-helm`:\n" + waited.stderr[-2000:])
    pipeline = services.binaries()
    tools = Tools(helm=helm, checker=checker, otelcol=pipeline.otelcol, promtool=pipeline.promtool)
    missing = [f"{name} ({path})" for name, path in dataclasses.asdict(tools).items()
               if not (Path(path).is_file() and os.access(path, os.X_OK))]
    if missing:
        _missing("not built, run `scripts/services.sh build`: missing " + ", ".join(missing))
    return tools
