"""Make docs/images/report*.png: a screenshot of each command's HTML report.

Runs each command with ``--report`` (`memfit demo` with its defaults, so its page is the one a user
gets from `make demo`; `plan`, `fit`, `verify` and `estimate` as docs/report.md shows them), then
Debian's headless Chromium (`make browser`) draws each page with the network shut. `make screenshot`
runs it.

    python docs/make_screenshot.py [--out-dir docs/images] [--width 1200] [--only demo plan ...]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (the command line after `memfit`, without --report; the window's height: the page's length is drawn)
PAGES: dict[str, tuple[list[str], int]] = {
    "demo": (["demo"], 2900),
    "plan": (["plan", "--model", "demo", "--budget", "60MiB", "--measure"], 2700),
    "fit": (["fit", "--model", "demo", "--budget", "60MiB", "--global-batch", "32"], 2900),
    "verify": (["verify", "--model", "demo", "--policy", "all"], 2300),
    "estimate": (["estimate", "--model", "demo", "--device", "h100-sxm"], 1750),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "images")
    p.add_argument("--width", type=int, default=1200)
    p.add_argument("--only", nargs="+", choices=list(PAGES), default=list(PAGES), help="the pages to draw")
    args = p.parse_args()
    exe = shutil.which("chromium") or shutil.which("chromium-headless-shell")
    if exe is None:
        print("no chromium: run `make browser` first", file=sys.stderr)
        return 2
    memfit = Path(sys.executable).with_name("memfit")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            argv, height = PAGES[name]
            if name == "demo":  # the demo writes its page beside its PNG
                page = Path(tmp) / "memfit-demo.html"
                subprocess.run([str(memfit), *argv, "--report", str(page.with_suffix(".png"))], check=True, cwd=ROOT)
            else:
                page = Path(tmp) / f"{name}.html"
                subprocess.run([str(memfit), *argv, "--report", str(page)], check=True, cwd=ROOT)
            out = args.out_dir / ("report.png" if name == "demo" else f"report-{name}.png")
            shoot(exe, page, out, width=args.width, height=height, profile=Path(tmp) / "profile")
            print(f"wrote {out}")
    return 0


def shoot(exe: str, page: Path, out: Path, *, width: int, height: int, profile: Path) -> None:
    """Draw ``page`` into ``out`` with headless Chromium, offline."""
    subprocess.run(
        [
            exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
            f"--user-data-dir={profile}", "--host-resolver-rules=MAP * ~NOTFOUND",
            f"--window-size={width},{height}", f"--screenshot={out.resolve()}", page.as_uri(),
        ],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
