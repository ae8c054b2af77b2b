"""``make demo``: examples/demo.py runs end to end against a server it starts itself (a real
``rollout-server serve`` process and the ``rollout-client`` command). The script's ``main`` runs in
this process, with the arguments ``make demo`` would give it: a third interpreter importing torch
would test no more."""

from PIL import Image
from support.servers import example_module

from rollout_client.images import LABEL_HEIGHT


def test_demo_runs_end_to_end(tmp_path, cache_dir, family_resources, capsys):
    family_resources.folder("shapes")  # the demo's model, built once for the session
    out = tmp_path / "demo-output"
    # A failure raises SystemExit with the reason.
    example_module("demo").main(["--out", str(out), "--cache-dir", str(cache_dir)])
    assert "server stopped cleanly" in capsys.readouterr().out
    # 2 prompts x 4 samples at the shapes preset's 64 x 64 default: 2 labelled rows of 4.
    assert Image.open(out / "contact-sheet.png").size == (4 * 64, 2 * (LABEL_HEIGHT + 64))
    assert len(list(out.glob("sample-*.safetensors"))) == 8
