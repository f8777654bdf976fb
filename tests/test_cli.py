"""The ``epd`` command answers a bad option, value or combination with one line (what is wrong, what to do)
on stderr and exit status 2 — every command, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launcher.cli import main

BAD = [
    (["up", "--pd", "joined", "--prefills", "2"], "epd up: --prefills is for --pd split; --pd joined runs "
                                                  "--languages N"),
    (["up", "--no-such-option"], "epd up: unrecognized arguments: --no-such-option (`epd up --help` lists the "
                                 "options)"),
    (["up", "--port", "http"], "epd up: --port (EPD_PORT) 'http': Input should be a valid integer"),
    (["up", "--encoders", "3:1"], "epd up: --encoders '3:1': need 0 <= MIN <= MAX"),
    (["up", "--mps-shares", "encoder"], "epd up: --mps-shares 'encoder': use KIND=PERCENT pairs"),
    (["up", "--model", "/no/such/checkpoint"], "epd up: --model '/no/such/checkpoint' is not a checkpoint directory"),
    (["encoder", "--encoder-cache-mb", "-1"], "epd encoder: --encoder-cache-mb (EPD_ENCODER_CACHE_MB) '-1': Input "
                                              "should be greater than or equal to 0"),
    (["language", "--bogus"], "epd language: unrecognized arguments: --bogus"),
    (["prefill", "--model", "/no/such/checkpoint"], "epd prefill: --model '/no/such/checkpoint' is not a checkpoint"),
    (["decode", "--log-level", "loud"], "epd decode: --log-level (EPD_LOG_LEVEL) 'loud': Input should be"),
    (["aggregated", "--drain-seconds", "-1"], "epd aggregated: --drain-seconds (EPD_DRAIN_SECONDS) '-1': Input"),
    (["frontend", "--worker-wait", "-1"], "epd frontend: --worker-wait (EPD_WORKER_WAIT) '-1': Input should be "
                                          "greater than or equal to 0"),
    (["submit"], "epd submit: the following arguments are required: FILE"),
    (["submit", "/no/such/request.json"], "epd submit: cannot read /no/such/request.json: No such file or directory"),
    (["submit", "--stream", "--durable", "-"], "epd submit: --stream is for direct requests; --wait needs --durable"),
    (["bench", "--request-rate", "0"], "epd bench: --request-rate (EPD_REQUEST_RATE) '0': Input should be greater"),
    (["bench", "plot"], "epd bench plot: the following arguments are required: FILES"),
    (["plan", "--model", "/no/such/checkpoint"], "epd plan: --model '/no/such/checkpoint' is not a checkpoint"),
    (["credentials"], "epd credentials: the following arguments are required: --out"),
    (["serve"], "epd: unknown command 'serve'; the commands are up, submit, bench, plan, encoder,"),
]


@pytest.mark.parametrize("args,said", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_option_is_one_line_and_exit_status_2(args, said, capsys, monkeypatch):
    for key in [k for k in os.environ if k.startswith("EPD_")]:
        monkeypatch.delenv(key)
    with pytest.raises(SystemExit) as exit:
        main(args)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith(said) and err.count("\n") == 1, err


def test_the_command_line_itself_prints_one_line_not_a_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    request = tmp_path / "request.json"
    request.write_text("{not json")
    for args, said in ((["up", "--pd", "joined", "--prefills", "2"], "epd up: --prefills is for --pd split"),
                       (["submit", str(request)], f"epd submit: {request} is not a JSON request body")):
        done = subprocess.run([sys.executable, "-m", "launcher.cli", *args], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and done.stderr.startswith(said) and done.stderr.count("\n") == 1, done.stderr
