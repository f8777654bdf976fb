"""The ``epd`` command: ``epd up`` runs the whole stack; ``epd <service>`` runs one service."""

from __future__ import annotations

import sys

USAGE = """usage: epd <command> [options]

commands:
  up         the whole stack on this machine (embedded NATS unless --nats-url)
  encoder    a vision encoder
  prefill    a language-model prefill worker
  decode     a language-model decode worker
  frontend   the OpenAI-compatible HTTP gateway

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
        from services.stack import UpSettings, up

        sys.exit(up(parse_settings(UpSettings, rest, "epd up")))
    services = {
        "encoder": ("services.encoder.service", "EncoderService", "services.encoder.settings", "EncoderSettings"),
        "prefill": ("services.prefill.service", "PrefillService", "services.prefill.settings", "PrefillSettings"),
        "decode": ("services.decode.service", "DecodeService", "services.decode.settings", "DecodeSettings"),
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


if __name__ == "__main__":
    main()
