"""Run by torchrun from test_sparse.py: parallelise a small two-tower model over the ranks, train a few steps."""

import json
import sys

import torch
import torch.distributed as dist
from teardown import finish
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from gem_parallel import ParallelDims, dense_parameters, parallelize_kunlun, table_placement
from gem_parallel.sparse import local_shards

FEATURES = ["a", "b", "c", "d"]


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bags = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t_{f}", embedding_dim=4, num_embeddings=50, feature_names=[f]) for f in FEATURES],
            device=torch.device("meta"),
        )
        self.out = torch.nn.Linear(4 * len(FEATURES), 1, device=torch.device("meta"))

    def forward(self, kjt):
        pooled = self.bags(kjt).to_dict()
        self.features = torch.cat([pooled[f] for f in FEATURES], 1)
        return self.out(self.features).squeeze(1)


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = ParallelDims(world_size=dist.get_world_size())
    model = parallelize_kunlun(Model(), dims, dims.build_meshes("cpu"), torch.device("cpu"), seed=0,
                               sparse_optimizer_kwargs={"lr": 0.5})
    dense = torch.optim.SGD(list(dense_parameters(model).values()), lr=0.1)
    before = {k: v.clone() for k, v in _local_tables(model).items()}
    # every rank looks up only ids < 10, so rows >= 10 must stay untouched by the fused optimizer
    g = torch.Generator().manual_seed(rank)
    grad_errors, spread = [], []
    for _ in range(3):
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=FEATURES, values=torch.randint(0, 10, (4 * 8,), generator=g), lengths=torch.ones(4 * 8, dtype=torch.int64)
        )
        loss = model(kjt).pow(2).mean()
        loss.backward()
        # the dense layer's gradient is the mean over the ranks of each rank's own: recomputed by hand from this
        # rank's features (d/dW mean(y^2) = 2 mean(y x)), gathered and averaged, against what FSDP reduced
        out, features = model.module.out, model.module.features.detach()
        y = features @ out.weight.full_tensor().detach().t() + out.bias.full_tensor().detach()
        mine = (2 * y * features).mean(0, keepdim=True)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        reduced = out.weight.grad.full_tensor()
        grad_errors.append(float((reduced - torch.stack(every).mean(0)).abs().max()))
        spread.append(float((every[0] - every[1]).abs().max()))
        dense.step()
        dense.zero_grad()
    after = _local_tables(model)
    result = {
        "placement": table_placement(model),
        "local_tables": sorted(after),
        "looked_up_rows_changed": all(not torch.equal(before[t][:10], after[t][:10]) for t in after),
        "other_rows_unchanged": all(torch.equal(before[t][10:], after[t][10:]) for t in after),
        "dense_grad_error": max(grad_errors),  # FSDP's reduced gradient against the ranks' mean
        "dense_grad_spread": min(spread),  # how far the ranks' own gradients lie apart
    }
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    finish()


def _local_tables(model) -> dict[str, torch.Tensor]:
    tables = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("bags."):
            for shard, _ in local_shards(tensor):
                tables[name.split(".")[2]] = shard.detach().clone()
    return tables


if __name__ == "__main__":
    main(sys.argv[1])
