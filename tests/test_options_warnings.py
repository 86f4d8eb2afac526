"""Python warnings raised while a command runs reach the JSON's ``warnings``, one line each with a
relative path, and nothing raw reaches stderr under ``--json`` (without it: memfit's warning line)."""

from __future__ import annotations

import io
import json
import pickle
import warnings
from pathlib import Path

import pytest

from memfit.cli.main import main

TINY = "demo?n_layer=2&n_embd=16&n_head=2&seq_len=8"


def test_a_warning_in_a_command_is_one_relative_line_in_the_json(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from memfit.cli import profile

    def run(args, out):  # noqa: ANN001, ANN202
        warnings.warn("the workload's own warning\nover two lines", UserWarning, stacklevel=1)
        return {"x": 1}

    monkeypatch.setattr(profile, "run", run)
    assert main(["profile", "--model", TINY, "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    line = f"tests/test_options_warnings.py:{run.__code__.co_firstlineno + 1}: UserWarning: the workload's own warning over two lines"
    assert json.loads(captured.out)["warnings"] == [line]
    assert main(["profile", "--model", TINY]) == 0
    err = capsys.readouterr().err
    assert line in " ".join(err.split()) and "/work/" not in err and str(Path.cwd()) not in err


def test_torchs_pickle_warning_of_a_resume_file_stays_out_of_stderr_under_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A plain pickle as --resume: torch's weights-only unpickler warns about its protocol (with the
    absolute path of torch's file) before memfit refuses the file; the warning is in the JSON only."""
    path = tmp_path / "state.pt"
    buffer = io.BytesIO()
    pickle.dump({"step": 1}, buffer, protocol=4)
    path.write_bytes(buffer.getvalue())
    argv = ["train", "--model", TINY, "--global-batch", "2", "--steps", "1", "--device", "cpu", "--resume", str(path)]
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert code == 2 and "\n" not in out["error"], out
    assert captured.err == "", captured.err
    assert any(w.startswith("torch/") and "pickle protocol" in w for w in out["warnings"]), out
    assert all("\n" not in w and not w.startswith("/") for w in out["warnings"])
