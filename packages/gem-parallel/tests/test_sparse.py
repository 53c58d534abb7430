import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).parent / "workers" / "sparse_worker.py"


@pytest.mark.slow
def test_tables_are_sharded_over_ranks_and_updated_row_wise_in_backward(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER), str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    placement = ranks[0]["placement"]
    assert sorted(placement) == ["t_a", "t_b", "t_c", "t_d"]
    assert all(len(owners) == 1 for owners in placement.values())  # table-wise: one owner per table
    assert {owners[0] for owners in placement.values()} == {0, 1}  # both ranks hold tables
    for rank, result in enumerate(ranks):
        assert result["local_tables"] == sorted(t for t, owners in placement.items() if owners == [rank])
        assert result["looked_up_rows_changed"] and result["other_rows_unchanged"]
    # the dense part is data parallel: its gradient is the mean of the ranks' own, which differ
    for result in ranks:
        assert result["dense_grad_spread"] > 1e-3 and result["dense_grad_error"] < 1e-6, result


def test_index_dedup_is_refused_without_a_gpu_in_one_line():
    from torch import nn

    from gem_parallel.parallel_dims import LayoutError
    from gem_parallel.sparse import shard_embeddings

    with pytest.raises(LayoutError, match="^sparse_index_dedup needs GPUs"):
        shard_embeddings(nn.Linear(2, 2), torch.device("cpu"), index_dedup=True)


def test_tables_too_narrow_for_torchrecs_sharded_lookups_are_refused_in_one_line():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    from gem_parallel.sparse import TableWidthError, shard_embeddings

    tables = [EmbeddingBagConfig(name=f"t_{n}", embedding_dim=dim, num_embeddings=10, feature_names=[n])
              for n, dim in (("a", 8), ("b", 6), ("c", 3))]
    model = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    with pytest.raises(TableWidthError, match=r"^embedding table 't_b' is 6 wide \(and 1 more\); TorchRec's sharded "
                                              r"lookups need widths that are a multiple of 4$"):
        shard_embeddings(model, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_sequence_lookups_in_another_dtype_are_refused_on_the_cpu_or_unknown_in_one_line(dtype):
    from torch import nn

    from gem_parallel.parallel_dims import LayoutError
    from gem_parallel.sparse import shard_embeddings

    expected = "^sequence lookups in torch.bfloat16 need GPUs" if dtype is torch.bfloat16 else \
        r"^the sequence tables' lookup dtype must be one of \[None, torch.bfloat16, torch.float16\], got torch.int8$"
    with pytest.raises(LayoutError, match=expected):
        shard_embeddings(nn.Linear(2, 2), torch.device("cpu"), sequence_dtype=dtype)


def test_sequence_lookups_in_a_half_dtype_set_fbgemms_output_dtype():
    from gem_parallel.sparse import sequence_fused_params

    assert sequence_fused_params(None) is None
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        assert sequence_fused_params(dtype)["output_dtype"].value == name


def test_recat_is_made_once_per_arguments_and_equals_torchrecs():
    from torchrec.distributed import dist_data

    from gem_parallel.sparse import memoize_recat

    memoize_recat()
    memoize_recat()  # idempotent: wrapped once
    made = dist_data._get_recat
    assert made.memoized and not getattr(made.original, "memoized", False)
    cpu = torch.device("cpu")
    for args in [(2, 4, 1, cpu, None), (3, 2, 1, cpu, None), (2, 4, 2, cpu, None), (2, 2, 1, cpu, [3, 5])]:
        first, again = made(*args), made(*args)
        assert first is again
        assert torch.equal(first, made.original(*args))
    assert made(0, 4, 1, cpu, None) is None  # an empty local split has no index


def test_a_batch_size_equal_on_every_rank_makes_one_recat_whatever_its_value():
    from torchrec.distributed import dist_data

    from gem_parallel.sparse import memoize_recat

    memoize_recat()
    made, cpu = dist_data._get_recat, torch.device("cpu")
    first = made(2, 1, 1, cpu, [300])
    for sizes in ([517], [4096], None):  # one rank: the batch size changes from batch to batch
        assert made(2, 1, 1, cpu, sizes) is first
    assert torch.equal(first, made.original(2, 1, 1, cpu, [517]))
    uniform, varying = made(2, 2, 1, cpu, [7, 7]), made(2, 2, 1, cpu, [7, 9])
    assert uniform is made(2, 2, 1, cpu, [8, 8]) and varying is not uniform
    assert torch.equal(varying, made.original(2, 2, 1, cpu, [7, 9]))


def test_the_kept_recats_are_bounded():
    from torchrec.distributed import dist_data

    from gem_parallel.sparse import RECATS_KEPT, memoize_recat

    memoize_recat()
    cpu = torch.device("cpu")
    first = dist_data._get_recat(2, 2, 1, cpu, [1, 2])
    for size in range(3, RECATS_KEPT + 3):  # per-rank batch sizes varying from batch to batch
        dist_data._get_recat(2, 2, 1, cpu, [1, size])
    again = dist_data._get_recat(2, 2, 1, cpu, [1, 2])  # dropped, made anew
    assert again is not first and torch.equal(again, first)
