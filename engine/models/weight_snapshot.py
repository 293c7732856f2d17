"""Which tensors a module tree holds, to notice cheaply when its weights were swapped.

What a model derives from its weights (banded views, the native decode step's addresses) is
stale once a weight is another tensor: a replaced parameter (`layer.w = nn.Parameter(...)`,
`load_state_dict(..., assign=True)`), a swapped submodule, or a parameter pointed at other
memory (`param.data = ...`, `.to()` to another dtype or device). In-place writes (`copy_`, a
plain `load_state_dict`) change values, not tensors, and need nothing rebuilt.
"""

from __future__ import annotations

import torch
from torch import nn


class WeightSnapshot:
    """The identity of every submodule, parameter and buffer of `root` and the address of each
    tensor's data, as they are now; `current()` says whether they still are.

    Checking is one dictionary lookup and identity test per entry plus one `data_ptr` per tensor
    (a model's check costs microseconds, see the closing note of the native decode step). It
    holds the module's own dictionaries, so a deep copy of the model carries a snapshot of the
    copy, whose tensors then sit at other addresses: not current, and rebuilt on first use.
    """

    def __init__(self, root: nn.Module) -> None:
        # (the module's own table, name, what it held): tables hold submodules, params, buffers
        self.entries: list[tuple[dict, str, object]] = []
        for module in root.modules():
            for table in (module._modules, module._parameters, module._buffers):
                self.entries.extend((table, name, value) for name, value in table.items())
        self.tensors = [value for _, _, value in self.entries if isinstance(value, torch.Tensor)]
        self.addresses = [tensor.data_ptr() for tensor in self.tensors]

    def current(self) -> bool:
        """False once a submodule, parameter or buffer is another object, or a tensor's data
        moved; True after in-place writes only."""
        for table, name, value in self.entries:
            if table.get(name) is not value:
                return False
        return list(map(torch.Tensor.data_ptr, self.tensors)) == self.addresses
