"""A guard that ends a Ray Data execution stalled on resources with an error, instead of a silent wait.

Stalled: no operator has given out a block for `timeout` seconds while an operator with work to do cannot get
what it asks for (a read task beside actors that hold every CPU, work of another job holding them, actors Ray
Data wants more of than the cluster has). A long model call is not a stall: its task holds its resources.

It is one of Ray Data's execution callbacks: the executor calls it after each scheduling step, in the thread
that runs the dataset, and what it raises fails the execution. It reads the executor's operators, resource
manager and topology, names checked against Ray Data 2.53 and 2.60 (registration differs, see guard_stalls)."""

from __future__ import annotations

import time

import ray
from ray.data._internal.execution.execution_callback import ExecutionCallback

CONFIG_KEY = "st_fastbackend.stall_timeout_s"


class PipelineStalled(RuntimeError):
    """The dataset made no progress for the stall timeout while its tasks waited for resources."""


def guard_stalls(context, timeout: float) -> None:
    """End the executions of the datasets that share `context` (a Dataset's DataContext) when stalled."""
    if timeout <= 0:
        raise ValueError(f"stall_timeout (--stall-timeout) must be positive seconds, got {timeout:g}")
    context.set_config(CONFIG_KEY, timeout)
    if hasattr(context, "custom_execution_callback_classes"):  # Ray 2.60: classes, one instance per execution
        if StallGuard not in context.custom_execution_callback_classes:
            context.custom_execution_callback_classes = [*context.custom_execution_callback_classes, StallGuard]
        return
    from ray.data._internal.execution.execution_callback import add_execution_callback, get_execution_callbacks

    if not any(isinstance(callback, StallGuard) for callback in get_execution_callbacks(context)):
        add_execution_callback(StallGuard(), context)  # Ray 2.53: one instance, reset at each execution


class StallGuard(ExecutionCallback):
    def before_execution_starts(self, executor) -> None:
        self.outputs, self.since, self.checked = None, time.monotonic(), 0.0

    def on_execution_step(self, executor) -> None:
        timeout = executor._data_context.get_config(CONFIG_KEY)
        outputs = [op.metrics.num_outputs_taken for op in executor._topology]
        now = time.monotonic()
        if outputs != self.outputs:
            self.outputs, self.since = outputs, now
        elif timeout and now - self.since >= timeout and now - self.checked >= 1:  # Ray's state: once a second
            self.checked = now
            waiting = _waiting(executor)
            if waiting:
                raise PipelineStalled(_message(executor, waiting, now - self.since))


def _waiting(executor) -> list[str]:
    """What each operator that has work and cannot start it waits for (e.g. 'ListFiles waits for 1 CPU')."""
    free = ray.available_resources()
    total = ray.cluster_resources()
    usage = executor._resource_manager.get_global_usage()  # Ray Data's ask, actors not yet placed included
    short = usage.cpu > total.get("CPU", 0) or usage.gpu > total.get("GPU", 0)
    waiting = []
    for op, state in executor._topology.items():
        if op.has_completed() or not (op.num_active_tasks() or state.total_enqueued_input_blocks()):
            continue
        need = op.incremental_resource_usage()
        if need.cpu > free.get("CPU", 0) or need.gpu > free.get("GPU", 0):
            waiting.append(f"{op.name} waits for {_amount(need.cpu, need.gpu)}")
        elif short and not op.num_active_tasks():  # input queued, nothing running: its actors are not placed
            waiting.append(f"{op.name} waits for its actors")
    return waiting


def _message(executor, waiting: list[str], seconds: float) -> str:
    free, total = ray.available_resources(), ray.cluster_resources()
    held = [f"{op.name} {_amount(use.cpu, use.gpu)}" for op in executor._topology
            if (use := executor._resource_manager.get_op_usage(op)).cpu or use.gpu]  # fmt: skip
    return (f"no rows out for {seconds:.0f}s while {'; '.join(waiting)}: the Ray cluster has "
            f"{_amount(total.get('CPU', 0), total.get('GPU', 0))} ({_amount(free.get('CPU', 0), free.get('GPU', 0))}"
            f" free); this job asks for {', '.join(held) or 'nothing'}. Free resources for it (fewer num_workers or "
            f"cpus_per_worker) or raise stall_timeout (--stall-timeout)")  # fmt: skip


def _amount(cpus: float, gpus: float) -> str:
    return f"{cpus:g} CPU" + (f" and {gpus:g} GPU" if gpus else "")
