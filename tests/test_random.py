"""RNG tracker: named streams, fork isolation, capture and restore."""

import pytest
import torch

from meshtrain import ParallelMesh
from meshtrain.parallel.layers.rng import REPLICATED, TENSOR_PARALLEL, RNGTracker


def test_fork_leaves_the_outer_stream_alone():
    tracker = RNGTracker()
    tracker.add("a", 1)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("a"):
        torch.rand(5)
    assert torch.equal(torch.rand(3), expected)


def test_fork_continues_its_own_stream():
    tracker = RNGTracker()
    tracker.add("a", 1)
    with tracker.fork("a"):
        first = torch.rand(2)
    with tracker.fork("a"):
        second = torch.rand(2)
    torch.manual_seed(1)
    assert torch.equal(torch.cat([first, second]), torch.rand(4))


def test_states_capture_and_replay():
    tracker = RNGTracker()
    tracker.add("a", 3)
    saved = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(4), first)


def test_errors():
    tracker = RNGTracker()
    tracker.add("a", 3)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 4)
    with pytest.raises(KeyError, match="unknown RNG state 'b'"):
        with tracker.fork("b"):
            pass
    with pytest.raises(ValueError, match="do not match"):
        tracker.set_states({})


def test_for_mesh_has_both_streams():
    tracker = RNGTracker.for_mesh(ParallelMesh.local(), seed=5)
    with tracker.fork(REPLICATED):
        a = torch.rand(3)
    with tracker.fork(TENSOR_PARALLEL):
        b = torch.rand(3)
    assert not torch.equal(a, b)
