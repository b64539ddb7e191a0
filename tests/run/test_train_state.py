"""TrainState (quest/run/train_state.py), the run's counters: its state_dict round-trips through load_state_dict, a
key missing from an older state takes today's default, and a key it does not know is refused by name."""
from __future__ import annotations

import pytest

from quest.run.train_state import TrainState


def test_train_state_round_trips_and_refuses_keys_it_does_not_know():
    st = TrainState()
    st.drew_batch()
    st.took_step(8)
    st.trained_for(1.5)
    st.add_drawn(1, 9)
    assert st.validated(50.0) and not st.validated(50.0) and st.validated(60.0)
    st.end_epoch()
    st.logs_to("abc")
    saved = st.state_dict()
    wall = saved["attempts"][0]["wall_s"]  # this attempt's wall time so far: a clock
    assert wall >= 0
    assert saved == {"step": 1, "epoch": 1, "micro_in_epoch": 0, "best_top1": 60.0, "best_epoch": 0,
                     "images_seen": 8, "train_seconds": 1.5, "wandb_id": "abc", "train_skipped": 1, "train_drawn": 9,
                     "torch_threads": None,
                     "attempts": [{"first_step": 1, "steps": 1, "images": 8, "train_s": 1.5, "wall_s": wall,
                                   "compile_s": 0.0, "compile_steps": 0, "loader_start_s": 0.0, "figures": {}}]}
    again = TrainState(step=99, epoch=7)
    again.load_state_dict({"step": 1})  # a key missing from an older state: today's default, not the old value
    assert again == TrainState(step=1)
    again.load_state_dict(saved)
    assert again == st
    with pytest.raises(ValueError, match=r"\['lr'\]"):
        again.load_state_dict({**saved, "lr": 0.1})


@pytest.mark.parametrize("threads", [0, 4097, 10**12])
def test_a_thread_count_no_machine_has_is_refused_by_name(threads):
    """A resume sets the recorded count again (torch.set_num_threads(10**12) overflows deep inside it)."""
    with pytest.raises(ValueError, match="torch_threads"):
        TrainState().load_state_dict({**TrainState().state_dict(), "torch_threads": threads})
