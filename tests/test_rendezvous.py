"""The rendezvous port: free, and picked where outgoing connections cannot take it meanwhile."""

from __future__ import annotations

import socket
import subprocess
import sys

from megatron_quads.trainer import rendezvous


def test_free_ports_come_from_below_the_ephemeral_range(monkeypatch):
    """A rendezvous port is picked where outgoing connections cannot take it meanwhile, and is free;
    with no room below the range the kernel picks one."""
    monkeypatch.setattr(rendezvous, "_ephemeral_port_range", lambda: (40000, 60999))
    ports = {rendezvous.find_free_port() for _ in range(8)}
    assert all(10000 <= p < 40000 for p in ports) and len(ports) > 1
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
    monkeypatch.setattr(rendezvous, "_ephemeral_port_range", lambda: (1024, 60999))
    assert rendezvous.find_free_port() >= 1024


def test_the_ephemeral_range_is_read():
    low, high = rendezvous._ephemeral_port_range()
    assert 1024 <= low < high <= 65535


def test_the_module_needs_no_torch():
    """Every layer that starts a process group (trainer, convert, controller) imports it cheaply."""
    code = "import sys, megatron_quads.trainer.rendezvous; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
