"""``epd up --topology aggregated`` with two workers that encode in place, under faults: either one killed
(-9) while image requests run — before it took some of them (their pixels go to the other), with others
parked or decoding (resumed there). Every admitted request ends with the exact greedy answer, and the
stack restarts the worker. Driven from the outside, as tests/test_up_faults.py does."""

from __future__ import annotations

import signal

import pytest

from tests.support import make_image
from tests.test_up_faults import burst, exact_answers
from tests.up_stack import UpStack


@pytest.fixture(scope="module")
def up(tiny_model):
    stack = UpStack(tiny_model, "--topology", "aggregated", "--aggregated", "2",
                    env={"EPD_DRAIN_SECONDS": "20", "EPD_ENCODER_CACHE_MB": "0"})
    yield stack
    assert stack.stop() == 0


@pytest.fixture(scope="module")
def want(reference):
    # computed before the bursts: the kill must land while requests run
    return exact_answers(reference, [make_image(600 + i, 64 + 8 * i, 56) for i in range(4)], ahead=True)


@pytest.mark.parametrize("index", [0, 1])
def test_an_aggregated_worker_killed_under_load_loses_nothing_and_is_restarted(up, want, index):
    up.wait_for_workers("aggregated", 2)
    died = up.count("stack.worker_died")
    burst(up, want, 10, lambda: up.signal("aggregated", signal.SIGKILL, index), after=0.25, stream=index == 0)
    up.wait_for_workers("aggregated", 2)
    assert up.count("stack.worker_died") == died + 1
    up.wait_idle()
