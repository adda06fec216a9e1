"""The alert latency benchmark (benchmarks/alert_latency.py) in its --quick form: the shipped
configs, one straggler job and one hang job through the real gateway, detector and Prometheus.
Asserted: the table is printed, an alert of each kind fired, every hop is measured and in order (no hop
negative, the chain the sum of its hops), and verdict -> firing stays within what the shipped
settings allow (docs/pipeline.md#alert-latency); the full run's figures are in the docs."""
from __future__ import annotations

import pytest

import alert_latency

from otel_straggler.testing import services

pytestmark = [pytest.mark.slow, pytest.mark.services]
# the shipped chain's worst case is ~12 s (the verdict writer's 1 s, the gateway's 1 s batch, a 5 s
# scrape, a 5 s evaluation); the bound leaves room for a stall of a shared 2-core machine
VERDICT_TO_FIRING_BOUND_S = 15.0


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    missing = services.binaries().missing()
    if missing:
        pytest.skip("pipeline programs not built, run `scripts/services.sh build`: missing " + ", ".join(missing))
    return alert_latency.main(["--quick", "--workdir", str(tmp_path_factory.mktemp("alert-latency"))])


def test_the_quick_run_prints_the_table(quick, capsys):
    # main() printed already (module fixture); print again from the results to check the format
    alert_latency.print_table(quick, {"shipped": alert_latency.SHIPPED})
    out = capsys.readouterr().out
    for title in alert_latency.HOP_TITLES.values():
        assert "shipped   straggler" in out and title in out, out


@pytest.mark.parametrize("kind", ["straggler", "hang"])
def test_every_alert_fired_and_its_hops_add_up(quick, kind):
    entry = quick["shipped"][kind]
    print(kind, entry)
    # a straggler verdict whose alert gauge never reached 1 is counted as missed (see the docs'
    # caveat); at least one alert of each kind must have paged
    fired = entry["n"] - entry["missed"]
    assert fired >= 1, entry
    for hop in alert_latency.HOP_NAMES:
        assert entry[hop] is not None and entry[hop][3] == (entry["n"] if hop == "a" else fired), (hop, entry)
        p50, p99, top, _, least = entry[hop]
        # no hop is negative: span end, verdict, scrape and evaluation follow each other on one clock
        assert 0.0 <= least <= p50 <= p99 <= top, (hop, entry)
    assert entry["verdict->firing"][2] <= VERDICT_TO_FIRING_BOUND_S, entry
    # the evidence of a window is complete a few export periods after its last span at most
    assert entry["a"][2] < 10.0, entry
