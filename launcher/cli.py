"""The ``epd`` command: ``epd up`` runs the whole stack; ``epd <service>`` runs one service; ``epd bench`` and
``epd plan`` measure. A bad option, value or combination is one line on stderr (what is wrong, what to do)
and exit status 2, for every command."""

from __future__ import annotations

import importlib
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


SERVICES = ("encoder", "language", "prefill", "decode", "aggregated", "frontend")

# command → its settings (its options and EPD_ variables) and what runs them ("module:name" each); a
# service runs through shared.service.service_main
COMMANDS = {
    "up": ("launcher.up:UpSettings", "launcher.up:up"),
    "submit": ("launcher.submit:SubmitSettings", "launcher.submit:submit"),
    "bench": ("tools.bench.settings:BenchSettings", "tools.bench.runner:main"),
    "bench plot": ("tools.bench.settings:PlotSettings", "tools.bench.plot:main"),
    "plan": ("tools.plan.plan:PlanSettings", "tools.plan.plan:main"),
    **{kind: (f"services.{kind}.settings:{kind.capitalize()}Settings",
              f"services.{kind}.service:{kind.capitalize()}Service") for kind in SERVICES},
}


def _load(name: str):
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)


def settings_class(command: str) -> type:
    """The settings ``epd <command>`` takes."""
    return _load(COMMANDS[command][0])


def main(argv: list[str] | None = None) -> None:
    from shared.settings import BadSettings

    try:
        run(sys.argv[1:] if argv is None else argv)
    except BadSettings as err:
        print(err, file=sys.stderr)
        sys.exit(2)


def run(args: list[str]) -> None:
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if args else 2)
    command, rest = args[0], args[1:]
    from shared.settings import BadSettings, parse_settings

    if command == "bench" and rest[:1] == ["plot"]:
        command, rest = "bench plot", rest[1:]
    if command == "credentials":
        sys.exit(credentials(rest))
    if command not in COMMANDS:
        known = ", ".join([c for c in COMMANDS if " " not in c] + ["credentials"])
        raise BadSettings(f"epd: unknown command {command!r}; the commands are {known} (epd --help)")
    main_of = _load(COMMANDS[command][1])
    if command in SERVICES:
        from shared.service import service_main

        service_main(main_of, settings_class(command), rest)
        return
    settings = parse_settings(settings_class(command), rest, f"epd {command}")
    if command == "plan":
        check_model(settings, "epd plan")
    sys.exit(main_of(settings))


def credentials(args: list[str]) -> int:
    """``epd credentials --out DIR [--subject-prefix epd]``: per-role users for a NATS server you run."""
    from launcher.credentials import StackCredentials

    options = credentials_parser().parse_args(args)
    for path in StackCredentials.generate(options.subject_prefix).write(options.out):
        print(path)
    return 0


def credentials_parser():
    import argparse

    from shared.settings import BadSettings

    class Parser(argparse.ArgumentParser):
        def error(self, message: str):
            raise BadSettings(f"epd credentials: {message} (`epd credentials --help` lists the options)")

    parser = Parser(prog="epd credentials", description=(
        "Generate a user per role (encoder, prefill, decode, language, aggregated, frontend, client, admin) with "
        "subject permissions limited to its work: DIR/nats-auth.conf goes into the nats-server "
        "configuration (`include`), DIR/<role>.env gives each process its EPD_NATS_USER/EPD_NATS_PASSWORD."))
    parser.add_argument("--out", required=True, help="directory for the files (created; files are mode 0600)")
    parser.add_argument("--subject-prefix", default="epd", help="the stack's subject prefix")
    return parser


def check_model(settings, prog: str) -> None:
    """``--model`` names a checkpoint directory or a preset (written once here, before anything starts)."""
    from shared.settings import BadSettings

    try:
        if settings.model:
            settings.model_path()
    except ValueError as err:
        raise BadSettings(f"{prog}: {err}") from None


if __name__ == "__main__":
    main()
