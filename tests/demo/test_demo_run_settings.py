from pathlib import Path

import pytest

from otel_straggler.demo.run import DemoSettings, detector_config, medians_by_rank, rank_environment, trainer_arguments
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.report.evidence_files import Injection, WindowMedian


def settings(injection=Injection(2, "forward-compute", 20, 0.3)):
    return DemoSettings(ranks=4, steps=70, window_steps=10, injection=injection, out_dir=Path("out"), grpc_port=0,
                        job_id="demo-1", external_endpoint=None)


def test_ranks_export_to_the_embedded_detector():
    env = rank_environment(settings(), "http://127.0.0.1:5555", environ={})
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:5555"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert env["OTEL_STRAGGLER_JOB_ID"] == "demo-1"
    assert env["OTEL_BSP_SCHEDULE_DELAY"] == "500"


def trainer_parse_args(arguments):
    pytest.importorskip("torch")
    from otel_straggler.demo.trainer import parse_args

    return parse_args(list(arguments))


def test_the_injection_is_the_trainers_own_slowed_rank():
    args = trainer_parse_args(trainer_arguments(settings()))
    assert (args.steps, args.log_every) == (70, 1)
    assert (args.slow_rank, args.slow_stage, args.from_step, args.slowdown, args.block_s) == (
        2, "forward-compute", 20, 0.3, 0.0)
    hang = trainer_parse_args(trainer_arguments(settings(injection=Injection(1, "optimizer", 30, 0.3, hang=True)), 150.0))
    assert (hang.slow_rank, hang.slow_stage, hang.from_step, hang.block_s) == (1, "optimizer", 30, 1e9)
    assert hang.collective_timeout_s == 150.0


def test_an_outside_endpoint_and_the_users_export_period_are_left_alone():
    env = rank_environment(settings(), None, environ={"OTEL_BSP_SCHEDULE_DELAY": "2000"})
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env and "OTEL_STRAGGLER_EXPORT_METRICS" not in env
    assert "OTEL_BSP_SCHEDULE_DELAY" not in env


def test_healthy_runs_slow_no_rank():
    arguments = trainer_arguments(settings(injection=None))
    assert "--slow-rank" not in arguments and trainer_parse_args(arguments).slow_rank == -1


def test_simulated_gpus_are_the_fake_nvml_on_every_rank_and_said_in_the_header():
    from dataclasses import replace

    from otel_straggler.demo.run import header

    simulated = replace(settings(), simulate_gpu=True)
    assert rank_environment(simulated, "http://127.0.0.1:5555", environ={})["OTEL_STRAGGLER_GPU_HEALTH"] == "fake"
    assert "OTEL_STRAGGLER_GPU_HEALTH" not in rank_environment(settings(), "http://127.0.0.1:5555", environ={})
    assert "its simulated GPU thermally throttled from then on" in header(simulated, "http://127.0.0.1:5555")


def test_the_embedded_detector_runs_on_its_defaults_but_for_the_grace_time():
    config, defaults = detector_config(settings(), Path("out/evidence")), DetectorConfig()
    for name in ("window_steps", "warmup_windows", "persist_windows", "rel_threshold", "min_gap_ms", "min_cohort_size"):
        assert getattr(config, name) == getattr(defaults, name), name
    assert config.window_grace_s < defaults.window_grace_s
    assert (config.grpc_port, config.http_port, config.export_metrics) == (0, 0, False)
    assert config.evidence_dir == str(Path("out/evidence"))


def test_medians_by_rank():
    medians = [WindowMedian("j", "c", rank, stage, window, float(rank), 10, False)
               for window in (3, 4) for rank in (0, 1) for stage in ("forward-compute", "optimizer")]
    shaped = medians_by_rank(medians)
    assert sorted(shaped) == [3, 4]
    assert shaped[4][1] == {"forward-compute": 1.0, "optimizer": 1.0}


def test_the_job_id_a_user_sets_is_the_demos():
    """CONTRACT §1: every identity value can be given; the demo makes one up only when none is."""
    from otel_straggler.demo.demo_command import _given_job_id

    assert _given_job_id({"OTEL_STRAGGLER_JOB_ID": "compose-demo"}) == "compose-demo"
    assert _given_job_id({"OTEL_RESOURCE_ATTRIBUTES": "training.job.id=nightly%2D7,team=x"}) == "nightly-7"
    assert _given_job_id({"OTEL_STRAGGLER_JOB_ID": "a", "OTEL_RESOURCE_ATTRIBUTES": "training.job.id=b"}) == "a"
    assert _given_job_id({}) is None and _given_job_id({"OTEL_STRAGGLER_JOB_ID": ""}) is None


def test_the_header_says_when_no_detector_is_embedded():
    from dataclasses import replace

    from otel_straggler.demo.run import header

    embedded = header(settings(), "127.0.0.1:5555")
    outside = header(replace(settings(), external_endpoint="http://collector:4317"), "http://collector:4317")
    assert "job demo-1" in embedded and "no detector" not in embedded
    assert "no detector embedded" in outside and "OTEL_EXPORTER_OTLP" in outside
