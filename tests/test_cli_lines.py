"""Progress off a terminal: a command's phases are lines on stderr where rich's spinner draws nothing
(output piped or redirected), and nothing under ``--json``."""

from __future__ import annotations

from memfit.cli.common import Output


def test_status_off_a_terminal_is_one_line_per_phase(capsys) -> None:
    out = Output(json_mode=False)
    assert not out.console.is_terminal  # pytest captures: no terminal, as when piped
    with out.console.status("measuring the workload ...") as status:
        status.update("measuring the workload ...")  # the same phase: no second line
        status.update("solving the plan ...")
    err = capsys.readouterr().err
    assert err.splitlines() == ["memfit: measuring the workload ...", "memfit: solving the plan ..."]


def test_status_under_json_prints_nothing(capsys) -> None:
    with Output(json_mode=True).console.status("measuring the workload ...") as status:
        status.update("solving the plan ...")
    assert capsys.readouterr() == ("", "")
