"""The report renders from evidence on disk: with the demo's extra files, and from verdicts.jsonl alone."""
import base64
import io
import re
from dataclasses import asdict

import matplotlib.image
import pytest

from otel_straggler.report import evidence_files, html_report

from demo_synthetic_evidence import run_record, verdict, window_medians

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_evidence(directory, verdicts, windows=None, run=None):
    directory.mkdir(parents=True, exist_ok=True)
    evidence_files.append_jsonl(directory / evidence_files.VERDICTS_FILE, verdicts)
    if windows is not None:
        evidence_files.append_jsonl(directory / evidence_files.WINDOWS_FILE, [asdict(median) for median in windows])
    if run is not None:
        evidence_files.write_run(directory, run)


def assert_valid_png(data):
    assert data.startswith(PNG_SIGNATURE)
    image = matplotlib.image.imread(io.BytesIO(data), format="png")
    assert image.shape[0] > 50 and image.shape[1] > 50


def embedded_images(html):
    return [base64.b64decode(data) for data in re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", html)]


def test_full_report_has_three_pictures_embedded_and_as_files(tmp_path):
    evidence_dir = tmp_path / "evidence"
    write_evidence(evidence_dir, [verdict(2, 4), verdict(0, 3, kind="uncertain", reason="below_absolute_floor")],
                   window_medians(), run_record())
    built = html_report.build(evidence_dir, tmp_path)
    html = built.html_path.read_text()
    assert [path.name for path in built.picture_paths] == [html_report.HEATMAP_FILE, html_report.TIMELINE_FILE,
                                                           html_report.VERDICTS_PICTURE_FILE]
    images = embedded_images(html)
    assert len(images) == 3
    for path, embedded in zip(built.picture_paths, images):
        assert path.read_bytes() == embedded
        assert_valid_png(embedded)
    assert "rank 2 in forward-compute at window 4" in html and "slow_vs_peers" in html
    alerts, uncertain = html.split("<h2>Uncertain verdicts</h2>")
    assert "below_absolute_floor" not in alerts  # uncertain verdicts are counted, not listed
    assert "uncertain 1" in alerts
    assert "<td>below_absolute_floor</td><td>forward-compute</td><td>1</td>" in uncertain
    assert "Job <code>job-1</code>" in html


def test_report_from_verdicts_alone_copies_the_evidence(tmp_path):
    evidence_dir = tmp_path / "detector"
    write_evidence(evidence_dir, [verdict(5, 3, kind="uncertain", rank_ms=33.0), verdict(5, 4)])
    (evidence_dir / evidence_files.VERDICTS_FILE).open("a").write('{"cut short')  # a writer mid-line
    built = html_report.build(evidence_dir, tmp_path / "out")
    assert [path.name for path in built.picture_paths] == [html_report.TIMELINE_FILE, html_report.VERDICTS_PICTURE_FILE]
    for path in built.picture_paths:
        assert_valid_png(path.read_bytes())
    html = built.html_path.read_text()
    assert "no heat map" in html and "1 evidence lines could not be read" in html
    assert (tmp_path / "out" / "evidence" / evidence_files.VERDICTS_FILE).read_text().startswith("{")
    assert "Straggler alerts: rank 5" in built.summary


def test_report_with_no_verdicts_still_renders(tmp_path):
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / evidence_files.STATUS_FILE).write_text("{}")  # a detector that judged nothing yet
    built = html_report.build(tmp_path / "e", tmp_path / "e")
    assert [path.name for path in built.picture_paths] == [html_report.VERDICTS_PICTURE_FILE]
    assert "No straggler alert" in built.html_path.read_text()


def test_not_an_evidence_directory(tmp_path):
    with pytest.raises(evidence_files.EvidenceError, match="holds no verdicts.jsonl"):
        html_report.build(tmp_path, tmp_path / "out")
    with pytest.raises(evidence_files.EvidenceError, match="is not a directory"):
        html_report.build(tmp_path / "missing", tmp_path / "out")


def test_the_report_says_what_to_look_at_first_and_rolls_up_a_node(tmp_path):
    evidence_dir = tmp_path / "evidence"
    hot = {"sm_clock_mhz": 1410, "peer_sm_clock_mhz": 1980, "clock_event_reasons": ["hw_thermal"], "temperature_c": 89,
           "power_w": 300.0, "uuid": "GPU-hot"}
    write_evidence(evidence_dir, [
        verdict(2, 4, host="node017", local_rank=2, attribution="gpu_stream_stall", gpu=hot),
        verdict(3, 4, host="node017", local_rank=3),
        verdict(2, 5, host="node017", local_rank=2, attribution="gpu_stream_stall", gpu=hot),  # said once
    ])
    (evidence_dir / evidence_files.STATUS_FILE).write_text(
        '{"nodes": [{"job_id": "%s", "host": "node017", "slow_ranks": [], "ranks": 4, "degraded": false}]}'
        % verdict(0, 0)["job_id"])
    page = html_report.build(evidence_dir, tmp_path / "out").html_path.read_text()
    first_look = page.split("<h2>What to look at first</h2>", 1)[1].split("<h2>", 1)[0]
    assert "node017: 2 of 4 ranks slow (2, 3): suspect the node, not a GPU" in first_look
    assert first_look.count("<tr>") == 3  # the header and one row per alert
    assert "SM clock 1410 MHz vs 1980 at its peers; hw_thermal throttling; 89 °C; 300 W" in first_look
    assert "gpu_throttled" in first_look and "runs at reduced clocks" in first_look
    assert "no GPU samples" in first_look


def test_a_report_without_alerts_has_no_first_look_section(tmp_path):
    evidence_dir = tmp_path / "evidence"
    write_evidence(evidence_dir, [verdict(0, 3, kind="uncertain", reason="below_absolute_floor")])
    assert "What to look at first" not in html_report.build(evidence_dir, tmp_path / "out").html_path.read_text()
