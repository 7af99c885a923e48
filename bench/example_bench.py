"""What the one-example benchmarks (bahdanau.py, switchhead.py) share: re-running inside
bench/.venv (which compare.py creates) and running `attnc bench --json`."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / "bench" / ".venv"


def ensure_venv(script):
    """Re-runs `script` inside bench/.venv (compare.py creates it with torch and numpy)."""
    if Path(sys.prefix).resolve() == VENV.resolve():
        return
    python = VENV / "bin" / "python"
    if not python.exists():
        sys.exit(f"{VENV} does not exist: run `python3 bench/compare.py --quick` once to create it")
    os.execv(str(python), [str(python), str(Path(script).resolve()), *sys.argv[1:]])


def attnc_json(cmd):
    """Runs an `attnc bench ... --json` command; its JSON line as a dict (exits on failure)."""
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(str(c) for c in cmd)} failed: {out.stderr.strip()}")
    return next(json.loads(l[len("json: "):]) for l in out.stdout.splitlines() if l.startswith("json: "))
