import torch
from torch import nn

from gem_kunlun import KunlunConfig, KunlunModel
from gem_kunlun.testing import SPEC
from gem_parallel import init_dense_parameters
from gem_parallel.init import TABLE_BLOCK_ROWS, init_table_rows


def dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "embedding" not in k and "item_tower.bags" not in k}


def build(seed: int = 3, drop_experts: tuple[str, ...] = ()) -> KunlunModel:
    model = KunlunModel(SPEC, KunlunConfig(num_experts=4), device=torch.device("meta"))
    for layer in model.layers:
        for key in drop_experts:
            del layer.moe.experts[key]
    init_dense_parameters(model, seed, torch.device("cpu"))
    return model


def test_dense_values_depend_on_the_seed_and_the_name_only():
    whole, again, other = build(), build(), build(seed=4)
    for key, value in dense_state(whole).items():
        assert torch.equal(value, dense_state(again)[key]), key
    assert any(not torch.equal(v, dense_state(other)[k]) for k, v in dense_state(whole).items())
    # a rank that keeps only some experts (expert parallelism) gets exactly their single-process values
    part = dense_state(build(drop_experts=("0", "2")))
    assert all(torch.equal(v, dense_state(whole)[k]) for k, v in part.items())
    assert "trunk.layers.0.moe.experts.1.projection" in part and "trunk.layers.0.moe.experts.0.projection" not in part
    assert all(not v.is_meta for v in dense_state(whole).values())


def test_table_rows_are_the_same_whichever_shard_draws_them():
    rows, cols = 2 * TABLE_BLOCK_ROWS + 100, 6
    init = lambda w: nn.init.uniform_(w, -0.1, 0.1)  # noqa: E731
    whole = torch.empty(rows, cols)
    init_table_rows(whole, 0, 0, cols, init, seed=1, table="t")
    # row-wise shards straddling block boundaries and column-wise shards
    pieces = torch.empty(rows, cols)
    for start, end in ((0, 3000), (3000, TABLE_BLOCK_ROWS + 7), (TABLE_BLOCK_ROWS + 7, rows)):
        for c0, c1 in ((0, 2), (2, 6)):
            piece = torch.empty(end - start, c1 - c0)
            init_table_rows(piece, start, c0, cols, init, seed=1, table="t")
            pieces[start:end, c0:c1] = piece
    assert torch.equal(whole, pieces)
    assert whole.abs().max() <= 0.1 and whole.std() > 0.05
    other = torch.empty(rows, cols)
    init_table_rows(other, 0, 0, cols, init, seed=1, table="u")
    assert not torch.equal(whole, other)


class _Adapter(nn.Module):
    """A parent whose reset sets a child's values (as the distillation adapter zeroes its output layer)."""

    def __init__(self, device=None):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(3, device=device))
        self.out = nn.Linear(4, 1, device=device)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.ones_(self.scale)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)


def test_a_parents_reset_of_its_children_holds_after_meta_initialisation():
    """Children are reset before their parents, as eager construction runs them: the parent's values for its child
    (written into meta tensors, then overwritten by the child's own reset) held only when built eagerly."""
    model = _Adapter(device="meta")
    init_dense_parameters(model, seed=0, device=torch.device("cpu"))
    assert torch.equal(model.out.weight, torch.zeros(1, 4)) and torch.equal(model.scale, torch.ones(3))
