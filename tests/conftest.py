"""Session fixtures: one real nats-server, a tiny random checkpoint written to a temp dir, its HF reference."""

from __future__ import annotations

import os

# The suite runs a dozen or more CPU processes at once (every stack's services, the reference) on a
# couple of cores: each with one intra-op thread, not one per core that
# would spin against the others. Set before torch loads; inherited by every process the tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # GPU kernels run in Triton's interpreter on CPU
    try:
        import triton.runtime.interpreter as _interp

        _patch_tensor = _interp._patch_lang_tensor

        def _scalar_index(tensor, scope):
            # The interpreter keeps scalars as 1-element arrays; NumPy 2 no longer turns those into ints
            # implicitly, which breaks `range(start, stop)` over loaded scalars.
            _patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _scalar_index
    except ImportError:
        pass

from shared.model.tiny import write_tiny_checkpoint
from launcher.natsserver import EmbeddedNats
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
    running = RunningStack(nats_url, tiny_model).start(encoders=2, frontend_args=(
        "--max-output-tokens", "64", "--max-body-bytes", "4000000"))
    yield running
    running.stop()
