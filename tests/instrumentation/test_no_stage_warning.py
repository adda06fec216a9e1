"""A rank that times no stage gives the detector nothing to judge: `no_stage_warning_s` after
configure() the span builder's thread logs one warning saying so and how to time the loop; none
when a stage was timed (or is open), none when the setting is 0."""
from __future__ import annotations

import logging
import time

import otel_straggler

WARNING_S = 0.2
WAIT_S = WARNING_S + 0.5  # the look is due WARNING_S after configure(); the rest is scheduling slack


def warnings_of(caplog) -> list[logging.LogRecord]:
    return [record for record in caplog.records if "no stage timed" in record.getMessage()]


def test_a_rank_that_times_nothing_logs_one_warning_from_the_background_thread(in_memory, caplog):
    caplog.set_level(logging.WARNING, logger="otel_straggler")
    in_memory.configure(no_stage_warning_s=WARNING_S)
    for step in range(3):
        otel_straggler.step(step)  # steps alone time no stage
    time.sleep(WAIT_S * 2)
    found = warnings_of(caplog)
    assert len(found) == 1
    message = found[0].getMessage()
    assert f"in the {WARNING_S:g} s since configure()" in message
    for advice in ("ots.stage(", "ots.step(", "ots.instrument_ddp(", "otel_straggler.integrations.megatron.install()",
                   "callbacks", "docs/instrumentation.md", "OTEL_STRAGGLER_NO_STAGE_WARNING_S=0"):
        assert advice in message
    assert found[0].levelno == logging.WARNING and found[0].threadName == "otel-straggler-span-builder"


def test_no_warning_once_a_stage_was_timed(in_memory, caplog):
    caplog.set_level(logging.WARNING, logger="otel_straggler")
    in_memory.configure(no_stage_warning_s=WARNING_S)
    with otel_straggler.stage("forward-compute"):
        pass
    time.sleep(WAIT_S)
    assert warnings_of(caplog) == []
    assert len(in_memory.stage_spans()) == 1


def test_no_warning_while_a_stage_is_still_open(in_memory, caplog):
    caplog.set_level(logging.WARNING, logger="otel_straggler")
    in_memory.configure(no_stage_warning_s=WARNING_S)
    with otel_straggler.stage("checkpoint-load"):  # a first stage longer than the warning's wait
        time.sleep(WAIT_S)
    assert warnings_of(caplog) == []


def test_no_warning_when_turned_off(in_memory, caplog):
    caplog.set_level(logging.WARNING, logger="otel_straggler")
    in_memory.configure(no_stage_warning_s=0)
    time.sleep(WAIT_S)
    assert warnings_of(caplog) == []
