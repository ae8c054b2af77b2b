"""``make demo``: examples/demo.py runs end to end against a server it starts itself."""

import subprocess
import sys

from helpers import ROOT
from PIL import Image

from rollout_client.images import LABEL_HEIGHT


def test_demo_runs_end_to_end(tmp_path, cache_dir, family_resources):
    family_resources.folder("shapes")  # the demo's model, built once for the session
    out = tmp_path / "demo-output"
    result = subprocess.run(
        [sys.executable, ROOT / "examples" / "demo.py", "--out", out, "--cache-dir", cache_dir],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "server stopped cleanly" in result.stdout
    # 2 prompts x 4 samples at the shapes preset's 64 x 64 default: 2 labelled rows of 4.
    assert Image.open(out / "contact-sheet.png").size == (4 * 64, 2 * (LABEL_HEIGHT + 64))
    assert len(list(out.glob("sample-*.safetensors"))) == 8
