"""The pipeline-schedule registry: names, the default choice per layout, and what a named
schedule needs of the layout (the runs themselves are compared in test_layouts.py)."""
import re

import pytest
import torch

from megalite.pipeline_parallel.schedules import (SCHEDULES, check_schedule, default_schedule_name,
                                                  forward_backward_1f1b, forward_backward_interleaved,
                                                  forward_backward_no_pipelining, forward_backward_zb_h1,
                                                  forward_backward_zbv, get_schedule)


def test_names():
    assert list(SCHEDULES) == ["no_pipelining", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"]
    assert get_schedule("no_pipelining") is forward_backward_no_pipelining
    assert get_schedule("zb_h1") is forward_backward_zb_h1 and get_schedule("zbv") is forward_backward_zbv
    with pytest.raises(ValueError, match="--pipeline-schedule dualpipev is not built"):
        get_schedule("dualpipev")
    assert get_schedule("1f1b") is forward_backward_1f1b
    assert get_schedule("interleaved_1f1b") is forward_backward_interleaved


def test_unknown_name_lists_the_schedules():
    with pytest.raises(ValueError, match=r"--pipeline-schedule 'gpipe' is not a schedule; "
                                         r"choose from no_pipelining, 1f1b, interleaved_1f1b, zb_h1, zbv, dualpipev"):
        get_schedule("gpipe")
    assert "choose from no_pipelining, 1f1b, interleaved_1f1b" in check_schedule("gpipe", 2, 1)


@pytest.mark.parametrize("pp, vpp, name", [(1, 1, "no_pipelining"), (2, 1, "1f1b"), (4, 1, "1f1b"),
                                           (2, 2, "interleaved_1f1b"), (4, 3, "interleaved_1f1b")])
def test_default_is_valid_for_its_layout(pp, vpp, name):
    assert default_schedule_name(pp, vpp) == name
    assert check_schedule(name, pp, vpp) is None


@pytest.mark.parametrize("name, pp, vpp, pattern", [
    ("no_pipelining", 2, 1, r"--pipeline-schedule no_pipelining needs --pipeline-model-parallel-size 1 \(got 2\)"),
    ("1f1b", 2, 2, r"--pipeline-schedule 1f1b runs one model chunk per pipeline rank, not 2"),
    ("interleaved_1f1b", 2, 1, r"--pipeline-schedule interleaved_1f1b needs --num-layers-per-virtual-pipeline-stage"),
    ("zb_h1", 1, 1, r"--pipeline-schedule zb_h1 needs --pipeline-model-parallel-size 2 or more \(got 1\)"),
    ("zb_h1", 2, 2, r"--pipeline-schedule zb_h1 runs one model chunk per pipeline rank, not 2"),
    ("zbv", 2, 3, r"--pipeline-schedule zbv runs exactly 2 model chunks per pipeline rank in a V, not 3: set "
                  r"--num-layers-per-virtual-pipeline-stage"),
    ("dualpipev", 2, 2, r"--pipeline-schedule dualpipev is not built"),
])
def test_layout_a_schedule_cannot_run(name, pp, vpp, pattern):
    assert re.match(pattern, check_schedule(name, pp, vpp))


class _Chunk(torch.nn.Module):
    """One stage holding the loss: per-token loss = w * token id."""
    post_process = True

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def set_input_tensor(self, _):
        pass

    def forward(self, ids, pos, mask, labels):
        return self.w * ids.float()


def test_1f1b_on_one_stage_is_gradient_accumulation():
    """1F1B on one stage never exchanges (no warm-up, all steady state) and gives no
    pipelining's losses and gradient."""
    class OneStage:  # the PipeComm of pp 1: no peers
        class ps:
            pp_size, pp_rank, is_first_stage, is_last_stage = 1, 0, True, True

        @staticmethod
        def communicate(**_):
            return None, None

    batches = [{"input_ids": torch.tensor([[float(i), 2.0 * i]]), "position_ids": None, "attention_mask": None,
                "labels": None, "loss_mask": torch.tensor([[1.0, float(i % 2)]])} for i in range(1, 5)]
    results = []
    for name in ("no_pipelining", "1f1b"):
        chunk = _Chunk()
        stats = get_schedule(name)([iter(batches)], [chunk], 4, 0.25, comm=OneStage(), microbatch_mean=True)
        results.append(([(float(a), float(b)) for a, b in stats], chunk.w.grad.item()))
    assert results[0] == results[1]
