"""Types of the C extension _hot_path.c: the same API as its Python reference, which the
instrumentation tests hold it to (test_hot_path_implementations.py)."""
from otel_straggler.instrumentation.hot_path_reference import IntervalRecorder as IntervalRecorder
from otel_straggler.instrumentation.hot_path_reference import Stage as Stage
from otel_straggler.instrumentation.hot_path_reference import Step as Step
from otel_straggler.instrumentation.hot_path_reference import install as install
from otel_straggler.instrumentation.hot_path_reference import use_clock as use_clock
