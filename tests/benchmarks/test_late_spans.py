"""late_spans.py's case syntax: a bad case is refused with the syntax it wants."""
from __future__ import annotations

import pytest

import late_spans


def test_a_case_reads_step_schedule_windows_and_an_optional_start_spread():
    assert late_spans.Case.parse("20:5000:10") == late_spans.Case(20.0, 5000, 10, 0.0)
    assert late_spans.Case.parse("100:5000:10:5").start_spread_s == 5.0


def test_a_malformed_case_is_refused_with_its_syntax(capsys):
    with pytest.raises(SystemExit):
        late_spans.main(["--cases", "20:500"])
    assert "STEP_MS:DELAY_MS:WINDOW_STEPS[:START_SPREAD_S], not '20:500'" in capsys.readouterr().err
