"""The driver's progress bar (rnnlm.progress)."""
import io

from rnnlm.progress import Progress


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def m(r, loss=2.5, **more):
    return {"round": r, "train_loss": loss, "round_bytes_sent": 1_500_000, "round_bytes_broadcast": 500_000, **more}


def test_in_a_log_every_round_is_its_own_line():
    out = io.StringIO()
    p = Progress(out, tty=False)
    for r in (1, 2, 3):
        p.update(m(r), 3, f"round {r} | line")
    p.close()
    assert out.getvalue() == "round 1 | line\nround 2 | line\nround 3 | line\n"


def test_on_a_terminal_the_bar_is_redrawn_with_eta_loss_and_bytes():
    out, clock = io.StringIO(), Clock()
    p = Progress(out, tty=True, width=10, clock=clock)
    p.update(m(1), 10, "round 1")             # the clock starts at the first report
    clock.t += 20.0
    p.update(m(3, loss=2.25), 10, "round 3")  # 2 rounds in 20 s, 7 to go: 70 s
    text = out.getvalue()
    assert "round 1" not in text.replace("round 1/10", "")       # plain lines are not printed
    last = text.split("\r\033[K")[-1]
    assert last == "round 3/10 [###.......]  30% | 0:20 < 1:10 | loss 2.250 | 2.00 MB/round"
    p.message("a warning")
    p.update(m(4, valid_ppl=9.5), 10, "round 4 | valid_ppl 9.5")
    p.close()
    # the bar is wiped, the messages printed in full, the bar drawn again below them
    assert out.getvalue().split("\r\033[K")[-1] == (
        "a warning\nround 4 | valid_ppl 9.5\nround 4/10 [####......]  40% | 0:20 < 0:40 | loss 2.500 | 2.00 MB/round\n")


def test_a_resumed_run_counts_its_eta_from_where_it_started():
    out, clock = io.StringIO(), Clock()
    p = Progress(out, tty=True, width=4, clock=clock)
    p.update(m(50), 100, "")
    clock.t += 10.0
    p.update(m(51), 100, "")     # 1 round in 10 s since the resume (not 51): 49 left, 490 s
    assert out.getvalue().endswith("round 51/100 [##..]  51% | 0:10 < 8:10 | loss 2.500 | 2.00 MB/round")


def test_a_line_without_a_training_loss_keeps_the_latest_one_on_the_bar():
    """An async run's metrics line that counts no push carries no loss (its last line, often)."""
    out, clock = io.StringIO(), Clock()
    p = Progress(out, tty=True, width=4, clock=clock)
    bare = {k: v for k, v in m(1).items() if k != "train_loss"}
    p.update(bare, 4, "round 1")
    assert out.getvalue().endswith("round 1/4 [#...]  25% | 0:00 < ? | loss - | 2.00 MB/round")
    p.update(m(2, loss=2.25), 4, "round 2")
    p.update(dict(bare, round=3), 4, "round 3")
    assert out.getvalue().endswith("| loss 2.250 | 2.00 MB/round")
