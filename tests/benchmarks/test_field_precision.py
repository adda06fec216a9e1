"""The CI-sized field run (benchmarks/field_precision.py): real 4-rank gloo DDP jobs instrumented the
README way plus `ots.instrument_ddp`, the SDK's default export schedule, `otel-straggler detect` in
its own process at its defaults; 2 runs per scenario, with and without a CPU hog.

What must hold on a 2-core machine: no verdict in a healthy run, no other rank flagged in any run,
rank 1 flagged within 4 windows when its forward or its data loading is +30 ms, late spans under 1%.
Inside DDP's backward the same +30 ms shows on this machine as about +10 ms (the waiting ranks
give the slow one their cores), within the healthy ranks' noise: those runs must not flag a wrong
rank, and whether rank 1 is caught is reported, not required (docs/detection.md, Limits)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import field_precision  # noqa: E402

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

RUNS = 2
STEPS, FROM_STEP = 130, 60


@pytest.mark.parametrize("scenario", field_precision.SCENARIOS)
def test_field_run(scenario):
    kind = field_precision._kind(scenario)
    results = [field_precision.run_once(scenario, run, STEPS, FROM_STEP, 30.0, None) for run in range(RUNS)]
    for result in results:
        flagged = sorted(result.flagged)
        assert set(flagged) <= ({field_precision.SLOW_RANK} if kind != "none" else set()), flagged
        assert result.late <= 0.01 * result.received, (result.late, result.received)
        if kind in ("forward", "data"):
            assert flagged == [field_precision.SLOW_RANK]
            assert result.windows_to_alert is not None and result.windows_to_alert <= 4, result.windows_to_alert
    caught = sum(bool(result.flagged) for result in results)
    print(f"{scenario}: slow rank caught in {caught} of {RUNS}, windows to alert "
          f"{[result.windows_to_alert for result in results]}")
