import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import itertools  # noqa: E402
from pathlib import Path  # noqa: E402

import helpers  # noqa: E402
import kernel_standins  # noqa: E402
import pytest  # noqa: E402
import serving  # noqa: E402
import torch  # noqa: E402
from builders import build_st_model, make_texts  # noqa: E402

from st_fastbackend import SentenceTransformer  # noqa: E402
from st_fastbackend.engine.runtime import choose_runtime  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))
_counter = itertools.count()


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="the device the models under test run on: cpu (default) or cuda")


def pytest_configure(config):
    helpers.DEVICE = config.getoption("--device")
    if helpers.DEVICE != "cpu" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {helpers.DEVICE}: PyTorch sees no GPU here.")


@pytest.fixture(scope="session", autouse=True)
def digest_cache(tmp_path_factory):
    """The corpus job's cache of file digests (corpus/identity.py) in the session's temporary folder, not the user's
    (servers and CLIs started in a subprocess inherit it)."""
    from st_fastbackend.corpus.identity import CACHE_ENV

    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def standin(monkeypatch):
    """standin(name): the CPU made to look like a GPU with that CUDA kernel release (tests/kernel_standins.py)."""
    yield lambda name: kernel_standins.install(monkeypatch, name)
    monkeypatch.undo()
    choose_runtime.cache_clear()


@pytest.fixture
def bf16_products_taken(monkeypatch):
    """PyTorch's bf16 setting taken wherever oneDNN runs bf16, as on a CPU with bf16 dot products: the bf16 products'
    numbers are tested on AVX-512 CPUs without them too (Ice Lake), where the engine leaves them fp32 for speed."""
    from st_fastbackend.engine import onednn

    monkeypatch.setattr(onednn, "native_bf16", lambda: True)


@pytest.fixture(scope="session")
def texts() -> list[str]:
    """40 texts from 1 word to 300 words; with max_seq_length 256 the longest are truncated."""
    return make_texts(40)


@pytest.fixture(scope="session")
def st_model(tmp_path_factory):
    """st_model(family, **options) -> a saved ST folder, built once per distinct set of options."""
    cache: dict = {}

    def build(family: str, **options) -> Path:
        key = (family, repr(sorted(options.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"{family}_{next(_counter)}")
            options.setdefault("max_seq_length", 256)
            cache[key] = build_st_model(folder, family, **options)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def served_folder(st_model) -> Path:
    """What the server tests serve: a small Mistral, last-token pooling, a "query" prompt."""
    return st_model("mistral", pooling_mode="lasttoken", prompts=serving.PROMPTS)


@pytest.fixture(scope="module")
def folder(st_model):
    """The model the corpus tests (test_corpus*.py) embed with; a module may have a `folder` of its own."""
    return st_model("bert", pooling_mode="mean")


@pytest.fixture(scope="module")
def expected(folder, texts):
    return SentenceTransformer(str(folder), backend="fast", device="cpu").encode(texts)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray of 2 CPUs, as this project's machines have, for the tests of one module."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def minilm_server():
    """`st-fastbackend serve` on the bundled all-MiniLM-L6-v2: (process, url)."""
    process, url = serving.start_server(helpers.minilm_path())
    yield process, url
    process.terminate()
    process.wait(30)
