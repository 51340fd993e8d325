"""The driver's progress bar (rnnlm.progress)."""
import io

from rnnlm.progress import Progress


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def m(r, loss=2.5, **more):
    return {"round": r, "train_loss": loss, "round_bytes_sent": 1_500_000, "round_bytes_broadcast": 500_000,
            "tokens_per_s": 41234.5, **more}


def test_in_a_log_every_round_is_its_own_line():
    out = io.StringIO()
    p = Progress(out, tty=False)
    for r in (1, 2, 3):
        p.update(m(r), 3, f"round {r} | line")
    p.close()
    assert out.getvalue() == "round 1 | line\nround 2 | line\nround 3 | line\n"


def test_on_a_terminal_the_bar_is_redrawn_with_eta_loss_and_bytes():
    out, clock = io.StringIO(), Clock()
    p = Progress(out, tty=True, width=10, clock=clock, columns=200)
    p.update(m(1), 10, "round 1")             # the clock starts at the first report
    clock.t += 20.0
    p.update(m(3, loss=2.25), 10, "round 3")  # 2 rounds in 20 s, 7 to go: 70 s
    text = out.getvalue()
    assert "round 1" not in text.replace("round 1/10", "")       # plain lines are not printed
    last = text.split("\r\033[K")[-1]
    assert last == "round 3/10 [###.......]  30% | 0:20 < 1:10 | loss 2.250 | 41.2k tok/s | 2.00 MB/round"
    p.message("a warning")
    p.update(m(4, valid_ppl=9.5), 10, "round 4 | valid_ppl 9.5")
    p.update(m(5, test_loss=1.5), 10, "round 5 | test_loss 1.5")
    p.close()
    # the bar is wiped, the messages printed in full (an evaluation's lines too), the bar drawn again below them
    assert out.getvalue().split("\r\033[K")[-2:] == [
        "a warning\nround 4 | valid_ppl 9.5\n"
        "round 4/10 [####......]  40% | 0:20 < 0:40 | loss 2.500 | 41.2k tok/s | 2.00 MB/round",
        "round 5 | test_loss 1.5\n"
        "round 5/10 [#####.....]  50% | 0:20 < 0:25 | loss 2.500 | 41.2k tok/s | 2.00 MB/round\n"]


def test_a_resumed_run_counts_its_eta_from_where_it_started():
    out, clock = io.StringIO(), Clock()
    p = Progress(out, tty=True, width=4, clock=clock, columns=200)
    p.update(m(50), 100, "")
    clock.t += 10.0
    p.update(m(51), 100, "")     # 1 round in 10 s since the resume (not 51): 49 left, 490 s
    assert out.getvalue().endswith("round 51/100 [##..]  51% | 0:10 < 8:10 | loss 2.500 | 41.2k tok/s | 2.00 MB/round")


def test_the_elapsed_time_is_the_runs_own_clock_its_first_round_included():
    """Counted from the first report, three rounds of 10 minutes read 20:00 elapsed; with the first
    round's, 30:00. After the first report the bar's own clock counts: a sync run's wall_s leaves out its
    evaluations (here 50 of every 60 s), which the ETA counts (it read 0:30 < 1:00)."""
    out, clock = io.StringIO(), Clock()
    p = Progress(out, tty=True, width=4, clock=clock, columns=200)
    for r in (1, 2, 3):
        p.update(m(r, wall_s=600.0 * r), 4, "")
        clock.t += 600.0
    assert out.getvalue().endswith("round 3/4 [###.]  75% | 30:00 < 10:00 | loss 2.500 | 41.2k tok/s | 2.00 MB/round")
    p.update(m(4, wall_s=-5.0), 4, "")           # whatever the later lines say
    assert out.getvalue().endswith("round 4/4 [####] 100% | 40:00 < 0:00 | loss 2.500 | 41.2k tok/s | 2.00 MB/round")
    out, clock = io.StringIO(), Clock()
    p = Progress(out, tty=True, width=4, clock=clock, columns=200)
    for r in (1, 2, 3):
        clock.t += 60.0                           # 10 s of training, 50 of evaluation
        p.update(m(r, wall_s=10.0 * r), 4, "")
    assert out.getvalue().endswith("round 3/4 [###.]  75% | 2:10 < 1:00 | loss 2.500 | 41.2k tok/s | 2.00 MB/round")
    out = io.StringIO()
    Progress(out, tty=True, width=4, clock=Clock(), columns=200).update(m(1, wall_s=-5.0), 4, "")
    assert out.getvalue().endswith("25% | 0:00 < ? | loss 2.500 | 41.2k tok/s | 2.00 MB/round")   # a clock that is none


def test_a_line_without_a_training_loss_keeps_the_latest_one_on_the_bar():
    """An async run's metrics line that counts no push carries no loss (its last line, often)."""
    out, clock = io.StringIO(), Clock()
    p = Progress(out, tty=True, width=4, clock=clock, columns=200)
    bare = {k: v for k, v in m(1).items() if k not in ("train_loss", "tokens_per_s")}
    p.update(bare, 4, "round 1")
    assert out.getvalue().endswith("round 1/4 [#...]  25% | 0:00 < ? | loss - | 2.00 MB/round")
    p.update(m(2, loss=2.25), 4, "round 2")
    p.update(dict(bare, round=3), 4, "round 3")
    assert out.getvalue().endswith("| loss 2.250 | 2.00 MB/round")


def test_nothing_drawn_is_wider_than_the_terminal():
    """An 86-character bar in an 80-column terminal left a line per round (the redraw failed), and
    evaluation lines of ~190 characters wrapped mid-word."""
    out, clock = io.StringIO(), Clock()
    p = Progress(out, tty=True, clock=clock, columns=80)
    p.update(m(1), 1000, "round 1")
    clock.t += 5.0
    p.update(m(2), 1000, "round 2")
    bar = out.getvalue().split("\r\033[K")[-1]
    # bytes per round went first; the bar takes what is left of 79 columns
    assert bar == "round 2/1000 [...............]   0% | 0:05 < 1:23:10 | loss 2.500 | 41.2k tok/s" and len(bar) == 79
    evaluation = " | ".join(f"field_{i} {i * 1.5:.4g}" for i in range(20))        # ~260 characters
    p.update(m(3, valid_ppl=9.5), 1000, evaluation)
    lines = out.getvalue().split("\r\033[K")[-1].split("\n")
    assert all(len(x) <= 79 for x in lines), [len(x) for x in lines]
    assert " | ".join(x.strip() for x in lines[:-1]) == evaluation        # broken only at separators
    assert lines[-1].startswith("round 3/1000 [")
    for columns in (40, 60, 100, 120):            # fields go from the end; the bar shrinks to 4
        narrow = Progress(io.StringIO(), tty=True, clock=clock, columns=columns)
        narrow.t0 = narrow.first = 0.0
        assert len(narrow.bar(m(500), 1000, clock.t)) <= columns - 1


def test_the_fields_formats_at_their_thresholds():
    from rnnlm.progress import _clock, _mb, _rate
    assert [_clock(s) for s in (-3, 59.9, 61, 3599, 3600, 3661, 90061)] == \
        ["0:00", "0:59", "1:01", "59:59", "1:00:00", "1:01:01", "25:01:01"]
    # no unit past its own range after rounding (1000.00 MB, 1000.0k, 10000 were printed)
    assert [_mb(n) for n in (0, 1_234_567, 999_994_999, 999_999_999, 1e9, 2.5e9)] == \
        ["0.00 MB", "1.23 MB", "999.99 MB", "1.00 GB", "1.00 GB", "2.50 GB"]
    assert [_rate(n) for n in (12.4, 9_999, 9_999.6, 10_000, 999_949, 999_960, 1e6, 2.345e6)] == \
        ["12", "9999", "10.0k", "10.0k", "999.9k", "1.00M", "1.00M", "2.35M"]


def test_wrap_fills_all_but_the_last_column():
    from rnnlm.progress import wrap
    assert wrap("aaaa | bb | c", 12) == "aaaa | bb\n  c"          # "aaaa | bb" is 9; with " | c", 13 > 11
    assert wrap("aaaa | bb | c", 14) == "aaaa | bb | c"           # 13 characters in 13 columns
    assert wrap("aaaa | bb | c", 13) == "aaaa | bb\n  c"          # ... but not in a 13th, the last
    assert wrap("a-very-long-field | b", 5) == "a-very-long-field\n  b"     # a field longer stays whole


def test_status_lines_before_the_first_round():
    log = io.StringIO()
    p = Progress(log, tty=False)
    p.status("reading the corpus")
    p.close()                                   # nothing drawn: nothing to end
    assert log.getvalue() == "reading the corpus\n"
    term = io.StringIO()
    p = Progress(term, tty=True, columns=10, clock=Clock())
    p.status("reading the corpus")              # cut to 9 columns, replaced by what comes next
    p.status("vocabulary")
    p.message("a b")
    p.close()
    assert term.getvalue() == "reading t\r\033[Kvocabular\r\033[Ka b\n"


def test_the_bar_at_its_edges():
    """Past the last round it stays full; with no bytes counted it says 0; a terminal too narrow for
    even the bar's frame gets the line cut; the run's first report has no rate yet."""
    p = Progress(io.StringIO(), tty=True, width=4, clock=Clock(), columns=200)
    p.t0 = p.first = 0.0
    bare = {"round": 12, "train_loss": 1.0}
    assert p.bar(bare, 10, 5.0) == "round 12/10 [####] 100% | 0:05 < 0:00 | loss - | 0.00 MB/round"
    assert p.bar({"round": 0}, 0, 0.0) == "round 0/0 [....]   0% | 0:00 < ? | loss - | 0.00 MB/round"
    # rounded down: a run is at 100% and its bar full only at its end (199 of 200 rounds read 100%)
    assert p.bar({"round": 199}, 200, 5.0).startswith("round 199/200 [###.]  99% |")
    assert p.bar({"round": 29}, 100, 5.0).startswith("round 29/100 [#...]  29% |")     # 100 * 0.29 < 29
    tiny = Progress(io.StringIO(), tty=True, width=4, clock=Clock(), columns=12)
    tiny.t0 = tiny.first = 0.0
    assert tiny.bar(m(5), 10, 1.0) == "round 5/10 "                        # 11 of 12 columns
    frame = Progress(io.StringIO(), tty=True, width=4, clock=Clock(), columns=24)
    frame.t0 = frame.first = 0.0
    assert frame.bar(m(5), 10, 1.0) == "round 5/10 [##..]  50%"             # every field dropped, the frame fits
    wide = Progress(io.StringIO(), tty=True, clock=Clock(), columns=200)
    wide.t0 = wide.first = 0.0
    assert "[" + "#" * 12 + "." * 12 + "]" in wide.bar(m(5), 10, 1.0)     # 24 characters by default


def test_the_terminals_width_is_read_for_each_line_and_a_closed_bar_is_not_cleared_again(monkeypatch):
    out = io.StringIO()
    p = Progress(out, tty=True, clock=Clock())
    monkeypatch.setenv("COLUMNS", "12")
    p.status("x" * 40)
    monkeypatch.setenv("COLUMNS", "6")                     # resized
    p.status("y" * 40)
    p.close()
    p.message("done")
    assert out.getvalue() == "x" * 11 + "\r\033[K" + "y" * 5 + "\ndone\n"
