"""The C intake loop (_ingest.c) against the Python one (engine._ingest_rows): the same streams, clean
and mangled, leave both engines in the same state (outcome counts, every open window's columns, each
cohort's progress) and give the same verdicts."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from otel_straggler.detector import engine as engine_module
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.engine import Engine
from otel_straggler.detector.observation import _RECORD, Observation, ObservationRecords

from otel_straggler.testing.synthetic import TEN_STAGES, SyntheticJob

pytestmark = pytest.mark.skipif(engine_module._append_rows is None, reason="_ingest not built")

STEP_NS = 100_000_000


def python_only_engine(monkeypatch, config: DetectorConfig | None = None) -> Engine:
    """An engine whose ingest_many runs the Python loop alone."""
    engine = Engine(config or DetectorConfig())
    python_loop = engine._ingest_rows

    def ingest_many(observations):
        counts = dict(zip(("accepted", "duplicate", "late", "malformed", "dropped"), python_loop(observations)))
        engine._counts.update(counts)
        return counts

    monkeypatch.setattr(engine, "ingest_many", ingest_many)
    return engine


def state(engine: Engine) -> list:
    cohorts = []
    for key, cohort in sorted(engine._cohorts.items()):
        windows = [(window, rows.keys.tolist(), rows.host_ms.tobytes(), rows.device_ms.tobytes(),
                    rows.tokens.tolist(), rows.end_unix_nano.tolist())
                   for window, rows in sorted(cohort.open_windows.items())]
        entries = [(entry.rank, entry.latest_window, entry.recent_seqs.tolist())
                   for entry in cohort.slot_entries if entry is not None]
        cohorts.append((key, cohort.latest_end_unix_nano, windows, entries,
                        cohort.latest_windows(len(cohort.slot_entries)).tolist(),
                        # what opening and closing windows keep: the same calls, in the same order
                        [rows.window for rows in cohort._closed_early], cohort._judged_below,
                        sorted(cohort._judged_out_of_order), cohort._windows_version))
    return cohorts


def mangle(observations: list, rng: random.Random) -> list:
    """Duplicates, replays, restarts, bad and unusual values, new stages and ranks, mixed in."""
    out = []
    for observation in observations:
        roll = rng.random()
        if roll < 0.03:
            out.append(observation)
            out.append(observation)  # a duplicate
        elif roll < 0.05:
            out.append(observation._replace(host_ms=rng.choice([-1.0, math.nan, math.inf, "7", None])))
        elif roll < 0.07:
            out.append(observation._replace(host_ms=int(observation.host_ms), tokens=rng.choice([5, -3, 2.5, math.nan]),
                                            device_ms=rng.choice([None, 3, np.float64(2.0), "x"])))
        elif roll < 0.08:
            out.append(observation._replace(stage=rng.choice(["new-stage", 7, "extra"])))
        elif roll < 0.09:
            out.append(observation._replace(seq=observation.seq - rng.choice([1, 10_000, 1 << 20])))  # replay, restart
        elif roll < 0.10:
            out.append(observation._replace(step=rng.choice([observation.step - 40, 2.0, 1 << 70, -3])))
        elif roll < 0.11:
            out.append(observation._replace(rank=observation.rank + 1000, cohort=rng.choice([observation.cohort, "other"])))
        elif roll < 0.12:
            out.append(observation._replace(end_unix_nano=rng.choice([1 << 64, 0, -5]), collective=rng.choice([1, 0, None])))
        elif roll < 0.125:
            out.append(observation._replace(restart=observation.restart + 1))
        elif roll < 0.13:
            out.append(tuple(observation)[:5])  # not an observation at all
        else:
            out.append(observation)
    return out


def run(engine: Engine, batches: list) -> tuple:
    verdicts, counts, now = [], [], 0
    for step_batches in batches:
        for batch in step_batches:
            counts.append(engine.ingest_many(batch))
        now += STEP_NS
        verdicts += engine.advance(now)
    snapshot = state(engine)
    verdicts += engine.drain(now + STEP_NS)
    return counts, snapshot, verdicts, engine.stats()


@pytest.mark.parametrize("seed,mangled,cohort_size", [(0, False, 16), (1, True, 16), (2, True, 4), (3, True, 32)])
def test_the_c_loop_leaves_the_engine_as_the_python_loop_does(monkeypatch, seed, mangled, cohort_size):
    rng = random.Random(seed)
    jobs = [SyntheticJob(ranks=cohort_size, stages=TEN_STAGES, seed=seed + first, cohort=f"c{first}",
                         first_rank=first).slow(first + 1, 1.2) for first in range(0, 32, cohort_size)]
    batches = []
    for first_step in range(0, 40, 2):
        step_batches = []
        for job in jobs:
            observations = job.observations(2, first_step=first_step, seq_start=first_step * len(TEN_STAGES))
            if mangled:
                observations = mangle(observations, rng)
            for start in range(0, len(observations), 37):
                step_batches.append(observations[start:start + 37])
        batches.append(step_batches)
    fast = run(Engine(DetectorConfig()), batches)
    python = run(python_only_engine(monkeypatch), batches)
    assert fast[0] == python[0]
    assert fast[1] == python[1]
    assert fast[2] == python[2]
    assert fast[3] == python[3]
    assert sum(counts["accepted"] for counts in fast[0]) > 0


@pytest.mark.parametrize("seed", [7, 8])
def test_windows_opened_at_the_bound_leave_the_engine_as_the_python_loop_does(monkeypatch, seed):
    """Steps out of order in a cohort that may hold two open windows: the C loop opens windows that
    close the oldest early, and meets rows of windows its cohort will not open (late)."""
    rng = random.Random(seed)
    observations = SyntheticJob(ranks=8, stages=TEN_STAGES, seed=seed).observations(50)
    for start in range(0, len(observations), 2000):  # out of order within every 25 steps' rows: 3 windows
        chunk = observations[start:start + 2000]
        rng.shuffle(chunk)
        observations[start:start + 2000] = chunk
    batches = [[observations[start:start + 37] for start in range(first, min(first + 240, len(observations)), 37)]
               for first in range(0, len(observations), 240)]
    config = DetectorConfig(max_open_windows=2)
    fast = run(Engine(config), batches)
    python = run(python_only_engine(monkeypatch, config), batches)
    assert fast == python
    assert fast[3]["evictions_windows"] > 0 and fast[3]["late"] > 0


def test_tuples_and_iterables_take_the_same_loop_results():
    job = SyntheticJob(ranks=8, stages=TEN_STAGES, seed=4)
    observations = job.observations(3)
    from_list, from_generator = Engine(DetectorConfig()), Engine(DetectorConfig())
    assert from_list.ingest_many(tuple(observations)) == from_generator.ingest_many(o for o in observations)
    assert state(from_list) == state(from_generator)
    assert isinstance(observations[0], Observation)


def carried_mangle(observations: list, rng: random.Random) -> list:
    """What an OTLP payload can carry of mangle's mix: duplicates, replays, restarts, new stages,
    ranks, cohorts and incarnations, collectives and workload counts of every kind."""
    out = []
    for observation in observations:
        roll = rng.random()
        if roll < 0.03:
            out += [observation, observation]
        elif roll < 0.05:
            out.append(observation._replace(seq=max(0, observation.seq - rng.choice([1, 10_000, 1 << 20]))))
        elif roll < 0.06:
            out.append(observation._replace(stage=rng.choice(["new-stage", "extra"])))
        elif roll < 0.07:
            out.append(observation._replace(rank=observation.rank + 1000, cohort=rng.choice([observation.cohort, "other"])))
        elif roll < 0.075:
            out.append(observation._replace(restart=observation.restart + 1))
        elif roll < 0.09:
            out.append(observation._replace(collective=not observation.collective, tokens=rng.choice([None, 1, 7]),
                                            device_ms=rng.choice([None, 0.0, 2.5])))
        elif roll < 0.095:
            out.append(observation._replace(step=max(0, observation.step - 40)))
        else:
            out.append(observation)
    return out


@pytest.mark.parametrize("seed,cohort_size", [(5, 16), (6, 4)])
def test_scanned_records_leave_the_engine_as_the_python_loop_does(monkeypatch, seed, cohort_size):
    """Real payloads through the C scanner: its records, read by append_records, against the same
    Observations through the Python loop."""
    from otel_straggler.detector.decode import ProtobufDecoder
    from otel_straggler.detector.observation import ObservationRecords
    from otel_straggler.testing.otlp_spans import export_batches, request_bytes

    rng = random.Random(seed)
    jobs = [SyntheticJob(ranks=cohort_size, stages=TEN_STAGES, seed=seed + first, cohort=f"c{first}",
                         first_rank=first).slow(first + 1, 1.2) for first in range(0, 32, cohort_size)]
    decoder = ProtobufDecoder()
    batches, scanned = [], 0
    for first_step in range(0, 30, 2):
        step_batches = []
        for job in jobs:
            # seqs high enough that a restart (a seq far below the latest) stays positive
            observations = carried_mangle(job.observations(2, first_step=first_step,
                                                           seq_start=(1 << 22) + first_step * len(TEN_STAGES)), rng)
            for spans in export_batches(observations):
                batch = decoder.decode(request_bytes(spans)).observations
                scanned += isinstance(batch, ObservationRecords)
                step_batches.append(batch)
        batches.append(step_batches)
    assert scanned == sum(len(step_batches) for step_batches in batches)  # every request took the fast path
    fast = run(Engine(DetectorConfig()), batches)
    python = run(python_only_engine(monkeypatch), [[list(batch) for batch in step] for step in batches])
    assert fast == python
    assert sum(counts["accepted"] for counts in fast[0]) > 0
    assert sum(counts["duplicate"] for counts in fast[0]) > 0
    assert fast[3]["seq_restarts"] > 0


def test_records_read_the_same_at_any_alignment():
    """append_records copies each record out, so a buffer that does not start on an 8-byte
    boundary (a memoryview slice) reads as the scanner's own bytes do."""
    from otel_straggler.detector.decode import ProtobufDecoder
    from otel_straggler.detector.observation import ObservationRecords
    from otel_straggler.testing.otlp_spans import export_batches, request_bytes

    decoder = ProtobufDecoder()
    job = SyntheticJob(ranks=4, stages=TEN_STAGES, seed=8)
    batches = [decoder.decode(request_bytes(spans)).observations for spans in export_batches(job.observations(12))]
    assert all(isinstance(batch, ObservationRecords) for batch in batches)
    shifted = [ObservationRecords(memoryview(b"\0" + batch.records)[1:], batch.strings, batch.identities)
               for batch in batches]
    assert [list(batch) for batch in shifted] == [list(batch) for batch in batches]
    assert run(Engine(DetectorConfig()), [shifted]) == run(Engine(DetectorConfig()), [batches])


@st.composite
def record_batches(draw) -> list:
    """Batches of records as the scanner writes them, their values anywhere a record can hold:
    steps, seqs, counts and end times up to their limits beside ordinary ones, so the C loop meets
    them in ranks and windows it already knows."""
    strings = ["forward-compute", "backward-compute", "all-grads-sync"]
    identities = [("job-1", 0, "c0", rank, restart) for rank in range(2) for restart in (0, draw(st.integers(0, 1)))]
    batches = []
    for _ in range(draw(st.integers(1, 3))):
        rows = []
        for _ in range(draw(st.integers(1, 30))):
            rows.append(_RECORD.pack(
                draw(st.integers(0, len(identities) - 1)), draw(st.integers(0, len(strings) - 1)),
                draw(st.one_of(st.integers(0, 25), st.integers(0, 2**63 - 1))),
                draw(st.one_of(st.integers(0, 300), st.integers(0, 2**63 - 1))),
                draw(st.one_of(st.floats(0, 100), st.just(1e308))),
                draw(st.one_of(st.just(math.nan), st.floats(0, 100))),
                draw(st.one_of(st.just(0), st.integers(1, 2**63 - 1))), draw(st.integers(0, 5)),
                draw(st.one_of(st.integers(1, 2**40), st.integers(2**63 - 2, 2**64 - 1))),
                draw(st.integers(0, 1))))
        batches.append(ObservationRecords(b"".join(rows), strings, identities))
    return batches


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record_batches())
def test_records_at_their_limits_leave_the_engine_as_the_python_loop_does(batches):
    fast, python = Engine(DetectorConfig()), Engine(DetectorConfig())
    for batch in batches:
        assert fast.ingest_many(batch) == dict(zip(engine_module.OUTCOMES, python._ingest_rows(list(batch)), strict=True))
    assert state(fast) == state(python)
