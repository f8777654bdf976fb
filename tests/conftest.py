"""Session fixtures: one real nats-server, a tiny random checkpoint written to a temp dir, its HF reference."""

from __future__ import annotations

import pytest

from shared.model.tiny import write_tiny_checkpoint
from shared.natsserver import EmbeddedNats
from tests.support import Reference, RunningStack


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2_5_vl"))


@pytest.fixture(scope="session")
def reference(tiny_model):
    return Reference(tiny_model)


@pytest.fixture(scope="session")
def nats_server():
    with EmbeddedNats() as server:
        yield server


@pytest.fixture(scope="session")
def nats_url(nats_server):
    return nats_server.url


@pytest.fixture(scope="session")
def stack(nats_url, tiny_model):
    """Two encoders, one prefill, one decode, one frontend: the stack most end-to-end tests share."""
    running = RunningStack(nats_url, tiny_model).start(encoders=2)
    yield running
    running.stop()
