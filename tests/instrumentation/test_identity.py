"""Who a rank is (CONTRACT §1): explicit values, then OTEL_RESOURCE_ATTRIBUTES, then what
torch.distributed, torchrun/SLURM and Megatron's parallel state say; never a guess."""
from __future__ import annotations

import socket

import pytest

import otel_straggler
from otel_straggler import contract
from otel_straggler.instrumentation.identity import discover

BASE = {contract.SERVICE_NAME: "training", contract.HOST_NAME: socket.gethostname(), contract.TOPOLOGY_EPOCH: 0,
        contract.RESTART_COUNT: 0}


def test_nothing_known_means_nothing_guessed():
    assert discover({}, {}) == BASE


def test_torchrun_environment():
    environ = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "run-17"}
    assert discover({}, environ) == {**BASE, contract.JOB_ID: "run-17", contract.RANK: 3, contract.WORLD_SIZE: 8,
                                     contract.LOCAL_RANK: 1}


def test_torchruns_default_run_id_is_not_an_identity():
    assert contract.JOB_ID not in discover({}, {"TORCHELASTIC_RUN_ID": "none", "RANK": "0"})
    assert discover({}, {"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "4242"})[contract.JOB_ID] == "4242"


def test_slurm_environment():
    environ = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}
    assert discover({}, environ) == {**BASE, contract.JOB_ID: "4242", contract.RANK: 5, contract.WORLD_SIZE: 16,
                                     contract.LOCAL_RANK: 1}


def test_torchrun_under_slurm_takes_the_launchers_values():
    environ = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "TORCHELASTIC_RUN_ID": "elastic",
               "RANK": "7", "WORLD_SIZE": "16"}
    found = discover({}, environ)
    assert (found[contract.JOB_ID], found[contract.RANK], found[contract.WORLD_SIZE]) == ("elastic", 7, 16)


def test_unparsable_values_are_left_out():
    assert discover({}, {"RANK": "first", "WORLD_SIZE": "", "LOCAL_RANK": "1.5"}) == BASE


def test_resource_attributes_override_discovery_and_explicit_values_override_both():
    environ = {"RANK": "3", "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "run-17", "OTEL_SERVICE_NAME": "trainer",
               "OTEL_RESOURCE_ATTRIBUTES": "training.rank=4,training.job.id=job%2Fa,host.name=node-9,"
                                           "training.cohort=tp0,training.topology.epoch=2,service.name=ignored"}
    found = discover({}, environ)
    assert found == {contract.SERVICE_NAME: "trainer", contract.JOB_ID: "job/a", contract.RANK: 4,
                     contract.WORLD_SIZE: 8, contract.HOST_NAME: "node-9", contract.COHORT: "tp0",
                     contract.TOPOLOGY_EPOCH: 2, contract.RESTART_COUNT: 0}
    explicit = discover({"rank": 6, "job_id": "explicit", "cohort": "tp1", "topology_epoch": 3}, environ)
    assert (explicit[contract.RANK], explicit[contract.JOB_ID], explicit[contract.COHORT],
            explicit[contract.TOPOLOGY_EPOCH]) == (6, "explicit", "tp1", 3)


def test_megatron_parallel_state_gives_dimensions_and_a_cohort_without_dp(megatron_state):
    megatron_state(tp=(1, 2), pp=(0, 4), cp=(0, 1), ep=(0, 1), dp=(3, 4), vpp=None)
    found = discover({}, {})
    assert found[contract.COHORT] == "tp1.pp0.cp0.ep0"
    expected = {"tp": (1, 2), "pp": (0, 4), "cp": (0, 1), "ep": (0, 1), "dp": (3, 4)}
    for dim, (rank, size) in expected.items():
        assert found[contract.parallel_rank_key(dim)] == rank and found[contract.parallel_size_key(dim)] == size
    assert contract.parallel_rank_key("vpp") not in found  # not in use: left out


def test_ranks_differing_only_in_dp_share_a_cohort(megatron_state):
    megatron_state(dp=(0, 4), vpp=(1, 2))
    first = discover({}, {})[contract.COHORT]
    megatron_state(dp=(3, 4), vpp=(1, 2))
    assert discover({}, {})[contract.COHORT] == first == "tp1.pp0.cp0.ep0.vpp1"


def test_megatron_before_initialisation_or_failing_getters_give_nothing_made_up(megatron_state):
    state = megatron_state()
    state.model_parallel_is_initialized = lambda: False
    assert discover({}, {}) == BASE

    state.model_parallel_is_initialized = lambda: True

    def broken():
        raise RuntimeError("not set up")

    state.get_expert_model_parallel_rank = broken
    found = discover({}, {})
    assert contract.parallel_rank_key("ep") not in found and found[contract.COHORT] == "tp1.pp0.cp0"


def test_parallel_dimensions_from_resource_attributes_are_ints_and_make_the_cohort(megatron_state):
    environ = {"OTEL_RESOURCE_ATTRIBUTES": "training.parallel.tp.rank=1,training.parallel.tp.size=2,"
                                           "training.parallel.pp.rank=3,training.parallel.pp.size=4,"
                                           "training.parallel.dp.rank=5,training.parallel.dp.size=8"}
    found = discover({}, environ)
    assert found[contract.parallel_rank_key("tp")] == 1 and found[contract.parallel_size_key("pp")] == 4
    assert found[contract.parallel_rank_key("dp")] == 5
    assert found[contract.COHORT] == "tp1.pp3"

    megatron_state(tp=(0, 2), pp=(0, 4))  # the override wins over Megatron, and the cohort agrees with it
    found = discover({}, environ)
    assert found[contract.parallel_rank_key("tp")] == 1 and found[contract.COHORT] == "tp1.pp3.cp0.ep0"


def test_an_initialised_process_group_is_the_first_source(monkeypatch, unreachable_endpoint):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    host, port = unreachable_endpoint.split(":")
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=0, world_size=1)
    try:
        found = discover({}, {"RANK": "5", "WORLD_SIZE": "8"})
    finally:
        dist.destroy_process_group()
    assert (found[contract.RANK], found[contract.WORLD_SIZE]) == (0, 1)
    assert torch.distributed.is_initialized() is False


def test_configure_takes_the_epoch_from_resource_attributes_unless_given(configure, in_memory, monkeypatch):
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "training.topology.epoch=3")
    handle = in_memory.configure()
    assert handle.resource_attributes[contract.TOPOLOGY_EPOCH] == 3
    handle.shutdown()
    monkeypatch.setenv("OTEL_STRAGGLER_TOPOLOGY_EPOCH", "4")
    handle = in_memory.configure()
    assert handle.resource_attributes[contract.TOPOLOGY_EPOCH] == 4
    handle.shutdown()
    assert in_memory.configure(topology_epoch=5).resource_attributes[contract.TOPOLOGY_EPOCH] == 5


def test_the_restart_count_is_torchruns_unless_given():
    assert discover({}, {"TORCHELASTIC_RESTART_COUNT": "2"})[contract.RESTART_COUNT] == 2
    assert discover({}, {"TORCHELASTIC_RESTART_COUNT": "lots"})[contract.RESTART_COUNT] == 0  # unknown: 0
    given = {"TORCHELASTIC_RESTART_COUNT": "2", "OTEL_RESOURCE_ATTRIBUTES": "training.restart.count=5"}
    assert discover({}, given)[contract.RESTART_COUNT] == 5
    assert discover({"restart_count": 7}, given)[contract.RESTART_COUNT] == 7


def test_configure_takes_the_restart_count_from_torchrun_env_and_keyword(configure, in_memory, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    handle = in_memory.configure()
    assert handle.resource_attributes[contract.RESTART_COUNT] == 3
    otel_straggler.step(0)
    with otel_straggler.stage("forward-compute"):
        pass
    (span,) = in_memory.stage_spans()  # on a TracerProvider of yours: on every span, as the rest of the identity
    assert span.attributes[contract.RESTART_COUNT] == 3
    handle.shutdown()
    monkeypatch.setenv("OTEL_STRAGGLER_RESTART_COUNT", "4")
    handle = in_memory.configure()
    assert handle.resource_attributes[contract.RESTART_COUNT] == 4
    handle.shutdown()
    assert in_memory.configure(restart_count=5).resource_attributes[contract.RESTART_COUNT] == 5


def test_a_bad_restart_count_fails_configure_with_one_line(configure, monkeypatch):
    from otel_straggler.settings import ConfigError

    monkeypatch.setenv("OTEL_STRAGGLER_RESTART_COUNT", "-1")
    with pytest.raises(ConfigError, match=r"^OTEL_STRAGGLER_RESTART_COUNT: must be >= 0, got -1$"):
        configure(job_id="bad-restart")


def test_parallel_state_set_up_after_configure_is_picked_up_before_the_first_span(in_memory, megatron_state):
    handle = in_memory.configure(job_id="late-megatron", rank=2)
    assert contract.COHORT not in handle.resource_attributes  # Megatron initialises after its timers
    megatron_state(tp=(1, 2), pp=(1, 2))
    otel_straggler.step(0)
    with otel_straggler.stage("forward-compute"):
        pass
    (span,) = in_memory.stage_spans()
    assert span.attributes[contract.COHORT] == "tp1.pp1.cp0.ep0"
    assert span.attributes[contract.RANK] == 2 and span.attributes[contract.JOB_ID] == "late-megatron"


def test_identity_is_read_again_from_configures_environment_not_the_process(in_memory, monkeypatch):
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "training.parallel.tp.rank=7,training.parallel.pp.rank=0")
    in_memory.configure(job_id="given-environment", rank=1, environ={})
    otel_straggler.step(0)  # the first span re-reads identity (parallel state may be new by then)
    with otel_straggler.stage("forward-compute"):
        pass
    (span,) = in_memory.stage_spans()
    assert span.attributes[contract.RANK] == 1
    assert contract.COHORT not in span.attributes  # the process's tp/pp ranks would make one


def test_a_static_rendezvous_names_the_job_by_its_address():
    # torchrun --master-port N (static rendezvous): run id "none", every rank the same address
    ranks = [discover({}, {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "node-0", "MASTER_PORT": "29500",
                           "RANK": str(rank), "WORLD_SIZE": "4"}) for rank in range(4)]
    assert {found[contract.JOB_ID] for found in ranks} == {"rendezvous-node-0:29500"}
    assert discover({}, {"MASTER_ADDR": "node-0", "MASTER_PORT": "29500", "SLURM_JOB_ID": "4242"})[
        contract.JOB_ID] == "4242"  # a scheduler's id comes first
    assert contract.JOB_ID not in discover({}, {"MASTER_ADDR": "node-0"})


def test_configure_without_a_job_id_says_what_to_set(configure, caplog):
    configure(environ={"RANK": "0"})
    assert [record.getMessage() for record in caplog.records if record.name == "otel_straggler"] == [
        "otel-straggler: no job id found (set OTEL_STRAGGLER_JOB_ID, or training.job.id in OTEL_RESOURCE_ATTRIBUTES, "
        "to one value for every rank); the detector will reject these spans"]


def test_configure_with_a_job_id_says_nothing(configure, caplog):
    configure(job_id="named", environ={})
    assert [record for record in caplog.records if record.name == "otel_straggler"] == []
