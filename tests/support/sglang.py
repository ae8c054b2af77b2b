"""SGLang's released package, whose own code the HTTP front end is checked against."""

import fcntl
import subprocess
import sys
import zipfile
from pathlib import Path

SGLANG = "sglang==0.5.23"


def sglang_source(cache_dir: Path, member: str) -> str:
    """The text of ``member`` (a path inside the package) of SGLang's released wheel, downloaded from
    the package index once per run into the shared cache (under a lock: the test workers share it).
    Its files are loaded by path or taken apart, never imported as the package: that would pull its
    GPU stack. Nothing of it is in the repo."""
    folder = cache_dir / SGLANG.replace("==", "-")
    folder.mkdir(exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not any(folder.glob("sglang-*.whl")):
            download = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                "-d",
                str(folder),
                SGLANG,
            ]
            subprocess.run(download, check=True, timeout=600)
    with zipfile.ZipFile(next(folder.glob("sglang-*.whl"))) as wheel:
        return wheel.read(member).decode()
