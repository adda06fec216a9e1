"""The settings tables in the docs are generated from the settings themselves; these tests fail
when a setting changes and the docs were not regenerated (`python -m otel_straggler.settings_doc`)."""
from pathlib import Path

from otel_straggler.settings_doc import table

REPO = Path(__file__).resolve().parent.parent


def test_readme_lists_every_rank_setting_as_generated():
    assert table("rank") in (REPO / "docs" / "instrumentation.md").read_text()


def test_detector_docs_list_every_detector_setting_as_generated():
    assert table("detector") in (REPO / "docs" / "detector.md").read_text()
