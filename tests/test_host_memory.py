"""engine/host_memory.py: once a fast model is set up on the CPU, freed activations stay in the process (glibc's
malloc thresholds), where before every pass mapped and faulted its memory in again. Each case runs in a fresh
process: the setting is process-wide, and once any test has loaded a model it holds for the rest of the run."""

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds")

# glibc's malloc and free of a 64 MiB block (past its largest automatic mmap threshold, 32 MiB; 16,384 pages), touched
# each time, three times; the page faults of the last one.
CHILD = """
import ctypes, json, resource, sys
if sys.argv[1] != "none":
    from st_fastbackend import SentenceTransformer
    SentenceTransformer(sys.argv[2], backend=sys.argv[1], device="cpu")
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


def last_faults(backend: str, folder) -> int:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, backend, str(folder)], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.splitlines()[-1])[-1]


def test_a_cpu_model_keeps_freed_activations_for_the_next_pass(st_model):
    folder = st_model("bert", pooling_mode="mean")
    assert last_faults("none", folder) > 10_000  # glibc's default: mapped and faulted in again
    assert last_faults("fast", folder) < 1_000
