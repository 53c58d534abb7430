import pytest
import torch

from gem_parallel import process_group_backend, resolve_collectives
from gem_parallel.collectives import copy_engine_unavailable


def test_backend_per_device_and_one_line_errors():
    assert process_group_backend("auto", torch.device("cpu")) == "gloo"
    assert process_group_backend("auto", torch.device("cuda", 0)) == "nccl"
    assert process_group_backend("copy_engine", torch.device("cuda", 0)) == "nccl"
    with pytest.raises(ValueError, match="copy_engine.*needs CUDA devices"):
        process_group_backend("copy_engine", torch.device("cpu"))
    with pytest.raises(ValueError, match="collectives must be one of"):
        process_group_backend("mpi", torch.device("cpu"))


def test_copy_engine_falls_back_with_a_reason():
    one = resolve_collectives("copy_engine", torch.device("cuda", 0), ranks=1)
    assert not one.copy_engine and one.backend == "nccl" and "one rank" in one.fallback
    plain = resolve_collectives("nccl", torch.device("cuda", 0), ranks=8)
    assert not plain.copy_engine and not plain.fallback
    # without CUDA (this machine) or across nodes there is always a reason
    assert copy_engine_unavailable(nodes=2)
