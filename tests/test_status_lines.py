"""Without a progress bar a run still says how it goes (issue 34): a status line every
``train.status_every_s`` seconds and at each epoch's end, with the step, epoch, examples/s, loss
and the time left."""

import io

from embedtrain.train.status import StatusLines, progress_display


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_line_every_interval_and_at_each_epoch_end():
    clock, out = _Clock(), io.StringIO()
    lines = StatusLines(total=25, initial=0, steps_per_epoch=10, epochs=3, every_s=30,
                        out=out, clock=clock)
    for step in range(1, 26):
        clock.now += 4.0  # 4 s a step: a line every 8th step, and at steps 10, 20, 25
        lines.set_postfix(loss=f"{1 / step:.4f}", ex_per_s="1,024", refresh=False)
        lines.update(1)
    said = out.getvalue().splitlines()
    assert [s.split(":")[0] for s in said] == [
        "step 8/25 (epoch 1/3)", "step 10/25 (epoch 1/3)", "step 18/25 (epoch 2/3)",
        "step 20/25 (epoch 2/3)", "step 25/25 (epoch 3/3)"]
    assert said[0] == "step 8/25 (epoch 1/3): 1,024 examples/s, loss 0.1250, 1m08s left"
    assert said[-1] == "step 25/25 (epoch 3/3): 1,024 examples/s, loss 0.0400"  # nothing left


def test_a_resumed_run_estimates_from_its_own_steps():
    clock, out = _Clock(), io.StringIO()
    lines = StatusLines(total=5000, initial=4000, steps_per_epoch=1000, epochs=5, every_s=60,
                        out=out, clock=clock)
    clock.now += 61
    lines.update(10)  # 10 steps in 61 s: 990 left take 1h40m39s
    assert out.getvalue() == "step 4,010/5,000 (epoch 5/5): 1h40m left\n"


def test_a_terminal_gets_a_bar_a_log_lines_and_other_ranks_nothing(monkeypatch):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert isinstance(progress_display(10, 0, 5, 2, True, 30, 0), StatusLines)
    assert isinstance(progress_display(10, 0, 5, 2, False, 30, 0), StatusLines)  # --no-progress
    assert not isinstance(progress_display(10, 0, 5, 2, False, 30, 1), StatusLines)
    assert progress_display(10, 0, 5, 2, False, 0, 0).disable  # status_every_s: 0: silent
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert not progress_display(10, 0, 5, 2, True, 30, 0).disable  # a tqdm bar
