"""The port pickers behind every test service and the demo's MASTER_PORT."""

from __future__ import annotations

import socket

import pytest

from otel_straggler.demo import launcher

from . import services


@pytest.mark.parametrize("module", [services, launcher], ids=["services", "demo-launcher"])
def test_ports_are_bindable_unique_and_outside_the_ephemeral_range(module):
    ephemeral = module.ephemeral_port_range()
    ports = [module.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports), "a port was handed out twice"
    assert not [port for port in ports if port in ephemeral], f"ephemeral range {ephemeral}"
    for port in ports[:20]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("127.0.0.1", port))


@pytest.mark.parametrize("module", [services, launcher], ids=["services", "demo-launcher"])
def test_a_port_in_use_is_skipped(module, monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken, \
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as spare:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        spare.bind(("127.0.0.1", 0))
        draws = iter([taken.getsockname()[1], spare.getsockname()[1]])
        spare_port = spare.getsockname()[1]
        spare.close()
        monkeypatch.setattr(module.random, "randrange", lambda low, high: next(draws))
        assert module.free_port() == spare_port
