"""Property-based tests of the HTTP API from its own OpenAPI schema (schemathesis): whatever a client
sends — valid or not — it gets an answer below 500, in time, with an OpenAI-style error body."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings


def operations(stack):
    base = f"http://127.0.0.1:{stack.port}"
    schema = schemathesis.openapi.from_dict(httpx.get(f"{base}/openapi.json", timeout=10).json())
    return base, [result.ok() for result in schema.get_all_operations()]


def test_every_operation_answers_below_500(stack):
    base, ops = operations(stack)
    assert {op.label for op in ops} >= {"POST /v1/chat/completions", "GET /v1/models"}
    for op in ops:
        @given(case=op.as_strategy())
        @settings(max_examples=25 if op.method.upper() == "POST" else 5, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            response = case.call(base_url=base, timeout=60)
            assert response.status_code < 500, f"{op.label} {response.status_code}: {response.text[:300]}"
            if response.status_code >= 400:
                assert "error" in response.json()

        check()


@pytest.mark.parametrize("body", [b"", b"[]", b"null", b'{"messages": "hi"}', b"\xff\xfe", b'{"messages":[' * 500])
def test_malformed_bodies(stack, body):
    response = httpx.post(f"{stack.base_url}/chat/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["message"]
