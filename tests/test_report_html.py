"""The HTML report's writer without a browser: the page's JSON is the command's ``--json`` plus
``report_data``, the file names no URL and loads nothing, it stays small, and the panels' data add
up (timeline columns keep the peak, a peak's parts sum to it). The page rendered in Chromium is
checked in tests/test_report_browser.py."""

from __future__ import annotations

import contextlib
import io
import json
import re
from importlib import resources
from pathlib import Path

import pytest

from memfit.cli.main import main
from memfit.plan.costmodel import Prediction
from memfit.profiling.types import StepTimeline
from memfit.report.html import REPORT_KEY, write_html
from memfit.report.panels import TIMELINE_COLUMNS, peak_parts, short, timeline

TINY = "demo?n_layer=2&n_embd=32&seq_len=32"
URL = re.compile(r"(?i)\b(?:https?|ftp|wss?):|//[a-z0-9.-]+\.[a-z]{2,}/")
EXTERNAL = re.compile(r"(?i)<(?:link|img|iframe|object|embed)\b|<script[^>]*\bsrc=|@import|url\(")


def page_blob(path: str | Path) -> dict:
    """The JSON the page renders from."""
    text = Path(path).read_text(encoding="utf-8")
    m = re.search(r'<script type="application/json" id="memfit-data">(.*?)</script>', text, re.S)
    assert m is not None, "no memfit-data blob in the page"
    return json.loads(m.group(1))


def run_cli(argv: list[str]) -> tuple[int, dict]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    return code, json.loads(buf.getvalue())


def test_template_names_no_url_and_loads_nothing():
    text = resources.files("memfit.report").joinpath("report.html").read_text(encoding="utf-8")
    assert not URL.search(text), URL.search(text)
    assert not EXTERNAL.search(text), EXTERNAL.search(text)
    assert len(text.encode()) < 39_000  # hand-written: no library inside
    assert text.count("/*MEMFIT_DATA*/") == 1


def test_write_html_embeds_the_json_exactly(tmp_path):
    cmd = {"model": "m", "note": "a </script><script>alert(1)</script> b", "n": 3, "x": [1.5, None]}
    data = {"version": 1, "title": "t </b>"}
    out = write_html(tmp_path / "sub" / "r.html", cmd, data)
    text = Path(out).read_text(encoding="utf-8")
    assert text.count("</script>") == 2  # the blob's and the renderer's: the strings cannot close it
    assert page_blob(out) == {**cmd, REPORT_KEY: data}
    assert not URL.search(text) and not EXTERNAL.search(text)


@pytest.mark.parametrize(
    "hostile", ["<!--<script>", "a</script><script>x()</script>", "<!-- -->&amp;", "\u2028\u2029", "]]></b>"]
)
def test_write_html_leaves_no_markup_in_the_blob(hostile, tmp_path):
    # NOTE [ JSON inside a script element ]: "<!--<script>" in a name once swallowed the page's renderer
    cmd = {"model": hostile, "blocks": [{"name": hostile, "option": "keep"}], "policy": hostile}
    out = write_html(tmp_path / "r.html", cmd, {"version": 1, "title": hostile})
    text = Path(out).read_text(encoding="utf-8")
    blob_text = re.search(r'id="memfit-data">(.*?)</script>', text, re.S).group(1)
    assert not set("<>&\u2028\u2029") & set(blob_text), blob_text
    assert page_blob(out) == {**cmd, REPORT_KEY: {"version": 1, "title": hostile}}


def test_write_html_refuses_non_finite_numbers(tmp_path):
    with pytest.raises(ValueError):
        write_html(tmp_path / "r.html", {"x": float("nan")}, {})


def _timeline(n: int = 5000) -> StepTimeline:
    """A step with a one-op spike in the middle of backward: the drawn columns must keep it."""
    live = [1000 + (i if i < n // 2 else n - i) * 10 for i in range(n)]
    spike = n // 2 + 37
    live[spike] += 50_000
    phase = ["forward" if i < n // 2 else "backward" if i < n - 100 else "optimizer" for i in range(n)]
    grads = [0 if i < n // 2 else 200 for i in range(n)]
    return StepTimeline(
        op_index=tuple(range(0, 3 * n, 3)), live_bytes=tuple(live), phase=tuple(phase), grads_bytes=tuple(grads),
        params_bytes=300, optimizer_bytes=500, peak_bytes=max(live), batch_size=4, micro_batch=2, micro_steps=2,
    )  # fmt: skip


def test_timeline_columns_keep_the_peak():
    tl = _timeline()
    d = timeline("plan", tl)
    assert len(d["x"]) <= TIMELINE_COLUMNS + 2 and len(d["x"]) == len(d["live_bytes"]) == len(d["phase"])
    assert max(d["live_bytes"]) == tl.peak_bytes
    assert d["peak_op"] == tl.op_index[tl.live_bytes.index(tl.peak_bytes)]
    assert d["peak_phase"] == "backward"
    assert set(d["phase"]) == {"f", "b", "o"}
    assert d["x"] == sorted(d["x"])


@pytest.mark.parametrize(
    ("event", "options", "rest"),
    [
        ("loss and head", ["keep"], "head (loss, logits and their gradient)"),
        ("backward of h.1", ["recompute", "keep"], "recompute working set"),
        ("backward of h.1", ["keep", "keep"], "working set (temporaries)"),
    ],
)
def test_peak_parts_add_up_to_the_measured_peak(event, options, rest):
    tl = _timeline()
    pred = Prediction(peak_bytes=1, step_s=1.0, margin=0.0, peak_event=event, peak_kept_bytes=20_000)
    d = peak_parts("plan", tl, pred, options)
    parts = {p["part"]: p["bytes"] for p in d["parts"]}
    assert sum(parts.values()) == d["total_bytes"] == tl.peak_bytes
    assert parts["parameters"] == 300 and parts["optimizer state"] == 500 and parts["gradients"] == 200
    assert parts["kept activations"] == 20_000 and rest in parts
    # kept never exceeds the measured activations
    big = Prediction(peak_bytes=1, step_s=1.0, margin=0.0, peak_event=event, peak_kept_bytes=10**9)
    parts = {p["part"]: p["bytes"] for p in peak_parts("plan", tl, big, options)["parts"]}
    assert parts[rest] == 0 and sum(parts.values()) == tl.peak_bytes


def test_estimate_report_is_its_json_plus_the_panels(tmp_path):
    path = tmp_path / "est.html"
    code, printed = run_cli(["estimate", "--model", TINY, "--batch-size", "2", "--report", str(path), "--json"])
    assert code == 0
    blob = page_blob(path)
    data = blob.pop(REPORT_KEY)
    assert blob == printed and printed["report"] == str(path)
    assert data["command"] == "estimate" and set(data["unavailable"]) >= {"timeline", "frontier", "grid", "compare"}
    parts = {p["part"]: blob[p["path"]] for p in data["peak_parts"][0]["parts"]}  # the parts are the JSON's own keys
    assert parts["parameters"] == printed["params_bytes"] and parts["gradients"] == printed["grads_bytes"]
    text = path.read_text(encoding="utf-8")
    assert not URL.search(text) and not EXTERNAL.search(text)
    assert path.stat().st_size < 100_000


@pytest.mark.parametrize("command", ["estimate", "verify"])
def test_html_only_commands_refuse_a_png(command, tmp_path, capsys):
    code = main([command, "--model", TINY, "--report", str(tmp_path / "r.png")])
    assert code == 2
    assert "ending in .html" in capsys.readouterr().err


@pytest.mark.slow  # about 2 s on 2 cores: the fast tier keeps to about 4 minutes
def test_plan_report_is_its_json_plus_the_panels(tmp_path):
    path = tmp_path / "plan.html"
    argv = ["plan", "--model", TINY, "--batch-size", "2", "--budget", "2MiB", "--repeats", "1"]
    code, printed = run_cli([*argv, "--report", str(path), "--json"])
    assert code == 0
    blob = page_blob(path)
    data = blob.pop(REPORT_KEY)
    assert blob == printed
    assert [t["label"] for t in data["timelines"]] == ["no checkpointing", "chosen plan"]
    assert data["frontier"]["chosen"]["peak_bytes"] == printed["predicted_peak_bytes"]
    assert [b["name"] for b in data["blocks"]] == [b["name"] for b in printed["blocks"]]
    assert all(b["source"] == "explain" and b["tensors"] for b in data["blocks"])


def test_plan_letters_follow_the_options_kind():
    # a tiled or host-held recompute is a recompute (it read "." as if kept)
    assert short(["recompute:tiles-4", "keep", "keep:tiles-4", "selective:matmuls", "offload", "recompute:host"]) == (
        "R..SOR"
    )
