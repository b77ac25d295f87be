"""embed_dataset's actor pool fitted to the cluster before any task runs, and the GPUs each actor holds.

Ray Data's read, repartition and write tasks ask for one CPU each (its default). A pool holding every CPU of the
cluster leaves them none, and the job waits for ever without an error: the actors wait for rows the read task
cannot start to give them. So the pool leaves READ_CPUS free, with fewer actors where their number is Ray's to
choose, or a smaller share of a CPU each where the user named it; more actors than the cluster's CPUs hold is
refused, naming the numbers. Nothing here imports Ray or torch at import time."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

logger = logging.getLogger(__name__)

READ_CPUS = 1.0  # what one of Ray Data's read / repartition / write tasks asks for by default
STALL_TIMEOUT = 300.0  # seconds without output while tasks wait for resources (ray_stall.py): a node may be coming


class PoolError(ValueError):
    """A pool of actors that this cluster cannot run as asked."""


@dataclass(frozen=True)
class Pool:
    """The actors' pool: `size` actors, or (size None) as many as Ray grows from one up to `max_size`; each
    reserves `cpus` CPUs and `gpus` GPUs in Ray's accounting."""

    size: int | None
    max_size: int | None
    cpus: float
    gpus: float

    def strategy(self):
        import ray.data

        if self.size:
            return ray.data.ActorPoolStrategy(size=self.size)
        return ray.data.ActorPoolStrategy(min_size=1, max_size=self.max_size)


def cluster_resources() -> tuple[float, float]:
    """(CPUs, GPUs) of the cluster. Where Ray is not started yet it is started here, as Ray Data would start it at
    execution (ray.init() with no argument): the pool is then sized on that same cluster."""
    import ray

    if not ray.is_initialized():
        ray.init()
    resources = ray.cluster_resources()
    return resources.get("CPU", 0.0), resources.get("GPU", 0.0)


def fit_pool(workers: int | None, cpus: float, gpus: float, cluster_cpus: float, cluster_gpus: float) -> Pool:
    """The pool for `workers` actors (None: Ray's choice) of `cpus` CPUs and `gpus` GPUs each on a cluster of
    `cluster_cpus` and `cluster_gpus`, leaving READ_CPUS free; what it changes is logged in one line."""
    most_gpu = _gpu_actors(workers, gpus, cluster_gpus)
    free = cluster_cpus - READ_CPUS
    if cpus and free <= 0:
        raise PoolError(f"the Ray cluster has {cluster_cpus:g} CPU: none is left for the actors beside Ray Data's "
                        f"read tasks' {READ_CPUS:g}; start Ray with more (e.g. ray.init(num_cpus=2))")  # fmt: skip
    if not cpus:  # actors that reserve no CPU never take one from the read tasks
        return Pool(workers, None if workers else most_gpu, 0.0, gpus)
    if workers is None:
        most = int(free // cpus)
        if most == 0:  # one actor does not fit beside the read tasks: it reserves what is left
            logger.info(_leaving(f"one actor reserves {free:g} CPU (torch threads: {cpus:g})", cluster_cpus))
            return Pool(1, None, free, gpus)
        if most < int(cluster_cpus // cpus):
            logger.info(_leaving(f"at most {most} actors of {cpus:g} CPU", cluster_cpus))
        return Pool(None, min(most, most_gpu) if most_gpu else most, cpus, gpus)
    if workers * cpus > cluster_cpus:
        raise PoolError(f"num_workers={workers} (--num-workers): {workers} actors of {cpus:g} CPU need "
                        f"{workers * cpus:g} CPUs and Ray Data's read tasks {READ_CPUS:g} more, but the Ray cluster "
                        f"has {cluster_cpus:g} CPUs; ask for fewer workers or cpus_per_worker")  # fmt: skip
    if workers * cpus > free:  # the threads as asked; Ray's reservation shrunk so that a read task fits beside
        each = f"{workers} actors reserve {free / workers:.3g} CPU each (torch threads: {cpus:g})"
        logger.warning(_leaving(each, cluster_cpus))
        return Pool(workers, None, free / workers, gpus)
    return Pool(workers, None, cpus, gpus)


def _leaving(what: str, cluster_cpus: float) -> str:
    return f"embed_dataset: {what}, leaving {READ_CPUS:g} of the Ray cluster's {cluster_cpus:g} CPUs to read and write"


def _gpu_actors(workers: int | None, gpus: float, cluster_gpus: float) -> int | None:
    """How many actors of `gpus` GPUs the cluster holds (None: they hold none); refuses a pool it cannot hold,
    which Ray would otherwise wait on for ever."""
    if not gpus:
        return None
    most = math.floor(cluster_gpus / gpus + 1e-9)
    if most < (workers or 1):
        actors = f"{workers or 1} actor{'s' if (workers or 1) > 1 else ''}"
        raise PoolError(f"{actors} of {gpus:g} GPU (gpus_per_worker, --gpus-per-worker) need "
                        f"{(workers or 1) * gpus:g} GPUs, but the Ray cluster has {cluster_gpus:g}")  # fmt: skip
    return most


def worker_gpus(gpus: float | None, device: str | None) -> float:
    """GPUs per actor: `gpus` where given, else one where the model runs on CUDA (`device`, else the driver's
    device as sentence-transformers picks it), else none. Ray hides the GPUs from an actor that holds none, so a
    CUDA device without GPUs would fail to load in every actor; a CPU device with GPUs would hold them unused."""
    if gpus is not None and gpus < 0:
        raise PoolError(f"gpus_per_worker (--gpus-per-worker) must be 0 or more, got {gpus:g}")
    on_cuda = str(device).startswith("cuda")
    if device and on_cuda and gpus == 0:
        raise PoolError(f"device {device!r} with no GPU per worker: Ray hides the GPUs from an actor that holds "
                        f"none; give each one, e.g. gpus_per_worker=1 (--gpus-per-worker 1)")  # fmt: skip
    if device and not on_cuda and gpus:
        raise PoolError(f"device {device!r} with gpus_per_worker={gpus:g} (--gpus-per-worker): the actors would "
                        f"hold GPUs their model does not use; leave it out, or use a cuda device")  # fmt: skip
    if gpus is None:
        return 1.0 if (on_cuda if device else _driver_on_cuda()) else 0.0
    return float(gpus)


def _driver_on_cuda() -> bool:
    from sentence_transformers.util import get_device_name

    return get_device_name().startswith("cuda")
