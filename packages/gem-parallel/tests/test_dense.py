import pytest
from torch import nn

from gem_parallel.dense import DenseOptions, compile_units


def test_a_sequential_chain_of_blocks_is_one_compile_unit_and_a_module_list_is_not():
    chain = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    listed = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    alone = nn.Module()
    alone.block = nn.Linear(2, 2)
    slots = [(chain, "0"), (chain, "1"), (listed, "0"), (listed, "1"), (alone, "block")]
    units = compile_units(slots)
    assert len(units) == 4 and units[0] is chain and units[1] is listed[0] and units[2] is listed[1]
    assert units[3] is alone.block


def test_an_unknown_compile_mode_is_refused():
    with pytest.raises(ValueError, match="compile must be one of off, default, reduce-overhead, got 'max'"):
        DenseOptions(compile="max")


def test_compiling_the_experts_of_compiled_blocks_is_refused():
    with pytest.raises(ValueError, match="^compile_experts compiles the MoEs of blocks left eager; with compile = 'default'"):
        DenseOptions(compile="default", compile_experts=True)
