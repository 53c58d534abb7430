import pytest

from gem_parallel import ParallelDims


def test_defaults_shard_inside_a_node_and_replicate_across_nodes():
    dims = ParallelDims(world_size=32, local_world_size=8)
    assert (dims.dense_replicate, dims.dense_shard, dims.sparse_group, dims.expert) == (4, 8, 32, 1)
    assert not dims.sparse_2d and not dims.expert_enabled
    one = ParallelDims(world_size=1)
    assert (one.dense_replicate, one.dense_shard, one.sparse_group) == (1, 1, 1)


def test_explicit_layout_and_derived_degrees():
    dims = ParallelDims(world_size=16, local_world_size=8, dense_shard=4, expert=2, sparse_group=8)
    assert dims.dense_replicate == 4 and dims.expert_shard == 2 and dims.sparse_replicas == 2
    assert dims.expert_enabled and dims.sparse_2d
    assert "2 replicas" in dims.describe() and "groups of 2" in dims.describe()


@pytest.mark.parametrize("fields, message", [
    ({"dense_replicate": 3}, r"dense_replicate \(3\) must divide the world size \(4\)"),
    ({"dense_replicate": 2, "dense_shard": 4}, r"dense_replicate \(2\) x dense_shard \(4\) must equal"),
    ({"dense_shard": 2, "expert": 4}, r"expert \(4\) must divide dense_shard \(2\)"),
    ({"sparse_group": 3}, r"sparse_group \(3\) must divide the world size \(4\)"),
    ({"dense_shard": 0}, r"dense_shard must be >= 1 or -1"),
])
def test_bad_layouts_are_one_line_errors_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message) as error:
        ParallelDims(world_size=4, **fields)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("local", [-2, 4])
def test_a_host_size_that_does_not_divide_the_world_is_refused(local):
    from gem_parallel.parallel_dims import LayoutError

    with pytest.raises(LayoutError, match=r"local_world_size \(.*\) must be >= 1 and divide the world size \(6\)"):
        ParallelDims(world_size=6, local_world_size=local)
