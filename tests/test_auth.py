"""The embedded NATS server with generated credentials: who may connect, publish and subscribe where."""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.errors import NoServersError

from launcher.credentials import StackCredentials
from launcher.natsserver import EmbeddedNats
from shared.bus.subjects import Subjects
from tests.support import settled

PREFIX = "sec"


@pytest.fixture(scope="module")
def secured():
    creds = StackCredentials.generate(PREFIX)
    with EmbeddedNats(config_text=creds.server_config()) as server:
        yield server.url, creds


async def connect(url, creds=None, role=None, password=None, **kwargs):
    auth = {}
    if role:
        auth = {"user": role, "password": password or creds.passwords[role]}
    return await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2, **auth,
                              **kwargs)


async def test_unauthenticated_and_wrong_password_are_refused(secured):
    url, creds = secured
    for kwargs in ({}, {"role": "decode", "password": "not-the-password"}):
        with pytest.raises((NoServersError, nats.errors.Error, OSError)):
            await connect(url, creds, **kwargs)


async def test_roles_publish_only_on_their_subjects(secured):
    url, creds = secured
    admin = await connect(url, creds, "admin")
    decode = await connect(url, creds, "decode")
    try:
        to_prefill = await admin.subscribe(f"{PREFIX}.prefill")
        to_stream = await admin.subscribe(f"{PREFIX}.stream.r1")
        pinged = await admin.subscribe("$SRV.PING.epd-prefill.prefill-0a1b2c3d4e5f")  # is its KV's sender alive
        listed = await admin.subscribe("$SRV.STATS")
        await settled(admin)
        await decode.publish(f"{PREFIX}.prefill", b"not allowed")
        await decode.publish("$SRV.STATS", b"not allowed")
        await decode.publish(f"{PREFIX}.stream.r1", b"allowed")
        await decode.publish("$SRV.PING.epd-prefill.prefill-0a1b2c3d4e5f", b"allowed")
        await settled(decode)
        assert (await to_stream.next_msg(timeout=10)).data == b"allowed"
        assert (await pinged.next_msg(timeout=10)).data == b"allowed"
        for refused in (to_prefill, listed):
            with pytest.raises(asyncio.TimeoutError):
                await refused.next_msg(timeout=0.5)
    finally:
        await decode.close()
        await admin.close()


async def test_roles_subscribe_only_on_their_subjects(secured):
    url, creds = secured
    errors: list[Exception] = []

    async def on_error(err):
        errors.append(err)

    frontend = await connect(url, creds, "frontend", error_cb=on_error)
    admin = await connect(url, creds, "admin")
    try:
        spy = await frontend.subscribe(f"{PREFIX}.decode.some-worker.kv")  # KV chunks are not its business
        await settled(frontend)
        await admin.publish(f"{PREFIX}.decode.some-worker.kv", b"secret")
        await settled(admin)
        with pytest.raises(asyncio.TimeoutError):
            await spy.next_msg(timeout=0.5)
        assert any("permissions violation" in str(e).lower() for e in errors)
    finally:
        await frontend.close()
        await admin.close()


async def test_the_frontend_looks_prompts_up_on_every_intake_role(secured):
    """A prompt's prefix lookup reaches a language, prefill or aggregated worker from the frontend and is
    answered; a client may not ask."""
    url, creds = secured
    roles = ("language", "prefill", "aggregated")
    frontend = await connect(url, creds, "frontend", inbox_prefix=Subjects(PREFIX).inbox("frontend"))
    client = await connect(url, creds, "client", inbox_prefix=Subjects(PREFIX).inbox("client"))
    workers = [await connect(url, creds, role) for role in roles]
    try:
        async def answer(msg):
            await msg.respond(b"found")

        for role, worker in zip(roles, workers):
            await worker.subscribe(Subjects(PREFIX).prefix_lookup(f"{role}-0a1b2c3d4e5f"), cb=answer)
            await settled(worker)
        for role in roles:
            subject = Subjects(PREFIX).prefix_lookup(f"{role}-0a1b2c3d4e5f")
            assert (await frontend.request(subject, b"hashes", timeout=2)).data == b"found", role
            with pytest.raises((nats.errors.Error, asyncio.TimeoutError)):
                await client.request(subject, b"hashes", timeout=0.5)
    finally:
        for connection in (*workers, client, frontend):
            await connection.close()


def test_credentials_command_and_compose_overlay(tmp_path):
    """`epd credentials` writes what deploy/compose.auth.yml mounts, and nats-server accepts it."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from launcher.natsserver import nats_server_binary

    out = tmp_path / "secrets"
    subprocess.run([sys.executable, "-m", "launcher.cli", "credentials", "--out", str(out)], check=True,
                   capture_output=True)
    assert all((p.stat().st_mode & 0o777) == 0o600 for p in out.iterdir())
    overlay = yaml.safe_load((Path(__file__).parents[1] / "deploy" / "compose.auth.yml").read_text())
    for name, service in overlay["services"].items():
        for env_file in service.get("env_file", []):
            assert (out / Path(env_file).name).is_file(), env_file
            assert Path(env_file).stem == name  # each service runs as its own role
    secret = Path(overlay["secrets"]["nats-auth"]["file"])  # epd-nats passes it to nats-server as -c
    assert (out / secret.name).is_file(), secret
    check = subprocess.run([nats_server_binary(), "-t", "-c", str(out / secret.name)], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stderr


async def test_services_connect_to_a_tls_server_with_its_ca(tmp_path):
    """`--nats-tls-ca` (EPD_NATS_TLS_CA) verifies an external server's certificate."""
    import shutil
    import subprocess

    from shared.bus.connection import connect
    from shared.settings import CommonSettings

    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed: cannot make a certificate")

    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=epd test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=localhost")
    (tmp_path / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "1", "-extfile", "san.ext")
    tls = f'tls {{ cert_file: "{tmp_path}/server.pem", key_file: "{tmp_path}/server.key" }}'
    with EmbeddedNats(config_text=tls, jetstream=False) as server:
        url = server.url.replace("nats://", "tls://")
        nc = await connect(CommonSettings(nats_url=url, nats_tls_ca=str(tmp_path / "ca.pem")), "tls-test", "encoder")
        assert nc.is_connected
        await nc.close()
        with pytest.raises(Exception):  # without the CA the certificate does not verify
            await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2,
                               tls=__import__("ssl").create_default_context())
