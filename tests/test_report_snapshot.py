"""``--snapshot FILE.pickle``: the measured step's allocations in the format of
``torch.cuda.memory._dump_snapshot``, read back with PyTorch's own reader (torch.cuda._memory_viz), its
peak the peak the command's JSON reports; a name that is not a pickle is refused before any work."""

from __future__ import annotations

import contextlib
import io
import json
import pickle

import pytest
from test_report_html import page_blob
from torch.cuda import _memory_viz

from memfit.cli.main import main
from memfit.report.html import REPORT_KEY

TINY = "demo?n_layer=2&n_embd=32&seq_len=32"


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def replayed_peak(snap: dict) -> int:
    current = peak = 0
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            current += e["size"]
            peak = max(peak, current)
        elif e["action"] == "free_completed":
            current -= e["size"]
    return peak


def test_profile_snapshot_replays_to_the_profiles_peak(tmp_path) -> None:
    path = tmp_path / "step.pickle"
    argv = ["profile", "--model", TINY, "--batch-size", "2", "--repeats", "1", "--snapshot", str(path), "--json"]
    code, out, _ = run(argv)
    assert code == 0, out[-2000:]
    printed = json.loads(out)
    assert printed["snapshot"] == str(path)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert replayed_peak(snap) == printed["peak_bytes"]  # the profiled step with every block kept
    assert snap["memfit"]["frees_of_unrecorded_storages"] == 0
    assert "Active Memory Timeline" in _memory_viz.trace_plot(snap)  # PyTorch's viewer takes it
    # the step's parts, in the same JSON, add up to its step time
    parts = printed["step_parts_s"]
    total = parts["blocks_fwd_s"] + parts["blocks_bwd_s"] + parts["outside_blocks_s"] + parts["rest_s"]
    assert total == pytest.approx(printed["step_s"], rel=1e-12)
    assert parts["blocks_fwd_s"] == pytest.approx(sum(b["fwd_s"] for b in printed["blocks"]), rel=1e-12)


@pytest.mark.parametrize("name", ["step.txt", "step.html"])
def test_a_snapshot_name_that_is_not_a_pickle_is_refused(tmp_path, name: str) -> None:
    code, out, err = run(["profile", "--model", TINY, "--snapshot", str(tmp_path / name)])
    assert code == 2 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "memfit profile" in lines[0] and "ending in .pickle" in lines[0], lines
    assert not (tmp_path / name).exists()


def test_a_snapshot_in_a_missing_directory_is_refused(tmp_path) -> None:
    code, _, err = run(["profile", "--model", TINY, "--snapshot", str(tmp_path / "no" / "step.pickle")])
    assert code == 2 and "does not exist" in err and len(err.strip().splitlines()) == 1


def test_verify_snapshot_is_the_measured_step_and_the_page_links_it(tmp_path) -> None:
    snap_path, page = tmp_path / "snaps" / "step.pickle", tmp_path / "page.html"
    snap_path.parent.mkdir()
    argv = ["verify", "--model", TINY, "--batch-size", "2", "--policy", "all", "--repeats", "0"]
    code, out, _ = run([*argv, "--snapshot", str(snap_path), "--report", str(page), "--json"])
    assert code == 0, out[-2000:]
    printed = json.loads(out)
    with open(snap_path, "rb") as f:
        snap = pickle.load(f)
    assert replayed_peak(snap) == printed["measured_peak_bytes"]  # the planned model's measured step
    assert "Active Memory Timeline" in _memory_viz.trace_plot(snap)
    data = page_blob(page)[REPORT_KEY]
    assert data["snapshot"]["href"] == "snaps/step.pickle"  # relative to the page
    assert (page.parent / data["snapshot"]["href"]).resolve() == snap_path.resolve()
    assert data["snapshot"]["command"].startswith("python -m torch.cuda._memory_viz trace_plot ")


def test_verify_snapshot_with_accumulation_is_refused_before_any_work(tmp_path) -> None:
    argv = ["verify", "--model", TINY, "--global-batch", "4", "--micro-batch", "2"]
    code, out, err = run([*argv, "--snapshot", str(tmp_path / "s.pickle")])
    assert code == 2 and "--snapshot" in err and "--global-batch" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "s.pickle").exists()


def test_plan_measure_snapshot_replays_to_the_measured_peak(tmp_path) -> None:
    path = tmp_path / "plan.pickle"
    argv = ["plan", "--model", TINY, "--batch-size", "2", "--policy", "all", "--measure", "--repeats", "1"]
    code, out, _ = run([*argv, "--snapshot", str(path), "--json"])
    assert code == 0, out[-2000:]
    printed = json.loads(out)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert printed["snapshot"] == str(path) and replayed_peak(snap) == printed["measured_peak_bytes"]
    assert "Active Memory Timeline" in _memory_viz.trace_plot(snap)


def test_plan_snapshot_without_measure_is_refused(tmp_path) -> None:
    code, _, err = run(["plan", "--model", TINY, "--policy", "all", "--snapshot", str(tmp_path / "p.pickle")])
    assert code == 2 and "--snapshot" in err and "--measure" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow  # about 5 s on 2 cores: the fast tier keeps to about 4 minutes
def test_fit_snapshot_is_the_chosen_window_and_the_page_links_it(tmp_path) -> None:
    path, page = tmp_path / "fit.pickle", tmp_path / "fit.html"
    argv = ["fit", "--model", TINY, "--budget", "6MiB", "--global-batch", "4", "--repeats", "1"]
    code, out, _ = run([*argv, "--snapshot", str(path), "--report", str(page), "--json"])
    assert code == 0, out[-2000:]
    printed = json.loads(out)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert printed["snapshot"] == str(path)
    assert replayed_peak(snap) == printed["measured_peak_bytes"]  # the chosen plan's measured window
    assert snap["memfit"]["frees_of_unrecorded_storages"] == 0
    assert "Active Memory Timeline" in _memory_viz.trace_plot(snap)
    data = page_blob(page)[REPORT_KEY]
    assert data["snapshot"]["href"] == "fit.pickle" and data["snapshot"]["command"].endswith("-o " + str(page))


@pytest.mark.parametrize("leaves_it_out", [["--no-measure"], ["--estimate", "--target", "h100-sxm"]])
def test_fit_snapshot_without_a_measured_window_is_refused(tmp_path, leaves_it_out: list[str]) -> None:
    argv = ["fit", "--model", TINY, "--budget", "6MiB", "--global-batch", "4", *leaves_it_out]
    code, out, err = run([*argv, "--snapshot", str(tmp_path / "f.pickle")])
    assert code == 2 and "--snapshot" in err and "measured window" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "f.pickle").exists()
