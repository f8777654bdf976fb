"""The options of every ``epd`` command, together: each one a user sets, documented, declared once."""

from __future__ import annotations

import re

from typing import get_args

from pydantic_settings import CliPositionalArg

from launcher import cli

MAX_OPTIONS = 100
POSITIONAL = get_args(CliPositionalArg)[1]  # the marker pydantic-settings leaves in a field's metadata
# what belongs in docs/benchmarks.md and docs/architecture.md's decisions, not in an option's description
MEASUREMENT = re.compile(r"\bH[12]00\b|benchmarks\.md|\bbench/\w+\.py|\d\s?(ms|µs)\b")


def options(settings: type) -> dict[str, object]:
    """``--flag`` name → its field (positional arguments are not options)."""
    return {name: field for name, field in settings.model_fields.items() if POSITIONAL not in field.metadata}


def every_option() -> dict[str, list[tuple[str, object]]]:
    """Option name → (command, field) for each command that takes it."""
    found: dict[str, list[tuple[str, object]]] = {}
    for command in cli.COMMANDS:
        for name, field in options(cli.settings_class(command)).items():
            found.setdefault(name, []).append((command, field))
    for action in cli.credentials_parser()._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                found.setdefault(flag[2:].replace("-", "_"), []).append(("credentials", None))
    return found


def test_every_epd_command_together_has_at_most_100_options():
    names = sorted(every_option())
    assert len(names) <= MAX_OPTIONS, f"{len(names)} options: {names}"


def test_every_option_says_what_it_does_without_figures():
    for name, uses in every_option().items():
        for command, field in uses:
            if field is None:
                continue
            assert field.description, f"epd {command} --{name.replace('_', '-')} has no description"
            assert not MEASUREMENT.search(field.description + " "), \
                f"epd {command} --{name.replace('_', '-')} quotes a measurement: {field.description!r}"


def test_an_option_several_commands_take_is_declared_once():
    """The same name means the same option (one field: its default and description) wherever it appears,
    except the few ``KEPT_APART``."""
    for name, uses in every_option().items():
        fields = {id(field): (command, field) for command, field in uses if field is not None}
        declared = {(f.annotation, repr(f.default), f.description) for _, f in fields.values()}
        if len(declared) > 1:
            commands = sorted({command for command, _ in fields.values()})
            assert name in KEPT_APART, f"--{name} is declared {len(declared)} times ({', '.join(commands)})"


KEPT_APART = {
    # one name, another meaning, in a tool that never shares a process with the others
    "gpus",  # epd plan: how many; epd up: which
    "request_rate",  # epd plan: the rates to predict; epd bench: the one to send
    "model", "timeout", "out",  # epd bench: the API's model name, a request's bound, its results file
    # the same option with another default where the command needs one
    "nats_url",  # epd up: empty starts an embedded server
    "max_num_seqs",  # epd plan's measuring engine: fewer graphs to capture
}
