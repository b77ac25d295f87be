"""What the eval/ scripts share, so that each script holds only its workload.

options  where the repository, the data and the results are; the command-line options the scripts share
data     the texts under ../shared/data (WikiText-2, STS-B, SICK, SciFact), read as their SOURCE.md describes
models   the real all-MiniLM-L6-v2 and random-weight models in published shapes; plain and fast side by side
measure  alternating timed rounds, peak memory, the GEMM ceiling and a model's FLOPs
report   the machine line, the results file under eval/results/ and the chart
serve    a real `st-fastbackend serve` process on loopback, and a one-word probe of it

Only the standard library is imported on import (eval/peer.py runs under other systems' Pythons).
"""
