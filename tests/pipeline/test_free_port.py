"""The port picker behind every test service and the demo's MASTER_PORT (otel_straggler/demo/ports.py)."""

from __future__ import annotations

import socket

from otel_straggler.demo import launcher, ports

from otel_straggler.testing import services


def test_the_demo_and_the_test_services_use_the_same_picker():
    assert launcher.free_port is ports.free_port
    assert services.free_port.__code__.co_filename == ports.__file__  # services.py loads the file by path


def test_ports_are_bindable_unique_and_outside_the_ephemeral_range():
    ephemeral = ports.ephemeral_port_range()
    picked = [ports.free_port() for _ in range(300)]
    assert len(set(picked)) == len(picked), "a port was handed out twice"
    assert not [port for port in picked if port in ephemeral], f"ephemeral range {ephemeral}"
    for port in picked[:20]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("127.0.0.1", port))


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken, \
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as spare:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        spare.bind(("127.0.0.1", 0))
        draws = iter([taken.getsockname()[1], spare.getsockname()[1]])
        spare_port = spare.getsockname()[1]
        spare.close()
        monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(draws))
        assert ports.free_port() == spare_port
