"""Which tensors a module tree holds, to notice cheaply when its weights were swapped.

What a model derives from its weights (banded views, the native decode step's addresses) is
stale once a weight is another tensor: a replaced parameter (`layer.w = nn.Parameter(...)`,
`load_state_dict(..., assign=True)`), a swapped submodule, or a parameter pointed at other
memory (`param.data = ...`, `.to()` to another dtype or device). In-place writes (`copy_`, a
plain `load_state_dict`) change values, not tensors, and need nothing rebuilt.
"""

from __future__ import annotations

import operator

import torch
from torch import nn


class WeightSnapshot:
    """What every submodule, parameter and buffer table of `root` holds and the address of each
    tensor's data, as they are now; `current()` says whether they still are.

    Checking is one identity test per entry, table by table (in C: no Python call per entry),
    plus one `data_ptr` per tensor: a step calls it, and after a decode step has streamed the
    weights through the caches every object it touches comes from memory, so it touches only
    the tables and tensors. It holds the module's own dictionaries, so a deep copy of the model
    carries a snapshot of the copy, whose tensors then sit at other addresses: not current, and
    rebuilt on first use.
    """

    def __init__(self, root: nn.Module) -> None:
        # (a module's own table, what it held in order): tables hold submodules, params, buffers
        self.tables: list[tuple[dict, list]] = []
        for module in root.modules():
            for table in (module._modules, module._parameters, module._buffers):
                if table:  # (one added to an empty table changes nothing the model made)
                    self.tables.append((table, list(table.values())))
        self.tensors = [
            value
            for _, values in self.tables
            for value in values
            if isinstance(value, torch.Tensor)
        ]
        self.addresses = [tensor.data_ptr() for tensor in self.tensors]

    def current(self) -> bool:
        """False once a table holds another submodule, parameter or buffer (or one more or
        fewer), or a tensor's data moved; True after in-place writes only."""
        for table, values in self.tables:
            if len(table) != len(values) or not all(map(operator.is_, table.values(), values)):
                return False
        return list(map(torch.Tensor.data_ptr, self.tensors)) == self.addresses
