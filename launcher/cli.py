"""The ``epd`` command: ``epd up`` runs the whole stack; ``epd <service>`` runs one service; ``epd bench`` and
``epd plan`` measure."""

from __future__ import annotations

import sys

USAGE = """usage: epd <command> [options]

commands:
  up         the whole stack on this machine (embedded NATS unless --nats-url; --topology
             aggregated|colocated|disaggregated, --pd joined|split, GPU placement per kind)
  encoder    a vision encoder
  language   a language-model worker that prefills and decodes (E/PD)
  prefill    a language-model prefill worker (E/P/D: streams KV to decode)
  decode     a language-model decode worker
  aggregated encoder + prefill + decode in one process and one engine (the baseline)
  frontend   the OpenAI-compatible HTTP gateway
  submit     send a chat request (JSON file or -) over NATS: answer, --stream chunks, or a --durable job
  bench      load generator for any OpenAI-compatible endpoint (`epd bench plot FILES` draws the results)
  plan       measure this model's encode/prefill/decode costs here and recommend a topology for a workload
  credentials  write per-role NATS users (a server authorization block + one env file per role)

`epd <command> --help` lists a command's options; every option is also an EPD_* environment variable.
"""


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if args else 2)
    command, rest = args[0], args[1:]
    from shared.settings import parse_settings

    if command == "up":
        from launcher.up import UpSettings, up

        sys.exit(up(parse_settings(UpSettings, rest, "epd up")))
    if command == "submit":
        sys.exit(submit(parse_settings(_submit_settings(), rest, "epd submit")))
    if command == "bench" and rest[:1] == ["plot"]:
        from tools.bench.plot import main as plot_main
        from tools.bench.settings import PlotSettings

        sys.exit(plot_main(parse_settings(PlotSettings, rest[1:], "epd bench plot")))
    if command == "bench":
        from tools.bench.runner import main as bench_main
        from tools.bench.settings import BenchSettings

        sys.exit(bench_main(parse_settings(BenchSettings, rest, "epd bench")))
    if command == "credentials":
        sys.exit(credentials(rest))
    if command == "plan":
        from tools.plan.plan import PlanSettings, main as plan_main

        sys.exit(plan_main(parse_settings(PlanSettings, rest, "epd plan")))
    services = {
        "encoder": ("services.encoder.service", "EncoderService", "services.encoder.settings", "EncoderSettings"),
        "prefill": ("services.prefill.service", "PrefillService", "services.prefill.settings", "PrefillSettings"),
        "decode": ("services.decode.service", "DecodeService", "services.decode.settings", "DecodeSettings"),
        "language": ("services.language.service", "LanguageService", "services.language.settings",
                     "LanguageSettings"),
        "aggregated": ("services.aggregated.service", "AggregatedService", "services.aggregated.settings",
                       "AggregatedSettings"),
        "frontend": ("services.frontend.service", "FrontendService", "services.frontend.settings",
                     "FrontendSettings"),
    }
    if command not in services:
        print(f"epd: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    import importlib

    from shared.service import service_main

    service_module, service_name, settings_module, settings_name = services[command]
    service_cls = getattr(importlib.import_module(service_module), service_name)
    settings_cls = getattr(importlib.import_module(settings_module), settings_name)
    service_main(service_cls, settings_cls, rest)


def credentials(args: list[str]) -> int:
    """``epd credentials --out DIR [--subject-prefix epd]``: per-role users for a NATS server you run."""
    import argparse

    from launcher.credentials import StackCredentials

    parser = argparse.ArgumentParser(prog="epd credentials", description=(
        "Generate a user per role (encoder, prefill, decode, language, aggregated, frontend, client, admin) with "
        "subject permissions limited to its work: DIR/nats-auth.conf goes into the nats-server "
        "configuration (`include`), DIR/<role>.env gives each process its EPD_NATS_USER/EPD_NATS_PASSWORD."))
    parser.add_argument("--out", required=True, help="directory for the files (created; files are mode 0600)")
    parser.add_argument("--subject-prefix", default="epd", help="the stack's subject prefix")
    options = parser.parse_args(args)
    for path in StackCredentials.generate(options.subject_prefix).write(options.out):
        print(path)
    return 0


def _submit_settings():
    """``epd submit``'s settings (built on first use: the other commands need not import them)."""
    from pydantic import Field
    from pydantic_settings import CliPositionalArg

    from shared.settings import CommonSettings

    class SubmitSettings(CommonSettings):
        file: CliPositionalArg[str] = Field(description="the chat request (OpenAI JSON body); - reads stdin")
        stream: bool = Field(False, description="print the chunks (JSON lines) as they come")
        durable: bool = Field(False, description="queue a durable JetStream job and print its id")
        wait: bool = Field(False, description="with --durable: wait for the job's result and print it")
        job_id: str = Field("", description="with --durable: the job's id; default: a new one")
        timeout: float = Field(300.0, gt=0, description="seconds to wait for the answer (per chunk with --stream)")

    return SubmitSettings


def submit(settings) -> int:
    """Send one chat request over NATS; answers go to stdout, an error body to stderr (exit 1)."""
    import asyncio
    import json

    from shared.client import ChatError, chat, chat_stream, submit_job, wait_result

    if settings.stream and settings.durable or (settings.wait or settings.job_id) and not settings.durable:
        print("epd submit: --stream is for direct requests; --wait and --job-id need --durable", file=sys.stderr)
        return 2
    text = sys.stdin.read() if settings.file == "-" else open(settings.file, encoding="utf-8").read()
    request, prefix, timeout = json.loads(text), settings.subject_prefix, settings.timeout

    async def run() -> None:
        import nats

        from shared.bus.subjects import Subjects

        nc = await nats.connect(name="epd-submit", connect_timeout=5, allow_reconnect=False,
                                inbox_prefix=Subjects(prefix).inbox("client"), **settings.nats_options())
        try:
            if settings.durable:
                job_id = await submit_job(nc, request, prefix, settings.job_id or None)
                print(json.dumps(await wait_result(nc, job_id, prefix, timeout)) if settings.wait else job_id)
            elif settings.stream:
                async for chunk in chat_stream(nc, request, prefix, timeout):
                    print(json.dumps(chunk), flush=True)
            else:
                print(json.dumps(await chat(nc, request, prefix, timeout)))
        finally:
            await nc.close()

    try:
        asyncio.run(run())
    except ChatError as err:
        print(json.dumps(err.body), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    main()
