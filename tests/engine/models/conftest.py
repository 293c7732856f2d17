"""Fixtures the families' model tests share."""

import pytest

from stillcut.kernels import cpu_decode


@pytest.fixture
def native_steps(monkeypatch):
    """The rows of each step the native decode step ran (the test's own calls only)."""
    rows = []
    decode = cpu_decode.CpuDecoder.decode

    def counted(decoder, input_ids, *args):
        rows.append(input_ids.shape[0])
        return decode(decoder, input_ids, *args)

    monkeypatch.setattr(cpu_decode.CpuDecoder, "decode", counted)
    return rows
