"""The wire grows without breaking: the schema stays compatible with the released one (`buf breaking`,
as `make lint` runs it)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT

MAKEFILE = (ROOT / "Makefile").read_text()
# The buf command and the released schema image, as `make lint` names them.
BUF = re.search(r"^BUF := (.+)$", MAKEFILE, re.MULTILINE).group(1).split()
RELEASED_SCHEMA = ROOT / re.search(r"^RELEASED_SCHEMA := (.+)$", MAKEFILE, re.MULTILINE).group(1)
PROTO = Path("protos/rollout/v1/rollout.proto")


def buf_breaking(workspace: Path) -> subprocess.CompletedProcess:
    """`buf breaking` of the buf workspace ``workspace`` against the released schema."""
    if shutil.which(BUF[0]) is None:
        pytest.skip(f"{BUF[0]} is not installed (make lint needs it too)")
    command = [*BUF, "breaking", "--against", str(RELEASED_SCHEMA)]
    return subprocess.run(command, cwd=workspace, capture_output=True, text=True, timeout=300)


def test_the_schema_is_compatible_with_the_released_one():
    result = buf_breaking(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_renumbered_field_breaks_the_released_schema(tmp_path):
    shutil.copy(ROOT / "buf.yaml", tmp_path)
    source = (ROOT / PROTO).read_text()
    renumbered = source.replace("optional uint32 num_steps = 9;", "optional uint32 num_steps = 99;")
    assert renumbered != source
    (tmp_path / PROTO).parent.mkdir(parents=True)
    (tmp_path / PROTO).write_text(renumbered)
    result = buf_breaking(tmp_path)
    assert result.returncode != 0
    assert 'field "9" with name "num_steps" on message "RolloutRequest" was deleted' in result.stdout, (
        result.stdout + result.stderr
    )
