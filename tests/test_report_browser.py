"""The HTML report in a real browser: Debian's headless Chromium (``make browser`` installs it)
loads each command's page with the network shut, the page renders without a console message or
error, and every number it shows (an element with ``data-json``) is the number at that path of the
page's JSON, written as the page writes it. The JSON itself is the command's ``--json`` plus
``report_data`` (checked here for every command), so the numbers shown are the numbers measured.
"""

from __future__ import annotations

import contextlib
import html
import io
import json
import math
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from test_report_html import EXTERNAL, URL, page_blob

from memfit.cli.main import main
from memfit.report.html import REPORT_KEY, write_html

pytestmark = pytest.mark.browser

TINY = "demo?n_layer=2&n_embd=32&seq_len=32"
COMMANDS = {
    "plan": ["plan", "--model", TINY, "--batch-size", "4", "--budget", "2MiB", "--repeats", "1", "--measure"],
    "fit": ["fit", "--model", TINY, "--budget", "2MiB", "--global-batch", "8", "--repeats", "1"],
    "verify": ["verify", "--model", TINY, "--batch-size", "4", "--policy", "all", "--repeats", "1"],
    "estimate": ["estimate", "--model", TINY, "--batch-size", "4", "--device", "h100-sxm"],
    "plan-parallel": [
        "plan", "--model", TINY, "--batch-size", "4", "--budget", "80MiB", "--estimate", "--target", "h100-sxm",
        "--world-size", "2", "--parallel", "fsdp2",
    ],
}  # fmt: skip


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-headless-shell")


def render(page: Path, out_dir: Path) -> tuple[str, str]:
    """The DOM after the page's script ran, and Chromium's log (console messages are in it)."""
    exe = chromium()
    assert exe is not None
    proc = subprocess.run(
        [
            exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={out_dir / 'profile'}",
            "--enable-logging=stderr", "--v=0", "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9",
            "--dump-dom", page.as_uri(),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, proc.stderr


class _Shown(HTMLParser):
    """Elements with ``data-json`` (path, value, unit, text), ``data-na`` lines, charts."""

    def __init__(self) -> None:
        super().__init__()
        self.numbers: list[dict[str, str]] = []
        self.derived: list[dict[str, str]] = []
        self.verdict: dict[str, str] = {}
        self.na: dict[str, str] = {}
        self.attrs_seen: list[dict[str, str | None]] = []
        self._open: list[tuple[str, dict[str, str], list[str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.attrs_seen.append(a)
        if {"data-json", "data-na", "data-derived", "data-verdict"} & set(a):
            self._open.append((tag, a, []))

    def handle_data(self, data: str) -> None:
        for _, _, text in self._open:
            text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if self._open and self._open[-1][0] == tag:
            _, a, text = self._open.pop()
            if "data-json" in a:
                self.numbers.append({**a, "text": "".join(text)})
            elif "data-derived" in a:
                self.derived.append({**a, "text": "".join(text)})
            elif "data-verdict" in a:
                self.verdict = {"word": a["data-verdict"], "text": " ".join("".join(text).split())}
            else:
                self.na[a["data-na"]] = "".join(text)


def resolve(blob: Any, path: str) -> Any:
    for key in path.split("."):
        blob = blob[int(key)] if isinstance(blob, list) else blob[key]
    return blob


# suffix shown -> (scale, decimals shown; None: three significant digits)
SCALE = {
    "bytes": {" GiB": (2**-30, 2), " MiB": (2**-20, 2), " KiB": (2**-10, 2), " B": (1, 0)},
    "s": {" µs": (1e6, None), " ms": (1e3, None), " s": (1, None)},
    "samples/s": {" samples/s": (1, 1)},
    "tokens/s": {" tokens/s": (1, None)},
    "count": {"": (1, 0)},
    "err": {"": (1, None)},
}


def check_shown(n: dict[str, str], want: Any) -> None:
    """The text of a number shown is ``want`` written in its unit (sizes in the unit that reads best)."""
    if n["data-unit"] == "bool":
        assert isinstance(want, bool) and n["data-value"] == str(want).lower(), n
        return
    assert float(n["data-value"]) == pytest.approx(want, rel=1e-12, abs=0), n
    units = SCALE[n["data-unit"]]
    suffix = next(u for u in sorted(units, key=len, reverse=True) if n["text"].endswith(u))
    scale, digits = units[suffix]
    got = float(n["text"].removesuffix(suffix))
    if digits is None:
        assert math.isclose(got, want * scale, rel_tol=5e-3, abs_tol=1e-12), n
    else:
        assert math.isclose(got, want * scale, abs_tol=0.5 * 10**-digits + 1e-9), n
    if n["data-unit"] == "bytes":  # the unit that reads best: 1 to 1024 of it
        assert suffix == " B" or 1 <= abs(got) < 1024, n


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """Each command's page, with the JSON it printed."""
    if chromium() is None:
        pytest.skip("no chromium: run `make browser` (Debian's chromium package)")
    tmp = tmp_path_factory.mktemp("pages")
    out = {}
    for name, argv in COMMANDS.items():
        page = tmp / f"{name}.html"
        buf = io.StringIO()
        snapshot = ["--snapshot", str(tmp / f"{name}.pickle")] if name == "verify" else []
        with contextlib.redirect_stdout(buf):
            code = main([*argv, *snapshot, "--report", str(page), "--json"])
        assert code == 0, buf.getvalue()[-2000:]
        out[name] = (page, json.loads(buf.getvalue()))
    return out


@pytest.mark.parametrize("name", list(COMMANDS))
def test_page_renders_offline_and_shows_the_json_numbers(name: str, pages: dict, tmp_path: Path) -> None:
    page, printed = pages[name]
    text = page.read_text(encoding="utf-8")
    assert not URL.search(text) and not EXTERNAL.search(text)  # nothing to fetch
    blob = page_blob(page)
    data = blob[REPORT_KEY]
    assert {k: v for k, v in blob.items() if k != REPORT_KEY} == printed  # the page's JSON is the command's

    dom, log = render(page, tmp_path)
    console = [ln for ln in log.splitlines() if ":CONSOLE" in ln]
    assert not console, console  # the page logs nothing: no error, no warning
    assert 'data-rendered="ok"' in dom
    assert re.search(r'<pre id="memfit-errors">\s*</pre>', dom), dom[dom.find("memfit-errors") :][:500]

    shown = _Shown()
    shown.feed(dom)
    assert len(shown.numbers) >= 5
    for n in shown.numbers:
        check_shown(n, resolve(blob, n["data-json"]))
    for n in shown.derived:  # numbers computed from the JSON's: redo the formula the page names
        check_shown(n, _formula(n["data-derived"], blob, data))

    paths = {n["data-json"] for n in shown.numbers}
    # every panel either draws its data or says in one line why it has none
    for panel in ("timeline", "frontier", "grid", "compare", "rank"):
        assert panel in shown.na or _drawn(panel, shown, paths), (panel, shown.na)
    for key, line in shown.na.items():
        assert line.strip() and "\n" not in line.strip(), (key, line)
    _host_memory(printed, paths)
    checks = {"plan": _plan, "fit": _fit, "verify": _verify, "estimate": _estimate, "plan-parallel": _plan_parallel}
    checks[name](blob, data, printed, paths, shown)


HOSTILE = "<!--<script>alert(1)</script>&amp;\u2028"


def test_hostile_names_render_as_text(pages: dict, tmp_path: Path) -> None:
    # A module name or a policy label with markup in it: the page renders, and shows it as text.
    page, printed = pages["plan"]
    blob = page_blob(page)
    data = blob.pop(REPORT_KEY)
    blob["model"] = blob["policy"] = HOSTILE
    for block in (*blob["blocks"], *data["blocks"]):
        block["name"] = f"{HOSTILE}.{block['name']}"
    hostile = write_html(tmp_path / "hostile.html", blob, data)
    dom, log = render(Path(hostile), tmp_path)
    assert 'data-rendered="ok"' in dom, dom[-2000:]
    assert not [ln for ln in log.splitlines() if ":CONSOLE" in ln]
    assert "<script>alert(1)" not in dom.split('id="memfit-data"')[-1].split("</script>", 1)[-1]
    assert "&lt;!--&lt;script&gt;alert(1)" in dom  # shown, escaped by the DOM as text


def test_fit_page_says_the_last_short_window(pages: dict, tmp_path: Path) -> None:
    # A global batch that is not a multiple of the micro-batch: 32 = 11 x 2 + 10, the last window's 10 said.
    page, _ = pages["fit"]
    blob = page_blob(page)
    data = blob.pop(REPORT_KEY)
    blob |= {"global_batch": 32, "micro_batch": 11, "accumulation_steps": 3}
    dom, _ = render(Path(write_html(tmp_path / "short.html", blob, data)), tmp_path)
    shown = _Shown()
    shown.feed(dom)
    assert "32 = 11 x 2 + 10" in shown.verdict["text"], shown.verdict


def _formula(formula: str, blob: dict, data: dict) -> float:
    """``a / b``, ``a * b / c``, ``a + b``: JSON paths and operators, left to right (what the page computed)."""
    words = formula.split()
    value = float(resolve(blob, words[0]))
    for op, path in zip(words[1::2], words[2::2], strict=True):
        operand = resolve(blob, path)
        value = {
            "*": value * operand,
            "/": value / operand if operand else math.nan,
            "+": value + operand,
            "-": value - operand,
        }[op]
    return value


def _drawn(panel: str, shown: _Shown, paths: set[str]) -> bool:
    if panel == "timeline":
        return any("data-timeline" in a for a in shown.attrs_seen)
    if panel in ("frontier", "grid"):
        return any(a.get("data-chart") == panel for a in shown.attrs_seen)
    if panel == "compare":
        return any(p.startswith("report_data.compare.") and p.endswith(".measured") for p in paths)
    return any(p.startswith("rank.") for p in paths)


def _host_memory(printed: dict, paths: set[str]) -> None:
    """Where the JSON has host bytes, the page shows them beside the device's (each checked against
    the JSON by the caller's loop over the numbers shown)."""
    if isinstance(printed.get("model_states"), dict):
        for part in printed["model_states"]:
            assert {f"model_states.{part}.device_bytes", f"model_states.{part}.host_bytes"} <= paths, part
    if isinstance(printed.get("host_bytes"), dict):  # an estimate's placement
        assert "host_bytes.total_bytes" in paths and "device_bytes.peak_bytes" in paths
        assert {f"host_bytes.{k}" for k in ("params_bytes", "grads_bytes", "optimizer_bytes")} <= paths
        assert {f"placements.{i}.host_bytes" for i in range(len(printed.get("placements") or []))} <= paths


def _plan(blob: dict, data: dict, printed: dict, paths: set[str], shown: _Shown) -> None:
    # the measured peak shown is the one --measure printed; both steps drawn with their peaks
    assert data["compare"][0]["measured"] == printed["measured_peak_bytes"]
    assert {
        "report_data.compare.0.measured",
        "report_data.timelines.0.peak_bytes",
        "report_data.timelines.1.peak_bytes",
    } <= paths
    assert {"report_data.frontier.chosen.peak_bytes", "report_data.frontier.measured.peak_bytes"} <= paths
    assert data["frontier"]["chosen"]["peak_bytes"] == printed["predicted_peak_bytes"]
    assert len(data["blocks"]) == len(printed["blocks"]) and all(b["tensors"] for b in data["blocks"])
    assert {f"report_data.blocks.{i}.bytes_saved" for i in range(len(data["blocks"]))} <= paths
    parts = data["peak_parts"][1]
    assert sum(p["bytes"] for p in parts["parts"]) == parts["total_bytes"] == data["timelines"][1]["peak_bytes"]
    assert {"grid", "rank"} <= set(shown.na)
    assert "model_states" in printed  # the model states by part, device and host: shown (_host_memory)
    # the answer first: the verdict and the headline numbers, the command's JSON
    fits = printed["predicted_peak_bytes"] <= printed["budget_bytes"]
    assert shown.verdict["word"] == ("FITS" if fits else "OVER BUDGET"), shown.verdict
    headline = {"predicted_peak_bytes", "budget_bytes", "predicted_step_s", "report_data.compare.3.predicted"}
    assert headline | {"measured_peak_bytes", "baseline_step_s", "within_budget"} <= paths
    # the blocks' seconds: their sum shown, and the plan's own added time beside it
    formulas = {n["data-derived"] for n in shown.derived}
    assert "predicted_step_s - report_data.compare.3.predicted" in formulas
    # one peak and one time per plan in every panel
    assert (
        data["compare"][0]["predicted"] == data["frontier"]["chosen"]["peak_bytes"] == printed["predicted_peak_bytes"]
    )
    assert data["compare"][1]["predicted"] == data["frontier"]["chosen"]["step_s"] == printed["predicted_step_s"]
    assert data["compare"][3]["measured"] == printed["baseline_step_s"]


def _fit(blob: dict, data: dict, printed: dict, paths: set[str], shown: _Shown) -> None:
    feasible = [i for i, c in enumerate(printed["candidates"]) if c["feasible"]]
    assert {f"candidates.{i}.predicted_samples_per_s" for i in feasible} <= paths  # the grid shows every candidate
    assert data["compare"][0]["predicted"] == printed["predicted_peak_bytes"]
    if printed["measured_peak_bytes"] is not None:
        assert "report_data.compare.0.measured" in paths
    assert len(data["timelines"]) == 2 and data["timelines"][1]["micro_steps"] == printed["accumulation_steps"]
    g, b = printed["global_batch"], printed["micro_batch"]
    assert shown.verdict["word"] == "FITS" and f"{g} = {b} x" in shown.verdict["text"], shown.verdict
    assert {"micro_batch", "accumulation_steps", "predicted_peak_bytes", "predicted_samples_per_s"} <= paths
    # one time per plan: the frontier's chosen point is the fit's prediction, as the candidates table shows it
    window_s = g / printed["predicted_samples_per_s"]
    assert data["frontier"]["chosen"]["step_s"] == pytest.approx(window_s, rel=1e-12)
    assert data["frontier"]["chosen"]["peak_bytes"] == printed["predicted_peak_bytes"]
    assert data["compare"][1]["predicted"] == printed["predicted_samples_per_s"]
    assert "global_batch / predicted_samples_per_s" in {n["data-derived"] for n in shown.derived}
    assert "model_states" in printed  # shown by part, device and host (_host_memory)


def _verify(blob: dict, data: dict, printed: dict, paths: set[str], shown: _Shown) -> None:
    assert data["compare"][0]["measured"] == printed["measured_peak_bytes"]
    assert "report_data.compare.0.measured" in paths
    assert {"frontier", "grid", "rank"} <= set(shown.na)
    assert all(b["option"].startswith("recompute") and b["tensors"] for b in data["blocks"])
    assert shown.verdict["word"] == ("OK" if printed["ok"] else "FAILED"), shown.verdict
    headline = {"max_grad_rel_err", "grad_rtol", "buffers_equal", "measured_peak_bytes", "baseline_peak_bytes"}
    assert headline <= paths
    assert "plan 'all'" in data["title"]
    # --snapshot: the page links the pickle beside it, with the command that opens it
    assert any(a.get("data-snapshot") == "verify.pickle" and a.get("href") == "verify.pickle" for a in shown.attrs_seen)


def _estimate(blob: dict, data: dict, printed: dict, paths: set[str], shown: _Shown) -> None:
    assert {"timeline", "frontier", "grid", "compare"} <= set(shown.na)
    assert {"params_bytes", "grads_bytes", "optimizer_bytes", "peak_bytes"} <= paths  # the estimate's own keys
    assert {f"breakdown.peak_bytes_by_phase.{k}" for k in printed["breakdown"]["peak_bytes_by_phase"]} <= paths
    # fits or not on the device, its time, samples/s and tokens/s from the estimate's own numbers
    assert printed["fits"] is not None
    assert shown.verdict["word"] == ("FITS" if printed["fits"] else "DOES NOT FIT"), shown.verdict
    assert printed["device"] in shown.verdict["text"]
    assert {"fits", "step_s", "peak_bytes"} <= paths and {"budget_bytes", "device_memory_bytes"} & paths
    assert {n["data-derived"] for n in shown.derived} == {"batch_size / step_s", "batch_size * seq_len / step_s"}
    assert isinstance(printed.get("host_bytes"), dict)  # the placement's host bytes: shown (_host_memory)


def _plan_parallel(blob: dict, data: dict, printed: dict, paths: set[str], shown: _Shown) -> None:
    # rank 0's memory by part and its peak per phase, as the command's JSON has them
    parts = {k for k, v in printed["rank"]["memory"].items() if k.endswith("_bytes") and isinstance(v, int)}
    assert parts and {f"rank.memory.{k}" for k in parts} <= paths
    assert {f"rank.peak_bytes_by_phase.{k}" for k in printed["rank"]["peak_bytes_by_phase"]} <= paths
    assert "rank.predicted_peak_bytes" in paths
    # On CUDA the budget is reserved memory: the page shows the predicted reserved bytes it was held to.
    assert printed["budget_means"] == "reserved" and "predicted_reserved_bytes" in paths
    assert {"timeline", "peak_parts", "compare"} <= set(shown.na)  # --estimate: nothing ran here
    assert len(data["frontier"]["points"]) >= 2 and "report_data.frontier.chosen.step_s" in paths


# Reports the page's horizontal overflow after it rendered: the page itself, and each section and column
# whose content is wider than its box (what a reader would have to scroll sideways for).
_OVERFLOW_PROBE = """<script>
(function () {
  const wide = [], de = document.documentElement;
  if (de.scrollWidth > de.clientWidth + 1) wide.push("the page: " + de.scrollWidth + " > " + de.clientWidth + " px");
  for (const e of document.querySelectorAll("main section, main .row > div")) {
    if (e.scrollWidth > e.clientWidth + 1) wide.push(((e.closest("section") || {}).id || "?") + ": " + e.scrollWidth + " > " + e.clientWidth + " px");
  }
  const p = document.createElement("pre"); p.id = "overflow"; p.textContent = JSON.stringify(wide); document.body.append(p);
})();
</script>"""

LONG_REASON = (
    "needs 64.29 MiB over 2 micro-steps of accumulation, which keep the gradients (9.39 MiB) alive from one "
    "micro-step to the next (one step of 16 samples alone, without accumulation, needs 57.35 MiB)"
)  # a candidate's reason as auto-fit writes it for GPT-2 small


def overflow(page: Path, out_dir: Path, width: int) -> list[str]:
    """What overflows horizontally when ``page`` is drawn ``width`` px wide."""
    probe = out_dir / f"{page.stem}-{width}.html"
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", _OVERFLOW_PROBE + "</body>"), encoding="utf-8")
    exe = chromium()
    assert exe is not None
    proc = subprocess.run(
        [
            exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={out_dir / 'profile'}",
            "--host-resolver-rules=MAP * ~NOTFOUND", f"--window-size={width},2000", "--dump-dom", probe.as_uri(),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    m = re.search(r'<pre id="overflow">(.*?)</pre>', proc.stdout, re.S)
    assert m is not None, proc.stderr[-2000:]
    return json.loads(html.unescape(m.group(1)))


@pytest.mark.parametrize("width", [1280, 800])
@pytest.mark.parametrize("name", list(COMMANDS))
def test_nothing_overflows_sideways(name: str, width: int, pages: dict, tmp_path: Path) -> None:
    page, _ = pages[name]
    if name == "fit":  # a candidate that does not fit says why, at length
        blob = page_blob(page)
        data = blob.pop(REPORT_KEY)
        blob["candidates"].append({**blob["candidates"][-1], "feasible": False, "reason": LONG_REASON})
        page = Path(write_html(tmp_path / "fit.html", blob, data))
    assert overflow(page, tmp_path, width) == []
