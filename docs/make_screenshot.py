"""Make docs/images/report.png: a screenshot of the HTML report `memfit demo` writes.

Runs `memfit demo` (its defaults, so the page is the one a user gets from `make demo`), then
Debian's headless Chromium (`make browser`) draws the page with the network shut. `make screenshot`
runs it.

    python docs/make_screenshot.py [--out docs/images/report.png] [--width 1200] [--height 2900]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "report.png")
    p.add_argument("--width", type=int, default=1200)
    p.add_argument("--height", type=int, default=2900, help="the window's height: the page's length is drawn")
    args = p.parse_args()
    exe = shutil.which("chromium") or shutil.which("chromium-headless-shell")
    if exe is None:
        print("no chromium: run `make browser` first", file=sys.stderr)
        return 2
    memfit = Path(sys.executable).with_name("memfit")
    with tempfile.TemporaryDirectory() as tmp:
        png = Path(tmp) / "memfit-demo.png"
        subprocess.run([str(memfit), "demo", "--report", str(png)], check=True, cwd=ROOT)
        page = png.with_suffix(".html")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
                f"--user-data-dir={Path(tmp) / 'profile'}", "--host-resolver-rules=MAP * ~NOTFOUND",
                f"--window-size={args.width},{args.height}", f"--screenshot={args.out.resolve()}", page.as_uri(),
            ],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
