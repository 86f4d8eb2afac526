"""The examples users run first: ``memfit demo`` says what it runs before torch is imported, and each
runnable script in examples/ applies a plan that recomputes a block and prints the peak with and
without it (slow tier: each runs a fit)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_FIRST_LINE = r"""
import json, sys
first = []

class Spy:
    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        if text.strip() and not first:
            first.append([text, "torch" in sys.modules])
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)

sys.stderr = Spy(sys.stderr)
from memfit.cli.main import main
code = main(["demo", "--model", "no-such-model", "--report", ""])
print(json.dumps({"code": code, "first": first}))
"""


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_demo_says_what_it_runs_before_torch_is_imported() -> None:
    proc = subprocess.run([sys.executable, "-c", _FIRST_LINE], capture_output=True, text=True, cwd=ROOT, timeout=300)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    (text, torch_loaded) = got["first"][0]
    assert text.startswith("memfit: no-such-model, global batch 8, 20 training steps") and not torch_loaded
    assert got["code"] == 2  # then the unknown model is refused, after torch came in


@pytest.mark.slow  # about 3 s on 2 cores: the fast tier keeps to about 4 minutes
def test_demo_json_prints_no_first_line() -> None:
    script = _FIRST_LINE.replace('"--report", ""]', '"--report", "", "--json"]')
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert not proc.stderr.strip() and json.loads(proc.stdout.strip().splitlines()[-1])["first"] == []


@pytest.mark.slow  # a whole demo of a tiny model: about 25 s of CPU
def test_demo_off_a_terminal_says_its_training_phase_and_progress() -> None:
    # Piped, rich's bar draws only its last frame: the training phase has its own lines as the others do.
    argv = ["-m", "memfit.cli.main", "demo", "--model", "demo?n_layer=2&n_embd=32&seq_len=32", "--steps", "2"]
    proc = subprocess.run(
        [sys.executable, *argv, "--report", ""], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    start = lines.index("memfit: training 2 steps ...")
    assert lines[start + 1].startswith("memfit: training: step 2 of 2, loss "), lines[start:]
    assert lines.index("memfit: verifying the plan against the unmodified model ...") < start


EXAMPLES = ["hf_trainer.py", "accelerate_loop.py", "lightning_module.py"]


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_recomputes_a_block_and_prints_both_peaks(name: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)], capture_output=True, text=True, cwd=ROOT, timeout=1200
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("memfit:"))
    recomputed = int(re.search(r"(\d+) of \d+ blocks recomputed", line).group(1))
    with_plan = float(re.search(r"peak ([\d.]+) MiB with the plan", line).group(1))
    without = float(re.search(r"([\d.]+) MiB \(micro-batch \d+\) without checkpointing", line).group(1))
    assert recomputed >= 1 and with_plan < without, line
