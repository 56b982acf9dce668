"""The stand-in forward's layer of compute is calibrated on steady-state
work: a first call that loads a library (cuBLAS on a GPU) must not make
every later layer nearly free."""

import time

import torch

from cpcache.testing import layer_overlap


def test_a_slow_first_call_is_not_taken_for_the_cost_of_a_layer(monkeypatch):
    calls = []
    tanh = torch.tanh

    def first_call_slow(x):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.5)  # a library loaded at the first call
        return tanh(x)

    monkeypatch.setattr(layer_overlap.torch, "tanh", first_call_slow)
    work = layer_overlap._calibrated(20.0, "cpu")
    before = len(calls)
    work()
    # 0.5 s counted in 20 calls would make a 20 ms layer a single iteration.
    assert len(calls) - before > 1
