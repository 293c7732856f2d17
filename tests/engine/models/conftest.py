"""Fixtures the families' model tests share."""

import pytest

from stillcut.kernels.cpu import decoder as native_decoder


@pytest.fixture
def native_steps(monkeypatch):
    """The rows of each step the native decode step ran (the test's own calls only)."""
    rows = []
    decode = native_decoder.CpuDecoder.decode

    def counted(decoder, input_ids, *args):
        rows.append(input_ids.shape[0])
        return decode(decoder, input_ids, *args)

    monkeypatch.setattr(native_decoder.CpuDecoder, "decode", counted)
    return rows
