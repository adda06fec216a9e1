"""The engine and the engines the tests wrap around it offer every method the driver, the service
and replay call (engine_interface.DetectorEngine), checked on the classes, no type checker needed."""
from __future__ import annotations

from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.engine import Engine
from otel_straggler.detector.engine_interface import DetectorEngine, missing_methods


def test_engine_has_every_method_of_the_interface():
    assert missing_methods(Engine) == []
    assert isinstance(Engine(DetectorConfig()), DetectorEngine)


def test_a_class_lacking_a_method_is_told_apart():
    class Partial:
        def ingest_many(self, observations):
            return {}

        def stats(self):
            return {}

    missing = missing_methods(Partial)
    assert "advance" in missing and "inherit_alerts" in missing and "ingest_many" not in missing
    assert not isinstance(Partial(), DetectorEngine)


def test_the_interface_lists_what_the_driver_and_service_call():
    # every engine method the driver, the service and replay call, read from their source
    import ast
    import inspect

    from otel_straggler.detector import driver, replay, service
    called = set()
    for module in (driver, replay, service):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "engine"):
                called.add(node.attr)
    listed = {name for name in vars(DetectorEngine) if not name.startswith("_")}
    assert called and called <= listed, called - listed
