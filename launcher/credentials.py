"""Credentials and per-role permissions for the NATS server `epd up` embeds.

Every role gets its own user with a random password and may publish and subscribe only on the subjects
its work needs (plus the NATS service API and request replies). An unauthenticated client is refused.
For an external server, put the same users in its configuration (``server_config`` prints it) or use
nkeys/creds files via ``--nats-creds``.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

ROLES = ("encoder", "prefill", "decode", "frontend", "aggregated", "client", "admin")

# Everyone: the service API (registration, discovery, stats) and replies to its own requests.
_COMMON_SUB = ["$SRV.>", "_INBOX.>"]
_COMMON_PUB = ["$SRV.>"]
# JetStream (the frontend's durable jobs, the encoders' cache index).
_JETSTREAM = ["$JS.API.>", "$JS.ACK.>", "$JS.FC.>", "$KV.>"]


def role_permissions(role: str, prefix: str) -> dict[str, list[str]]:
    p = prefix
    table = {
        "encoder": dict(pub=[f"{p}.encode.>", *_JETSTREAM], sub=[f"{p}.encode", f"{p}.encode.>", f"{p}.cancel"]),
        "prefill": dict(pub=[f"{p}.decode", f"{p}.decode.>", f"{p}.stream.>", f"{p}.cancel"],
                        sub=[f"{p}.prefill", f"{p}.cancel"]),
        "decode": dict(pub=[f"{p}.stream.>"], sub=[f"{p}.decode", f"{p}.decode.>", f"{p}.cancel"]),
        "frontend": dict(pub=[f"{p}.encode", f"{p}.encode.>", f"{p}.prefill", f"{p}.cancel", f"{p}.results.>",
                              *_JETSTREAM],
                         sub=[f"{p}.stream.>", f"{p}.chat", f"{p}.jobs.>", *_JETSTREAM]),
        "aggregated": dict(pub=[f"{p}.stream.>", f"{p}.encode.>", *_JETSTREAM],
                           sub=[f"{p}.encode", f"{p}.encode.>", f"{p}.prefill", f"{p}.cancel"]),
        "client": dict(pub=[f"{p}.chat", f"{p}.jobs.submit", *_JETSTREAM], sub=[f"{p}.results.>"]),
        "admin": dict(pub=[">"], sub=[">"]),
    }
    if role not in table:
        raise ValueError(f"unknown NATS role {role!r}")
    entry = table[role]
    return {"publish": entry["pub"] + _COMMON_PUB, "subscribe": entry["sub"] + _COMMON_SUB}


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

