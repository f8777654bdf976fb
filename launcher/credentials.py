"""Credentials and per-role permissions for the NATS server `epd up` embeds.

Every role gets its own user with a random password and may publish and subscribe only on the subjects
its work needs (plus the NATS service API for the service roles, and its own inbox for replies). An
unauthenticated client is refused. The ``client`` role (``epd submit`` and other NATS API callers) is one
trust domain: callers sharing its user share its inbox and results subjects; callers that must not see
each other's answers use the HTTP API or stacks of their own.
For an external server, put the same users in its configuration (``server_config`` prints it) or use
nkeys/creds files via ``--nats-creds``.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from shared.client import JOB_CONSUMER, JobStreams
from shared.embedding_index import bucket_name

ROLES = ("encoder", "prefill", "decode", "language", "aggregated", "frontend", "client", "admin")
SERVICE_ROLES = ("encoder", "prefill", "decode", "language", "aggregated", "frontend")


def _stream_read(stream: str) -> list[str]:
    """Look a stream up and read messages from it (by subject or sequence)."""
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>"]


def _stream_own(stream: str) -> list[str]:
    """What the role that owns a stream needs beside reading it: create it, bring its limits up to date."""
    return [*_stream_read(stream), f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.UPDATE.{stream}"]


def _consume(stream: str, durable: str) -> list[str]:
    """A durable pull consumer on ``stream``: create it, look it up, fetch, ack."""
    return [f"$JS.API.CONSUMER.CREATE.{stream}.>", f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
            f"$JS.API.CONSUMER.INFO.{stream}.{durable}", f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}",
            f"$JS.ACK.{stream}.>", "$JS.FC.>"]


def role_permissions(role: str, prefix: str) -> dict[str, list[str]]:
    """Publish and subscribe allow-lists of ``role``. Replies to requests a role receives are allowed by
    ``allow_responses``; replies it receives land on its own inbox prefix (``Subjects.inbox``), which no
    other role may subscribe to. JetStream: only the API subjects of the streams its work touches, never
    another stream's, never a stream listing, purge or delete — only admin has those."""
    p = prefix
    streams = JobStreams(prefix)
    jobs, results, index, durable = streams.jobs, streams.results, bucket_name(prefix), JOB_CONSUMER
    index_stream = f"KV_{index}"
    index_write = [*_stream_own(index_stream), f"$KV.{index}.>"]  # encoders create and write the index
    index_read = [*_stream_read(index_stream)]  # the frontend routes by it
    table = {
        "encoder": dict(pub=[f"{p}.encode.>", *index_write], sub=[f"{p}.encode", f"{p}.encode.>", f"{p}.cancel"]),
        "prefill": dict(pub=[f"{p}.decode", f"{p}.decode.>", f"{p}.stream.>", f"{p}.cancel", "$SRV.>"],
                        sub=[f"{p}.prefill", f"{p}.prefill.>", f"{p}.cancel"]),
        "decode": dict(pub=[f"{p}.stream.>", "$SRV.PING.epd-prefill.>"],  # is a reservation's prefill alive
                       sub=[f"{p}.decode", f"{p}.decode.>", f"{p}.cancel"]),
        "language": dict(pub=[f"{p}.stream.>"], sub=[f"{p}.prefill", f"{p}.prefill.>", f"{p}.cancel"]),
        "aggregated": dict(pub=[f"{p}.stream.>", f"{p}.encode.>", *index_write],
                           sub=[f"{p}.encode", f"{p}.encode.>", f"{p}.prefill", f"{p}.prefill.>", f"{p}.cancel"]),
        "frontend": dict(pub=[f"{p}.encode", f"{p}.encode.>", f"{p}.prefill", f"{p}.prefill.>", f"{p}.cancel",
                              f"{p}.results.>", "$SRV.>", *_stream_own(jobs), *_consume(jobs, durable),
                              *_stream_own(results), *index_read],
                         sub=[f"{p}.stream.>", f"{p}.chat"]),
        "client": dict(pub=[f"{p}.chat", f"{p}.jobs.submit", f"$JS.API.STREAM.INFO.{jobs}", *_stream_read(results)],
                       sub=[f"{p}.results.>"]),
        "admin": dict(pub=[">"], sub=[">"]),
    }
    if role not in table:
        raise ValueError(f"unknown NATS role {role!r}")
    entry = table[role]
    inbox = f"_INBOX.{p}.{role}.>" if role != "admin" else "_INBOX.>"
    service_api = ["$SRV.>"] if role in SERVICE_ROLES else []  # answering PING/INFO/STATS as a service
    return {"publish": entry["pub"], "subscribe": [*entry["sub"], *service_api, inbox]}


@dataclass(frozen=True)
class StackCredentials:
    prefix: str
    passwords: dict[str, str]

    @classmethod
    def generate(cls, prefix: str) -> "StackCredentials":
        return cls(prefix, {role: secrets.token_urlsafe(24) for role in ROLES})

    def env(self, role: str) -> dict[str, str]:
        """The ``EPD_*`` variables a process of this role connects with."""
        return {"EPD_NATS_USER": role, "EPD_NATS_PASSWORD": self.passwords[role]}

    def server_config(self) -> str:
        """An ``authorization`` block for nats-server's configuration file."""
        users = []
        for role, password in self.passwords.items():
            perms = role_permissions(role, self.prefix)
            users.append(
                f"{{ user: {json.dumps(role)}, password: {json.dumps(password)}, permissions: {{ "
                f"publish: {{ allow: {json.dumps(perms['publish'])} }}, "
                f"subscribe: {{ allow: {json.dumps(perms['subscribe'])} }}, "
                f"allow_responses: true }} }}"
            )
        return "authorization {\n  users: [\n    " + ",\n    ".join(users) + "\n  ]\n}\n"

    def write(self, directory) -> list:
        """``nats-auth.conf`` (the server's authorization block) and one ``<role>.env`` per role, mode 0600."""
        from pathlib import Path

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for name, text in [("nats-auth.conf", self.server_config())] + [
                (f"{role}.env", "".join(f"{k}={v}\n" for k, v in self.env(role).items())) for role in ROLES]:
            path = out / name
            path.touch(mode=0o600)
            path.chmod(0o600)
            path.write_text(text)
            written.append(path)
        return written

