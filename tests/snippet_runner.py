"""Runs code blocks in order, each in a fresh namespace (Python) or a fresh bash (shell), in its page's folder, and
writes what each did. One process for all of them: the imports are paid once.

Usage: python snippet_runner.py BLOCKS.json RESULTS.json, BLOCKS a list of {name, lang, code, cwd}."""

import contextlib
import io
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path


def run_python(code: str, name: str) -> tuple[bool, str]:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
    except BaseException:  # a snippet's SystemExit is a failure too
        return False, out.getvalue() + traceback.format_exc()
    return True, out.getvalue()


def run_bash(code: str) -> tuple[bool, str]:
    try:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as error:
        return False, f"timed out after {error.timeout} s"
    return done.returncode == 0, f"exit status {done.returncode}\n{done.stdout}{done.stderr}"


def main(blocks_path: str, results_path: str) -> None:
    results = {}
    for block in json.loads(Path(blocks_path).read_text()):
        os.chdir(block["cwd"])
        run = run_python(block["code"], block["name"]) if block["lang"] == "python" else run_bash(block["code"])
        results[block["name"]] = {"ok": run[0], "output": run[1][-6000:]}
        with open(results_path, "w") as f:  # after every block: what ran is kept if the runner is killed
            json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
