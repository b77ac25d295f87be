"""What would make a GPU's host wait, or copy, counted with the meta device standing in for the GPU (it records
operations without computing)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class _Counter:
    """Its torch-function and dispatch modes entered together, and left in reverse."""

    _modes: tuple = ()

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class HostToDevice(_Counter):
    """Counts copies of host data to another device: a host tensor moved (.to, copy_), seen among the dispatched
    operations, and a tensor built on the device from host values (torch.tensor or torch.as_tensor of a list with
    device=...), which PyTorch fills on the host and copies without dispatching: only a torch-function mode sees it.
    `waits`: those of them that make the host wait for a GPU's queue, all but the non_blocking ones (which the code
    sends through pinned memory on a GPU: engine/batch.py host_to_device; the meta device cannot pin)."""

    def __init__(self) -> None:
        self.copies = 0
        self.waits = 0
        self._modes = (_BuiltOnDevice(self), _Moved(self))


class _BuiltOnDevice(TorchFunctionMode):
    def __init__(self, counter: HostToDevice) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and not isinstance(args[0], torch.Tensor):  # a tensor: _Moved
            copied = int(torch.device(kwargs.get("device") or "cpu").type != "cpu")
            self.counter.copies += copied
            self.counter.waits += copied
        return func(*args, **kwargs)


class _Moved(TorchDispatchMode):
    def __init__(self, counter: HostToDevice) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            target = args[0] if func is torch.ops.aten.copy_.default else out
            copied = int(source.device.type == "cpu" and target.device.type != "cpu")
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            self.counter.copies += copied
            self.counter.waits += copied * blocking
        return out


class HostWaits(_Counter):
    """Counts what makes the host wait for a GPU, with the CPU standing in (its tensors on the host already): values
    read on the host (.tolist(), .item(), .numpy(), a blocking .cpu() or .to("cpu")), and operations whose output's
    size depends on the values (nonzero, masked_select, a boolean index: the host reads the count). A non-blocking
    copy to the host does not wait."""

    def __init__(self) -> None:
        self.count = 0
        self._modes = (_ReadOnHost(self), _SizedByValues(self))


class _ReadOnHost(TorchFunctionMode):
    READS = (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.cpu)

    def __init__(self, counter: HostWaits) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.READS:
            self.counter.count += 1
        elif func is torch.Tensor.to and not kwargs.get("non_blocking"):
            devices = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
            self.counter.count += int(any(torch.device(d).type == "cpu" for d in devices))
        return func(*args, **kwargs)


class _SizedByValues(TorchDispatchMode):
    OPS = (torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default)

    def __init__(self, counter: HostWaits) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        boolean_index = func is torch.ops.aten.index.Tensor and any(
            i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        )
        self.counter.count += int(func in self.OPS or boolean_index)
        return func(*args, **(kwargs or {}))
