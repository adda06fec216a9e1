"""On Kubernetes (CONTRACT v1.2 §5) a verdict's host is the node the rank's pod runs on (the one to
cordon), with the pod and namespace beside it, and the rank's metrics carry k8s_node_name; ranks
that send no k8s.* attributes keep host.name and null pod and namespace."""
from __future__ import annotations

from otel_straggler import contract
from otel_straggler.detector.engine import Engine
from otel_straggler.detector.observation import Placement
from otel_straggler.detector.telemetry import _rank_attributes

from otel_straggler.testing.scripted_job import CONFIG, ScriptedJob, hangs


def on_kubernetes(job: ScriptedJob) -> ScriptedJob:
    """Re-places every rank as a pod: host.name is the pod's name, k8s.node.name the node."""
    job.engine.ingest_placements([Placement(job.job_id, 0, 0, rank, f"node-{rank // 2}", rank % 2, job.cohort, None,
                                            f"train-worker-{rank}", "ml", f"node-{rank // 2}")
                                  for rank in range(job.ranks)])
    return job


def test_a_straggler_verdict_names_the_node_pod_and_namespace_and_its_metrics_the_node():
    job = on_kubernetes(ScriptedJob(Engine(CONFIG), ranks=4))
    job.run(6)
    job.slow[3] = 1.4
    alert = next(v for v in job.run(8) if v.verdict == contract.VERDICT_STRAGGLER)
    record = alert.to_dict()
    assert (record["rank"], record["host"], record["pod"], record["namespace"]) == (3, "node-1", "train-worker-3", "ml")
    assert tuple(record) == contract.VERDICT_FIELDS  # k8s_node_name is a label, not a verdict field
    state = next(s for s in job.engine.rank_state() if s.rank == 3 and s.alert_active)
    assert _rank_attributes(state)[contract.K8S_NODE_NAME] == "node-1"


def test_a_hang_culprit_names_its_node_pod_and_namespace():
    job = on_kubernetes(ScriptedJob(Engine(CONFIG), ranks=4))
    verdicts = job.run(30)
    job.frozen = {2}
    verdicts += job.run(75, progress=False)
    culprit = hangs(verdicts)[0]
    assert (culprit.rank, culprit.host, culprit.pod, culprit.namespace) == (2, "node-1", "train-worker-2", "ml")


def test_ranks_without_kubernetes_attributes_keep_host_name_and_null_pod():
    job = ScriptedJob(Engine(CONFIG), ranks=4)
    job.run(6)
    job.slow[3] = 1.4
    alert = next(v for v in job.run(8) if v.verdict == contract.VERDICT_STRAGGLER)
    assert (alert.host, alert.pod, alert.namespace) == ("node-1", None, None)
    state = next(s for s in job.engine.rank_state() if s.rank == 3 and s.alert_active)
    assert contract.K8S_NODE_NAME not in _rank_attributes(state)
