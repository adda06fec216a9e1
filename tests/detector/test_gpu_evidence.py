"""GPU evidence on verdicts (CONTRACT v1.1 §3a `gpu`): what heartbeats' GPU samples (§2c) add to a
straggler's, a recovery's and a hang culprit's verdict, which samples speak for a window, and the
bounds; and the node roll-up that status.json, the live view and the report share."""
from __future__ import annotations

from otel_straggler import contract
from otel_straggler.detector.engine import Engine
from otel_straggler.detector.gpu_evidence import GpuEvidence, describe
from otel_straggler.detector.next_step import next_step, suspect
from otel_straggler.detector.nodes import NodeRollup, roll_up
from otel_straggler.detector.observation import GpuSample, Heartbeat

from otel_straggler.testing.scripted_job import CONFIG, SECOND, ScriptedJob, hangs, stuck_rank_one

COOL = GpuSample(0, "GPU-cool", 1980, 1980, 0x0, 61, 350.0, 0.98, 0, 5)


def hot(now: int) -> GpuSample:
    """A GPU at its thermal limit, its clock pulled down, logging nothing."""
    return GpuSample(1, "GPU-hot", 1410, 1980, 0x40 | 0x1, 87 + (now // SECOND) % 3, 300.0, 0.99, 0, 5)


def throttled_job(heartbeat_s: int = 1) -> ScriptedJob:
    """Rank 1's GPU reads hot while `job.hot` is set."""
    job = ScriptedJob(Engine(CONFIG), ranks=4)
    job.heartbeat_s = heartbeat_s
    job.hot = False
    job.gpu = lambda rank, now: hot(now) if rank == 1 and job.hot else COOL._replace(index=rank)
    return job


def test_a_throttled_gpus_straggler_verdict_carries_its_clock_reasons_and_heat():
    job = throttled_job()
    job.run(6)
    job.slow[1], job.hot = 1.4, True
    verdicts = job.run(8)
    alert = next(v for v in verdicts if v.verdict == contract.VERDICT_STRAGGLER)
    assert alert.rank == 1 and alert.host == "node-0"
    gpu = alert.gpu
    assert (gpu["sm_clock_mhz"], gpu["peer_sm_clock_mhz"], gpu["sm_clock_max_mhz"]) == (1410, 1980, 1980)
    assert gpu["clock_event_reasons"] == ["gpu_idle", "hw_thermal"]
    assert 87 <= gpu["temperature_c"] <= 89 and gpu["power_w"] == 300.0
    assert (gpu["ecc_uncorrected_delta"], gpu["pcie_replay_delta"], gpu["uuid"]) == (0, 0, "GPU-hot")
    assert gpu["samples"] >= 1
    assert describe(gpu).startswith("SM clock 1410 MHz vs 1980 at its peers; hw_thermal throttling; ")
    assert suspect(alert.to_dict()) == "gpu_throttled"
    assert "runs at reduced clocks: check cooling" in next_step(alert.to_dict())
    job.slow[1], job.hot = 1.0, False
    recovered = [v for v in job.run(8) if v.verdict == contract.VERDICT_RECOVERED and v.rank == 1]
    assert recovered and recovered[0].gpu["sm_clock_mhz"] == 1980  # the window it recovered in: cool again


def test_ranks_that_send_no_gpu_samples_get_null_gpu_evidence():
    job = ScriptedJob(Engine(CONFIG), ranks=4)
    job.run(6)
    job.slow[1] = 1.4
    alert = next(v for v in job.run(8) if v.verdict == contract.VERDICT_STRAGGLER)
    assert alert.gpu is None
    assert suspect(alert.to_dict()) == "unknown"  # host timing of a CPU job, no GPU: nothing points anywhere


def test_windows_shorter_than_the_heartbeat_read_the_samples_of_the_evidence_or_the_latest_before():
    job = throttled_job(heartbeat_s=5)  # a window a second, a sample every 5 s
    job.run(5)
    job.hot = True  # the GPU heats up, then its steps slow down
    job.run(1)
    job.slow[1] = 1.4
    alert = next(v for v in job.run(12) if v.verdict == contract.VERDICT_STRAGGLER)
    assert alert.gpu["sm_clock_mhz"] == 1410 and alert.gpu["peer_sm_clock_mhz"] == 1980


def test_a_hang_culprits_verdict_carries_its_latest_gpu_samples():
    job = throttled_job()
    job.run(5)
    job.slow[1], job.hot = 1.01, True  # not slow enough to alert; its GPU reads hot from here on
    job.run(2)
    stuck = hangs(job.run(70, progress=False, open_stages=stuck_rank_one(job.now)))
    culprit = next(v for v in stuck if v.rank == 1)
    # its latest samples, against those of the ranks that wait for it
    assert culprit.gpu["uuid"] == "GPU-hot" and culprit.gpu["peer_sm_clock_mhz"] == 1980
    assert "py-spy dump" in next_step(culprit.to_dict())


def beat(rank: int, step: int, at: int, gpu: GpuSample) -> Heartbeat:
    return Heartbeat("job", 0, "c", rank, 0, step, at, (), (), gpu)


def test_counters_grow_over_the_window_and_a_reset_counts_what_came_after():
    evidence = GpuEvidence(window_steps=10, persist_windows=3, max_ranks=8)
    counts = [(5, 100), (5, 100), (7, 130), (9, 180), (1, 10)]  # (ECC, replays); the last after a driver reload
    evidence.note([beat(0, step, step * SECOND, COOL._replace(ecc_uncorrected=ecc, pcie_replay=replays))
                   for step, (ecc, replays) in zip((8, 10, 12, 15, 18), counts)])
    gpu = evidence.evidence("job", 0, 0, window=1)
    assert (gpu["ecc_uncorrected_delta"], gpu["pcie_replay_delta"], gpu["samples"]) == (5, 90, 4)
    assert suspect({"gpu": gpu, "stage": "forward-compute"}) == "gpu_errors"
    assert describe(gpu).startswith("SM clock 1980 MHz of 1980 max; 5 new uncorrected ECC errors; 90 PCIe replays")


def test_samples_and_ranks_kept_are_bounded_and_forgetting_is_counted():
    evidence = GpuEvidence(window_steps=10, persist_windows=3, max_ranks=2)
    evidence.note([beat(rank, 0, 1, COOL) for rank in range(5)])
    assert evidence.rank_count() == 2 and evidence.ranks_forgotten == 3
    evidence.note([beat(4, step, step, COOL) for step in range(1000)])
    assert evidence.evidence("job", 0, 4, window=None)["samples"] == 3  # the latest, of at most SAMPLES_PER_RANK kept
    assert evidence.evidence("job", 0, 0, window=None) is None


def test_the_peers_clock_is_the_median_of_their_medians():
    evidence = GpuEvidence(window_steps=10, persist_windows=3, max_ranks=100)
    clocks = {1: 1980, 2: 1965, 3: 1950, 4: 600}  # one odd peer does not move the reference
    evidence.note([beat(rank, 5, 1, COOL._replace(sm_clock_mhz=clock)) for rank, clock in clocks.items()])
    evidence.note([beat(0, 5, 1, COOL._replace(sm_clock_mhz=1400))])
    assert evidence.evidence("job", 0, 0, window=0, peers=(0, 1, 2, 3, 4))["peer_sm_clock_mhz"] == 1958


def test_the_suspect_follows_the_most_conclusive_evidence_first():
    base = {"stage": "forward-compute", "attribution": contract.ATTRIBUTION_GPU}
    assert suspect(base) == "gpu"
    assert suspect({**base, "attribution": contract.ATTRIBUTION_HOST}) == "host"
    assert suspect({**base, "attribution": contract.ATTRIBUTION_WAITING}) == "peer_wait"
    assert suspect({**base, "gpu": {"sm_clock_mhz": 1700, "peer_sm_clock_mhz": 1980}}) == "gpu_throttled"
    assert suspect({**base, "gpu": {"sm_clock_mhz": 1900, "peer_sm_clock_mhz": 1980,
                                    "clock_event_reasons": ["gpu_idle"]}}) == "gpu"
    assert suspect({**base, "stage": "batch-generator", "gpu": {"clock_event_reasons": ["hw_thermal"]}}) == \
        "input_pipeline"
    assert "storage or input pipeline" in next_step({**base, "stage": "batch-generator", "verdict": "straggler"})
    assert suspect({**base, "stage": "batch-generator", "gpu": {"pcie_replay_delta": 4}}) == "gpu_errors"
    assert "power: power caps" in next_step({**base, "verdict": "straggler",
                                             "gpu": {"clock_event_reasons": ["sw_power_cap"]}})


def test_a_node_is_the_suspect_when_at_least_half_of_its_ranks_and_two_are_slow():
    ranks = {"node-a": 8, "node-b": 8, "node-c": 1, "node-d": 2}
    slow = [("job", "node-a", 3), ("job", "node-a", 3), *[("job", "node-b", r) for r in range(8, 12)],
            ("job", "node-c", 20), ("job", "node-d", 21), ("job", "node-d", 22), ("job", None, 30)]
    nodes = {node.host: node for node in roll_up(slow, lambda job, host: ranks[host])}
    assert set(nodes) == {"node-a", "node-b", "node-c", "node-d"}  # no host: not a node
    assert [nodes[h].degraded for h in ("node-a", "node-b", "node-c", "node-d")] == [False, True, False, True]
    assert nodes["node-a"].line() == "node-a: 1 of 8 ranks slow (3)"
    assert nodes["node-b"].line().startswith("node-b: 4 of 8 ranks slow (8, 9, 10, 11): suspect the node, not a GPU: "
                                             "cordon or drain node-b so the restart lands elsewhere (`kubectl cordon node-b`")
    assert NodeRollup("job", "node-x", (1, 2), None).degraded is False  # ranks unknown: not claimed


def test_slow_ranks_of_a_job_without_an_id_roll_up_beside_named_jobs():
    """An evidence line without job_id (the report keeps it) is its own job; sorting it beside a
    named job's host of as many slow ranks raised TypeError (None < str) and broke the report."""
    slow = [(None, "node-a", 1), (None, "node-a", 2), ("job", "node-b", 3), ("job", "node-b", 4)]
    nodes = roll_up(slow, lambda job, host: 8)
    assert [(node.job_id, node.host, node.slow_ranks) for node in nodes] == [
        (None, "node-a", (1, 2)), ("job", "node-b", (3, 4))]


def test_status_rolls_up_the_alerted_ranks_of_each_host():
    job = ScriptedJob(Engine(CONFIG), ranks=8)  # node-0 .. node-3, two ranks each
    job.run(6)
    job.slow.update({2: 1.5, 3: 1.5, 4: 1.5})
    job.run(8)
    nodes = {node.host: node for node in job.engine.node_state()}
    assert nodes["node-1"].slow_ranks == (2, 3) and nodes["node-1"].ranks == 2 and nodes["node-1"].degraded
    assert nodes["node-2"].slow_ranks == (4,) and not nodes["node-2"].degraded
    job.slow.clear()
    job.run(8)
    quiet = {node.host: node for node in job.engine.node_state()}
    assert quiet["node-1"].slow_ranks == () and quiet["node-1"].ranks == 2  # kept for the report's counts

