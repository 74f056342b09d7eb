"""Make docs/report.png: `tokpipe report`'s page of the README's example, as a reader's run of it draws it.

    apt-get install -y chromium                  # once; the screenshot is headless Chromium's
    .venv/bin/python docs/make_report_png.py     # from the repository root; rewrites docs/report.png

Not run by CI or the tests (they have no Chromium). It runs the README's example commands (its first `bash` block
that tests/test_docs.py runs) in a copy of the repository's `examples/` at /tmp/tokpipe-example, a path that names
no one's checkout, so the page shows `out/example` and a neutral tokenizer path; then `tokpipe report out/example`,
and a screenshot of that page, cut below its last line. The page holds the date it was made and the run's
timings, so the picture changes with every run: make it again when the page changes, not to follow the code.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image, ImageChops

REPO = Path(__file__).resolve().parent.parent
WORK = Path("/tmp/tokpipe-example")
WIDTH = 960  # the page's summary table fits without wrapping from here; GitHub shows the picture scaled to ~880
TALLER_THAN_THE_PAGE = 8000  # headless Chromium shoots the window, not the page: a tall one, then cut
MARGIN = 24  # kept below the page's last line
MOST_OFF = 8  # of 255, in a channel of a pixel: 256 colours do, or the picture keeps all of its own


def readme_example() -> str:
    """The README's first `bash` block that is run (the one after the install, which says why it is not)."""
    text = (REPO / "README.md").read_text()
    for block in re.finditer(r"^```bash\n(.*?)^```$", text, re.M | re.S):
        if not text[: block.start()].rstrip().endswith("-->"):
            return block.group(1)
    raise SystemExit("README.md has no bash block that is run")


def run_example(work: Path) -> Path:
    """The example's commands as a reader pastes them, in `work`: `.venv/bin/` holds this environment's python and
    tokpipe, as in tests/test_docs.py. Returns the report's path."""
    shutil.copytree(REPO / "examples", work / "examples", symlinks=True)  # a copy: a link would show its target
    bin_ = work / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").symlink_to(sys.executable)
    (bin_ / "tokpipe").symlink_to(Path(sys.executable).parent / "tokpipe")
    commands = readme_example() + ".venv/bin/tokpipe report out/example\n"
    subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=work, check=True)
    return work / "out" / "example" / "report.html"


def screenshot(page: Path, png: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="tokpipe-chromium-") as profile:
        subprocess.run(
            [
                "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--hide-scrollbars", f"--user-data-dir={profile}", f"--screenshot={png}",
                f"--window-size={WIDTH},{TALLER_THAN_THE_PAGE}", page.as_uri(),
            ],
            check=True,
            capture_output=True,  # its D-Bus complaints: there is no session bus here, and it needs none
        )  # fmt: skip


def cut_below_the_page(png: Path, dest: Path) -> None:
    """The screenshot down to the page's last line and a margin; in 256 colours (a third of the bytes) where none
    is more than a few levels off, else as it is. Max coverage keeps the charts' colours; median cut, Pillow's
    default, made the orange line of the workers' busy share red, which means a failure on the page."""
    image = Image.open(png).convert("RGB")
    background = Image.new("RGB", image.size, image.getpixel((image.width - 1, image.height - 1)))
    bottom = ImageChops.difference(image, background).getbbox()[3]
    if bottom >= image.height:
        raise SystemExit(f"the page is taller than {TALLER_THAN_THE_PAGE} px: raise TALLER_THAN_THE_PAGE")
    image = image.crop((0, 0, image.width, bottom + MARGIN))
    fewer = image.quantize(256, method=Image.Quantize.MAXCOVERAGE)
    off = max(high for _, high in ImageChops.difference(image, fewer.convert("RGB")).getextrema())
    (fewer if off <= MOST_OFF else image).save(dest, optimize=True)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    if WORK.exists():
        raise SystemExit(f"{WORK} exists: remove it (a run of this script left it?) and run this again")
    try:
        page = run_example(WORK)
        shot = WORK / "screenshot.png"
        screenshot(page, shot)
        cut_below_the_page(shot, REPO / "docs" / "report.png")
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    print(f"{REPO / 'docs' / 'report.png'}: {Image.open(REPO / 'docs' / 'report.png').size}")


if __name__ == "__main__":
    main()
