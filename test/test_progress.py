"""Progress bars: one per phase on stderr, ending as one line; notes do not break them."""

from __future__ import annotations

from vla_runtime.progress import bars, note, silent


def test_a_bar_ends_as_one_line_on_stderr_with_its_last_state(capsys):
    with bars("recording references", 3, "episode") as bar:
        for k in range(3):
            bar.set_postfix_str(f"episode_{k}", refresh=False)
            bar.update()
        note("a note while the bar is open")
    out, err = capsys.readouterr()
    assert out == ""                                   # stdout stays for the result
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("recording references: 100%") and "3/3" in last and "episode_2" in last
    assert "a note while the bar is open\n" in err
    assert err.count("\n") == 2                        # the note and the finished bar, nothing per step


def test_silent_shows_nothing(capsys):
    with silent("anything", 2) as bar:
        bar.update(2)
        bar.set_postfix_str("x")
    assert capsys.readouterr() == ("", "")
