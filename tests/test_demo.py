"""``make demo``: examples/demo.py runs end to end against a server it starts itself."""

import subprocess
import sys

from helpers import ROOT
from PIL import Image


def test_demo_runs_end_to_end(tmp_path, cache_dir, tiny_flux_folder):
    out = tmp_path / "demo-output"
    result = subprocess.run(
        [sys.executable, ROOT / "examples" / "demo.py", "--out", out, "--cache-dir", cache_dir],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "server stopped cleanly" in result.stdout
    # 2 prompts x 4 samples at the preset's 128 x 128 default: 2 rows of 4.
    assert Image.open(out / "contact-sheet.png").size == (4 * 128, 2 * 128)
    assert len(list(out.glob("sample-*.safetensors"))) == 8
