"""The hot path has two implementations with one behaviour: the C extension _hot_path, which runs
where it was built, and the Python reference in hot_path_reference.py, which runs where it was not. The
instrumentation tests run here with whichever is built; this runs them again with the Python one,
in a process where importing the extension fails as it does without a C compiler. Tests marked
`child_processes` are left out of that run: their rank code runs in children of their own, which
import the built extension whatever this process blocks."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from otel_straggler.instrumentation import hot_path

REPO = Path(__file__).resolve().parents[2]
WITHOUT_THE_EXTENSION = (
    "import sys; sys.modules['otel_straggler.instrumentation._hot_path'] = None; import pytest; "
    "code = pytest.main(sys.argv[1:]); "
    "from otel_straggler.instrumentation import hot_path; print('hot path:', hot_path.IMPLEMENTATION); "
    "sys.exit(code)"
)


def test_the_c_hot_path_is_built_in_ci():
    if os.environ.get("CI") != "true":
        pytest.skip("only CI promises a C compiler")
    assert hot_path.IMPLEMENTATION == "c"


def test_both_implementations_document_stage_and_step_alike():
    """The public API's documentation is written twice (tp_doc in C, the docstrings in Python)."""
    import re

    from otel_straggler.instrumentation import hot_path_reference

    built = pytest.importorskip("otel_straggler.instrumentation._hot_path")

    def words(doc: str) -> str:
        doc = " ".join(doc.replace("`", "").split())
        return re.sub(r" ?\(otel_straggler\.\w+; the C extension's \w+ has the same documentation\.\)", "", doc)

    assert words(hot_path_reference.Stage.__doc__) == words(built.Stage.__doc__)
    assert words(hot_path_reference.Step.__doc__) == words(built.Step.__doc__)


@pytest.mark.slow
def test_the_python_reference_passes_the_instrumentation_tests():
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_THE_EXTENSION, "-q", "-p", "no:cacheprovider", "-m",
         "not services and not slow and not child_processes",
         "--ignore", str(Path(__file__).relative_to(REPO)), "tests/instrumentation"],
        # without CI=true: the tests that need the extension there skip, as where it is not built
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={name: value for name, value in os.environ.items() if name != "CI"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "hot path: python" in result.stdout
    assert " passed" in result.stdout and " failed" not in result.stdout
