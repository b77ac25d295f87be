"""engine/host_memory.py: once a fast model has run a pack on the CPU, freed activations stay in the process (glibc's
malloc thresholds), where before every pass mapped and faulted its memory in again; a user's own malloc settings are
kept. Each case runs in a fresh process: the setting is process-wide, and once any test has run a model it holds for
the rest of the run."""

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds")

# glibc's malloc and free of a 64 MiB block (past its largest automatic mmap threshold, 32 MiB; 16,384 pages) on the
# main thread, touched each time, three times; the page faults of the last one.
CHILD = """
import ctypes, json, resource, sys
if sys.argv[1] != "none":
    from st_fastbackend import SentenceTransformer
    SentenceTransformer(sys.argv[2], backend=sys.argv[1], device="cpu").encode(["a text"])
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(64 << 20)
    libc.memset(block, 1, 64 << 20)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""
MAPPED_AGAIN = 10_000  # of 16,384 pages


def last_faults(backend: str, folder, **malloc_env: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, backend, str(folder)], capture_output=True, text=True, check=True,
        env={**env, **malloc_env},
    ).stdout  # fmt: skip
    return json.loads(out.splitlines()[-1])[-1]


@pytest.fixture(scope="module")
def folder(st_model):
    if last_faults("none", "") < MAPPED_AGAIN:  # huge pages back the block, say: nothing to keep
        pytest.skip("a freed 64 MiB block is not faulted in again here even with glibc's default thresholds")
    return st_model("bert", pooling_mode="mean")


@pytest.mark.slow
def test_a_model_run_on_the_cpu_keeps_freed_memory_for_the_next_pass(folder):
    assert last_faults("fast", folder) < 1_000


@pytest.mark.slow
def test_the_users_own_malloc_settings_are_kept(folder):
    assert last_faults("fast", folder, MALLOC_MMAP_THRESHOLD_=str(128 << 10)) > MAPPED_AGAIN
