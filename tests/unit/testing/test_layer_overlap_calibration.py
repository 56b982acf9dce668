"""The stand-in forward's layer of compute is calibrated on steady-state
work: a first call that loads a library (cuBLAS on a GPU) must not make
every later layer nearly free."""


import torch

from cpcache.testing import layer_overlap


def test_a_slow_first_call_is_not_taken_for_the_cost_of_a_layer(monkeypatch):
    """On a clock of its own (only the work advances it): the first call
    takes 0.5 s (a library loaded), every later one 1 ms."""
    calls = []
    clock = [0.0]
    tanh = torch.tanh

    def first_call_slow(x):
        calls.append(1)
        clock[0] += 0.5 if len(calls) == 1 else 0.001
        return tanh(x)

    monkeypatch.setattr(layer_overlap.torch, "tanh", first_call_slow)
    monkeypatch.setattr(layer_overlap.time, "perf_counter", lambda: clock[0])
    work = layer_overlap._calibrated(20.0, "cpu")
    before = len(calls)
    work()
    # 0.5 s counted in 20 calls would make a 20 ms layer a single iteration.
    assert len(calls) - before == 20
