"""Which hot path this process runs: the C extension _hot_path where it was built, else the
Python reference in hot_path_reference.py. Both have the same IntervalRecorder, Stage, Step,
install() and use_clock(), and the instrumentation tests run against both
(tests/instrumentation/test_recorder.py, test_hot_path_implementations.py). The layout of the
records both append is hot_path_reference's.
"""
from __future__ import annotations

try:
    from otel_straggler.instrumentation import _hot_path as _implementation

    IMPLEMENTATION = "c"
except ImportError:  # not built: no C compiler where the package was installed
    # the same API as the extension's (its stub re-exports this module's)
    from otel_straggler.instrumentation import hot_path_reference as _implementation  # type: ignore[no-redef]

    IMPLEMENTATION = "python"

IntervalRecorder = _implementation.IntervalRecorder
Stage = _implementation.Stage
Step = _implementation.Step
install = _implementation.install
use_clock = _implementation.use_clock  # tests only: a fake clock
