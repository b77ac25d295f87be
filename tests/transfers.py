"""What would make a GPU's host wait, or copy, counted with the meta device standing in for the GPU (it records
operations without computing)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class HostToDevice:
    """Counts copies of host data to another device: a host tensor moved (.to, copy_), seen among the dispatched
    operations, and a tensor built on the device from host values (torch.tensor or torch.as_tensor of a list with
    device=...), which PyTorch fills on the host and copies without dispatching: only a torch-function mode sees it.
    A pageable host tensor's copy to a GPU waits for the GPU's queue."""

    def __init__(self) -> None:
        self.copies = 0
        self._modes = (_BuiltOnDevice(self), _Moved(self))

    def __enter__(self) -> HostToDevice:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class _BuiltOnDevice(TorchFunctionMode):
    def __init__(self, counter: HostToDevice) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and not isinstance(args[0], torch.Tensor):  # a tensor: _Moved
            self.counter.copies += int(torch.device(kwargs.get("device") or "cpu").type != "cpu")
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
            self.counter.copies += int(source.device.type == "cpu" and target.device.type != "cpu")
        return out
