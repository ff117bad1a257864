import pytest

from megalite.parallel_state import RankGrid


def test_megatron_default_order_example():
    g = RankGrid(8, tp=2, pp=2)
    assert g.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.groups("tp", "pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_rank_formula_every_rank():
    g = RankGrid(24, tp=2, pp=3)
    for rank in range(24):
        c = g.coords(rank)
        assert rank == c["tp"] + 2 * c["dp"] + 2 * 4 * c["pp"]
        assert g.rank_of(**c) == rank


def test_tp_pp_dp_order():
    g = RankGrid(8, tp=2, pp=2, order="tp-pp-dp")
    assert g.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for rank in range(8):
        c = g.coords(rank)
        assert rank == c["tp"] + 2 * c["pp"] + 4 * c["dp"]


def test_embedding_group_with_four_stages():
    g = RankGrid(8, tp=1, pp=4)
    assert g.groups("pp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g.embedding_groups() == [[0, 6], [1, 7]]


def test_every_rank_in_exactly_one_group_per_kind():
    g = RankGrid(16, tp=2, pp=2)
    for dims in (("tp",), ("pp",), ("dp",), ("tp", "pp")):
        members = sorted(r for grp in g.groups(*dims) for r in grp)
        assert members == list(range(16))


def test_indivisible_world_names_flags():
    with pytest.raises(ValueError, match="tensor-model-parallel-size.*pipeline-model-parallel-size"):
        RankGrid(6, tp=4, pp=1)


def test_context_parallel_grid():
    """tp-cp-dp-pp (Megatron-LM's tp-cp-ep-dp-pp without experts): CP right after TP; gradients
    reduce over DP x CP; the model-parallel group leaves CP out; the old order names mean cp 1."""
    g = RankGrid(16, tp=2, pp=2, cp=2)
    assert g.dp == 2
    assert g.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g.groups("dp", "cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g.groups("pp")[0] == [0, 8]
    assert g.groups("tp", "pp")[0] == [0, 1, 8, 9]
    for rank in range(16):
        assert g.rank_of(**g.coords(rank)) == rank
    h = RankGrid(16, tp=2, pp=2, cp=2, order="tp-pp-dp")
    assert h.order == "tp-cp-pp-dp" and h.groups("pp")[0] == [0, 4] and h.groups("dp")[0] == [0, 8]
    assert RankGrid(8, tp=2, pp=2).groups("dp") == RankGrid(8, tp=2, pp=2, order="tp-cp-dp-pp").groups("dp")
    with pytest.raises(ValueError, match="--context-parallel-size"):
        RankGrid(12, tp=2, pp=2, cp=2)


def test_expert_grid_follows_megatron_rank_generator():
    """Megatron-LM's expert RankGenerator (order tp-ep-dp-pp, cp 1): rank = etp + ETP·ep +
    ETP·EP·edp + ETP·EP·EDP·pp. World 8, TP 2, ETP 1, EP 2, PP 2: the EP group of a stage is its
    TP pair, an expert's replicas the ranks two apart, experts whole (ETP groups of one)."""
    g = RankGrid(8, tp=2, pp=2, ep=2, etp=1)
    assert (g.dp, g.edp, g.separate_expert_grid) == (2, 2, True)
    assert g.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.expert_grid_groups("etp") == [[r] for r in range(8)]
    assert g.expert_grid_groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.expert_grid_groups("edp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.expert_grid_groups("etp", "ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.expert_grid_groups("pp") == g.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for rank in range(8):
        c = g.expert_coords(rank)
        assert rank == c["etp"] + c["ep"] + 2 * c["edp"] + 4 * c["pp"]
    # EP 4 over TP 2 x DP 2, ETP 1: one EP group per stage, replicas across stages' halves
    h = RankGrid(8, tp=2, ep=4, etp=1)
    assert h.expert_grid_groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert h.expert_grid_groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # ETP 2 with TP 1 (experts split across data-parallel ranks), EP 2
    k = RankGrid(8, tp=1, ep=2, etp=2)
    assert k.expert_grid_groups("etp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert k.expert_grid_groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert k.expert_grid_groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # ETP = TP (the default): the expert grid cuts each (tp, pp)'s DP x CP ranks, as before
    d = RankGrid(16, tp=2, pp=2, ep=2)
    assert d.etp == 2 and d.expert_grid_groups("etp") == d.groups("tp")
    assert d.expert_groups() == ([[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
                                 [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]])
    assert not RankGrid(8, tp=2).separate_expert_grid
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size"):
        RankGrid(8, tp=2, pp=2, ep=4, etp=2)
    with pytest.raises(ValueError, match="rank order"):
        RankGrid(8, tp=2, pp=2, ep=1, etp=1, order="tp-pp-dp")
