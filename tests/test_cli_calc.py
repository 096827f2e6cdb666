"""`specdec calc` and `specdec plot`."""

import json
import re

import pytest

from specdec.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_calc_worked_example(capsys):
    code, out, _ = run(capsys, "calc", "--alpha", "0.7", "-k", "4", "--tau", "0.1")
    assert code == 0
    assert "2.7731" in out and "1.981x" in out
    assert "best k for this alpha, tau 4" in out
    assert "0.2401" in out  # P(full burst)


def test_calc_json(capsys):
    code, out, _ = run(capsys, "calc", "--alpha", "0.15", "-k", "8", "--tau", "0.1", "--json")
    assert code == 0
    data = json.loads(out)
    assert {"expected_tokens", "speedup", "best_k", "break_even_alpha"} <= data.keys()
    assert round(data["speedup"], 2) == 0.65
    assert data["break_even_alpha"] == pytest.approx(0.4448, abs=1e-4)
    assert data["best_k"] == 1


def test_calc_says_when_the_best_k_is_only_the_cap(capsys):
    """alpha = 1: every drafted token is accepted, so the speedup rises with k towards 1/tau; the search's cap is
    not a best k. k = 0 drafts nothing, so no alpha breaks even: any does. A k sweep still rising at k = 10 says so."""
    code, out, _ = run(capsys, "calc", "--alpha", "1", "-k", "4", "--tau", "0.1", "--k-max", "32")
    assert code == 0 and "tau >= 32, the --k-max cap" in out and "7.857x at k=32" in out
    _, out, _ = run(capsys, "calc", "--alpha", "1", "--json")
    assert json.loads(out)["best_k_capped"] is True
    _, out, _ = run(capsys, "calc", "--json")
    assert json.loads(out)["best_k_capped"] is False and json.loads(out)["best_k"] == 4
    _, out, _ = run(capsys, "calc", "-k", "0")
    assert "break-even alpha at this k any" in out
    _, out, _ = run(capsys, "calc", "--alpha", "0.99", "--tau", "0.01", "--table", "k")
    assert "10 " in out.splitlines()[-1] and "still rising" in out and "<- peak" not in out
    _, out, _ = run(capsys, "calc", "--tau", "0", "--k-max", "1000")  # free drafts: past k = 80 the gain is below
    assert "tau >= 1000, the --k-max cap" in out  # float precision, which read as a tie at k = 80


def test_calc_cap_and_peak_read_the_best_k_not_the_given_k(capsys):
    """best_k_capped asks whether the speedup rises past the best k, not past -k (at k = 1 it rises, at the best
    k = 4 it does not); a rise of one ulp is a tie (alpha = tau = 0.7: k = 0 and 1 both give 1.0x), not a rise.
    Only k = 0 breaks even at "any" alpha: tau = 0 breaks even at 0.0000. The k table marks its peak, k = 4."""
    _, out, _ = run(capsys, "calc", "-k", "1", "--json")
    assert json.loads(out)["best_k"] == 4 and json.loads(out)["best_k_capped"] is False
    _, out, _ = run(capsys, "calc", "--alpha", "0.7", "--tau", "0.7", "--json")
    assert json.loads(out)["best_k"] == 0 and json.loads(out)["best_k_capped"] is False
    _, out, _ = run(capsys, "calc", "--tau", "0")
    assert "break-even alpha at this k 0.0000" in out
    _, out, _ = run(capsys, "calc", "--table", "k")
    assert [line.split()[0] for line in out.splitlines() if "<- peak" in line] == ["4"] and "still rising" not in out


def test_the_k_table_breaks_ties_as_calc_does(capsys):
    """alpha = tau = 0.7: k = 0 and k = 1 both give 1.0x (up to rounding); both pick the smaller k."""
    _, out, _ = run(capsys, "calc", "--alpha", "0.7", "--tau", "0.7")
    assert "best k for this alpha, tau 0 " in out
    _, out, _ = run(capsys, "calc", "--alpha", "0.7", "--tau", "0.7", "--table", "k")
    assert [line.split()[0] for line in out.splitlines() if "<- peak" in line] == ["0"]


def test_calc_json_no_break_even(capsys):
    code, out, _ = run(capsys, "calc", "--alpha", "0.5", "-k", "2", "--tau", "1.5", "--json")
    assert code == 0 and json.loads(out)["break_even_alpha"] is None


def test_calc_tables(capsys):
    code, out, _ = run(capsys, "calc", "--table", "k")
    assert code == 0
    peak = [line for line in out.splitlines() if "peak" in line]
    assert len(peak) == 1 and peak[0].split()[0] == "4" and "1.981x" in peak[0]
    code, out, _ = run(capsys, "calc", "--table", "alpha")
    assert code == 0
    assert any(line.split()[:1] == ["0.70"] and "1.981x" in line for line in out.splitlines())
    assert any(line.split()[:1] == ["0.90"] and "2.925x" in line for line in out.splitlines())
    code, out, _ = run(capsys, "calc", "--table", "alpha", "-k", "8", "--json")
    rows = json.loads(out)
    assert [r["alpha"] for r in rows if round(r["speedup"], 2) == 0.65] == [0.15]


@pytest.mark.parametrize(
    "argv, name",
    [
        (["--alpha", "1.5"], "alpha"),
        (["--alpha", "-0.1"], "alpha"),
        (["--alpha", "nan"], "alpha"),
        (["-k", "-1"], "k"),
        (["--tau", "-0.1"], "tau"),
        (["--k-max", "-1"], "k-max"),
        (["--table", "alpha", "--tau", "-1"], "tau"),
    ],
)
def test_calc_bad_input_one_line_exit_2(capsys, argv, name):
    code, out, err = run(capsys, "calc", *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and name in err


def test_help_is_complete(capsys):
    for cmd, flags in [
        ("calc", ["--alpha", "-k", "--tau", "--k-max", "--table", "--json"]),
        ("plot", ["surface", "rounds", "budget", "--out", "--alpha", "-k", "--tau", "--k-max", "--budget"]),
    ]:
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert all(f in text for f in flags), cmd


def test_every_help_renders(capsys):
    """Every command's --help prints, with no argparse escape left in it: a description is not %-formatted, so
    '10%%' there showed as written (specdec probe did)."""
    from specdec.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert len(sub.choices) >= 10
    for cmd in sub.choices:
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith(f"usage: specdec {cmd}") and "%%" not in text and "%(" not in text, cmd


@pytest.mark.parametrize("what", ["surface", "rounds", "budget"])
def test_plot_writes_an_image(capsys, tmp_path, what):
    out = tmp_path / f"{what}.png"
    code, stdout, _ = run(capsys, "plot", what, "--out", str(out))
    assert code == 0 and str(out) in stdout
    data = out.read_bytes()
    assert len(data) > 10_000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_bad_input(capsys, tmp_path):
    code, _, err = run(capsys, "plot", "rounds", "--alpha", "2", "--out", str(tmp_path / "r.png"))
    assert code == 2 and "alpha" in err and not (tmp_path / "r.png").exists()
    code, _, err = run(capsys, "plot", "surface", "--out", str(tmp_path / "missing" / "s.png"))
    assert code == 2 and "--out" in err
    code, _, err = run(capsys, "plot", "budget", "--out", str(tmp_path / "b.txt"))
    assert code == 2 and "--out" in err
    for k_max, code_wanted in (("1", 2), ("65", 2), ("2", 0)):  # 1 crashed in matplotlib's contour
        code, _, err = run(capsys, "plot", "surface", "--k-max", k_max, "--out", str(tmp_path / f"s{k_max}.png"))
        assert code == code_wanted and ("--k-max must be in [2, 64]" in err) == (code_wanted == 2), err


def test_plot_rounds_refuses_a_huge_k_at_once(capsys, tmp_path):
    # k = 100000 used to draw 100001 annotated bars: minutes, then an unreadable chart
    code, _, err = run(capsys, "plot", "rounds", "-k", "100000", "--out", str(tmp_path / "r.png"))
    assert code == 2 and "k must be in [0, 64]" in err and not (tmp_path / "r.png").exists()
    code, _, _ = run(capsys, "plot", "rounds", "-k", "0", "--out", str(tmp_path / "r0.png"))
    assert code == 0 and (tmp_path / "r0.png").exists()


def test_plot_unwritable_out_is_one_line(capsys, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    def denied(self, path, *a, **kw):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Figure, "savefig", denied)
    code, _, err = run(capsys, "plot", "surface", "--out", str(tmp_path / "s.png"))
    assert code == 2 and "cannot write --out" in err and "Permission denied" in err and "Traceback" not in err
    (tmp_path / "d.png").mkdir()
    code, _, err = run(capsys, "plot", "surface", "--out", str(tmp_path / "d.png"))
    assert code == 2 and "is a directory" in err


@pytest.mark.parametrize("budget", [300.0, 1e12])
def test_plot_budget_past_the_axis_draws_no_red_region(tmp_path, monkeypatch, budget):
    # a budget above the largest B drawn used to shade B = 200..budget red and stretch the axis to it
    from specdec import plots

    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig) or str(path))
    plots.plot_budget(tmp_path / "b.png", k=4, budget=budget)
    ax = figs[0].axes[0]
    assert ax.get_xlim() == (0.0, 200.0)
    assert not ax.patches  # no "over budget" span
    figs.clear()
    plots.plot_budget(tmp_path / "b.png", k=4, budget=156)
    assert len(figs[0].axes[0].patches) == 1


def test_calc_prints_what_was_asked_not_a_rounding_of_it(capsys):
    # alpha 0.9999999 was echoed as alpha=1, a break-even alpha of 0.99999 as 1.0000 and a speedup of 3e-05 as 0.000x
    code, out, _ = run(capsys, "calc", "--alpha", "0.9999999", "-k", "1000000")
    assert code == 0 and out.startswith("alpha=0.9999999  k=1000000")
    assert re.search(r"^break-even alpha at this k +0\.99999", out, re.M) and "1.0000" not in out
    code, out, _ = run(capsys, "calc", "-k", "1000000")
    assert re.search(r"^speedup +3\.33e-05x$", out, re.M)
    code, out, _ = run(capsys, "calc", "-k", "0")
    assert "P(full burst of 1 token)   1.0000" in out  # its column lines up with the rows above


@pytest.mark.parametrize("alpha, k, shape", [(0.7, 4, "bursty"), (1.0, 4, "the same every round"),
                                              (0.0, 4, "the same every round"), (0.7, 0, "the same every round")])
def test_the_rounds_plot_calls_rounds_bursty_only_when_they_are(tmp_path, monkeypatch, alpha, k, shape):
    from specdec import plots

    titles = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: titles.append(fig.axes[0].get_title()) or str(path))
    plots.plot_rounds(tmp_path / "r.png", alpha=alpha, k=k)
    assert shape in titles[0]


@pytest.mark.parametrize("k", ["98", "99", "1000000"])
def test_the_burst_row_keeps_a_space_before_its_value(capsys, k):
    """From k = 99 the label filled its column and ran into the value: "P(full burst of 100 tokens)4.621e-16"."""
    code, out, _ = run(capsys, "calc", "-k", k)
    line = next(line for line in out.splitlines() if line.startswith("P(full burst"))
    assert code == 0 and re.fullmatch(r"P\(full burst of \d+ tokens\) +\S+", line), line
    labels = ("expected tokens per round", "speedup", line[:line.index(")") + 1], "best k for this alpha, tau",
              "break-even alpha at this k")
    rows = out.splitlines()[1:]  # every value starts in one column, however long the burst's label
    starts = {len(row) - len(row[len(label):].lstrip()) for label, row in zip(labels, rows, strict=True)}
    assert all(row.startswith(label) for label, row in zip(labels, rows)) and len(starts) == 1, out


def test_calc_edges_the_mutation_audit_found(capsys):
    """--k-max 0 is allowed, the k table runs 0..10, and a bad tau is refused with --table alpha too."""
    assert run(capsys, "calc", "--k-max", "0")[0] == 0
    code, out, _ = run(capsys, "calc", "--table", "k", "--json")
    assert code == 0 and [r["k"] for r in json.loads(out)] == list(range(11))
    code, _, err = run(capsys, "calc", "--table", "alpha", "--tau", "-0.5")
    assert code == 2 and "tau" in err


@pytest.mark.parametrize("argv, flag", [(["--table", "alpha", "--alpha", "0.3"], "--alpha"),
                                        (["--table", "k", "-k", "2"], "-k"),
                                        (["--table", "k", "--k-max", "5"], "--k-max"),
                                        (["--table", "alpha", "--k-max", "5", "--json"], "--k-max")])
def test_calc_refuses_a_flag_its_table_does_not_read(capsys, argv, flag):
    """`calc --table alpha --alpha 0.3` printed the alpha sweep as if the 0.3 had been read: now one line naming it.
    The flags a table does read still work (-k for the alpha sweep, --alpha for the k sweep)."""
    code, out, err = run(capsys, "calc", *argv)
    assert code == 2 and not out and f"does not read {flag}" in err and f"drop {flag}" in err
    code, out, _ = run(capsys, "calc", "--table", "alpha", "-k", "2", "--json")
    assert code == 0 and {r["k"] for r in json.loads(out)} == {2}
    code, out, _ = run(capsys, "calc", "--table", "k", "--alpha", "0.3", "--json")
    assert code == 0 and {r["alpha"] for r in json.loads(out)} == {0.3}


@pytest.mark.parametrize("what, flag, value", [("surface", "--alpha", "0.3"), ("rounds", "--tau", "0.5"),
                                               ("surface", "-k", "3"), ("budget", "--k-max", "5"),
                                               ("rounds", "--budget", "50")])
def test_plot_refuses_a_flag_its_picture_does_not_read(capsys, tmp_path, what, flag, value):
    """`plot surface --alpha 0.3` drew the surface without it, silently."""
    out = tmp_path / "p.png"
    code, _, err = run(capsys, "plot", what, flag, value, "--out", str(out))
    assert code == 2 and f"{flag} is read only by the" in err and f"not by {what}" in err and not out.exists()


def test_no_flag_is_read_as_a_prefix_of_another(capsys, tmp_path):
    """`calc --k 8` was argparse's prefix of --k-max: k stayed 4 and the best k was searched up to 8, without a
    word. --k is now -k's long spelling (as in generate), and no command takes a prefix for a flag."""
    code, out, _ = run(capsys, "calc", "--k", "8", "--alpha", "0.8", "--json")
    assert code == 0 and json.loads(out)["k"] == 8
    assert json.loads(run(capsys, "calc", "--alpha", "0.8", "--k-max", "8", "--json")[1])["k"] == 4
    code, _, _ = run(capsys, "plot", "rounds", "--k", "3", "--out", str(tmp_path / "r.png"))
    assert code == 0
    for argv in (["calc", "--alph", "0.5"], ["generate", "hi", "--max-new", "5"], ["train", "medusa", "--epoch", "1"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err, argv


def test_plot_refuses_a_flag_its_picture_does_not_read_even_at_its_default(capsys, tmp_path):
    code, _, err = run(capsys, "plot", "surface", "--alpha", "0.7", "--out", str(tmp_path / "s.png"))
    assert code == 2 and "--alpha is read only by the rounds plot" in err
    code, _, err = run(capsys, "plot", "budget", "--k-max", "12", "--out", str(tmp_path / "b.png"))
    assert code == 2 and "--k-max is read only by the surface plot" in err
