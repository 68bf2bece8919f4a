"""Log formats, byte formatting and the CLI's structure."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import io
import json
import logging
from pathlib import Path

import pytest

from moe_sidecar import cli
from moe_sidecar.core.defaults import BOOLEAN_FORMS, parse_bool
from moe_sidecar.core.group import summarize
from moe_sidecar.logs import LOGGER_NAME, configure_logging, resolve_log_format
from moe_sidecar.store.row_codec import decode_group
from moe_sidecar.wire import display

pytestmark = pytest.mark.timeout(10)

DATA = Path(__file__).resolve().parent.parent / "data"


@pytest.fixture
def restore_logger() -> object:
    logger = logging.getLogger(LOGGER_NAME)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield logger
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def test_json_lines_carry_the_decision_fields(restore_logger: object) -> None:
    stream = io.StringIO()
    configure_logging("json", "INFO", stream)
    configure_logging("json", "INFO", stream)  # not twice the lines
    logging.getLogger("moe_sidecar.state").info(
        "round decided", extra={"group": "g", "round": 3, "ranks": [0, 1], "layer": "mtp"}
    )
    logging.getLogger("moe_sidecar.state").debug("hidden")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["message"] == "round decided" and record["level"] == "INFO"
    assert (record["group"], record["round"], record["ranks"], record["layer"]) == (
        "g",
        3,
        [0, 1],
        "mtp",
    )
    assert record["logger"] == "moe_sidecar.state" and record["time"].endswith("Z")


def test_text_lines_and_tracebacks(restore_logger: object) -> None:
    stream = io.StringIO()
    configure_logging("text", "DEBUG", stream)
    try:
        raise ValueError("bad")
    except ValueError:
        logging.getLogger("moe_sidecar.x").exception("failed", extra={"group": "g"})
    text = stream.getvalue()
    assert "ERROR   moe_sidecar.x: failed group='g'" in text
    assert "ValueError: bad" in text
    with pytest.raises(ValueError, match="log_format='xml'"):
        configure_logging("xml", "INFO", stream)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (30_000, "29.3 KiB"),
        (3 * 1024**2 // 2, "1.5 MiB"),
        (2 * 1024**3, "2.0 GiB"),
        (1 << 40, "1.0 TiB"),
        (1 << 50, "1024.0 TiB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert display.format_bytes(n) == text


def test_format_groups_without_groups() -> None:
    assert display.format_groups([]) == "no groups\n"


def test_groups_show_where_and_when_each_plan_was_made() -> None:
    # The v3 golden row: generation 1 grown on node-a, merged into node-b, grown there.
    state = decode_group((DATA / "group-row-v3.json").read_text())
    summary = summarize(state)
    text = display.format_groups([summary])
    assert "  plan from: node node-b at 2023-11-14 22:13:22Z" in text
    assert (
        "caused by layer 'l0' on rank 0 in round 1, on node node-a at 2023-11-14 22:13:20Z" in text
    )
    [document] = display.groups_as_json([summary])
    assert document["plan"]["origin"] == {"node": "node-b", "time": "2023-11-14 22:13:22Z"}
    assert [h["node"] for h in document["history"]] == ["node-a", "node-b"]
    # A plan made before nodes were recorded (a version 2 row) says so.
    old = summarize(decode_group((DATA / "group-row-v2.json").read_text()))
    assert "plan from: an unrecorded node at" in display.format_groups([old])


def test_groups_show_a_rank_whose_session_ended_and_why() -> None:
    state = decode_group((DATA / "group-row-v3.json").read_text())
    gone = "its session stream closed (the process exited, was killed, or lost its connection)"
    ranks = tuple(dataclasses.replace(r, left=gone) if r.ep_rank == 3 else r for r in state.ranks)
    summary = summarize(dataclasses.replace(state, ranks=ranks))
    assert [r.current for r in summary.ranks] == [True, True]
    rows = display.format_groups([summary]).splitlines()
    [left] = [i for i, line in enumerate(rows) if line.lstrip().startswith("3  left")]
    assert rows[left + 1] == f"          gone: {gone}"
    assert any(line.lstrip().startswith("2  yes") for line in rows)
    [document] = display.groups_as_json([summary])
    assert [r["left"] for r in document["ranks"]] == ["", gone]


def test_a_subcommand_is_one_command_entry(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[int] = []

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--n", type=int, default=1)

    def run(args: argparse.Namespace) -> int:
        seen.append(args.n)
        return 0

    extra = cli.Command(
        name="probe",
        help="a command added the way simulate will be",
        add_arguments=add_arguments,
        run=run,
    )
    parser = cli.build_parser((*cli.COMMANDS, extra))
    args = parser.parse_args(["probe", "--n", "7"])
    assert args.run(args) == 0 and seen == [7]
    assert [c.name for c in cli.COMMANDS][:2] == ["serve", "groups"]


def test_version_prints_the_installed_release(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"moe-sidecar {importlib.metadata.version('moe-sidecar')}\n"


def test_no_command_lists_the_commands_and_says_how_to_serve(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    for command in cli.COMMANDS:
        assert f"    {command.name}" in err
    assert err.rstrip().endswith(
        "moe-sidecar: name a command; `moe-sidecar serve --state-dir ./state` runs the sidecar"
    )


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_log_format_is_text_on_a_terminal_and_json_elsewhere() -> None:
    assert resolve_log_format("auto", _Terminal()) == "text"
    assert resolve_log_format("auto", io.StringIO()) == "json"
    assert resolve_log_format("json", _Terminal()) == "json"
    with pytest.raises(ValueError, match="log_format='xml'"):
        resolve_log_format("xml", io.StringIO())


@pytest.mark.parametrize(
    ("text", "value"), [("1", True), ("TRUE", True), ("yes", True), ("On", True), ("0", False),
                        ("false", False), (" no ", False), ("off", False)],
)  # fmt: skip
def test_one_boolean_rule(text: str, value: bool) -> None:
    assert parse_bool(text) is value


@pytest.mark.parametrize("text", ["", "2", "y", "enabled"])
def test_the_boolean_rule_names_its_forms(text: str) -> None:
    with pytest.raises(ValueError, match=f"expected {BOOLEAN_FORMS}"):
        parse_bool(text)
