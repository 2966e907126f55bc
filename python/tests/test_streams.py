# Copyright kvferry authors. Apache-2.0.
"""The stream handle kvferry is given for torch's CUDA tensors: torch's default stream (whose
cuda_stream reads 0) goes over as CUDA's legacy stream, never as 0, which kvferry reads as its own
non-blocking stream, not ordered after the kernels that wrote q, k and v."""
import pytest

torch = pytest.importorskip("torch")
import kvferry  # noqa: E402


class _Stream:
    def __init__(self, handle):
        self.cuda_stream = handle


def test_default_stream_goes_over_as_the_legacy_stream(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(0))
    assert kvferry._torch_stream() == 1


def test_a_stream_of_torch_goes_over_as_itself(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(0x7F00DEAD0))
    assert kvferry._torch_stream() == 0x7F00DEAD0


def test_host_tensors_take_no_stream():
    assert kvferry._stream_of(torch.zeros(2)) == 0
