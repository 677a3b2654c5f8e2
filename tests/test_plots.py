"""The run figures read on their own (analysis/plots.py, issue 55): every axis labelled with its
unit, steps below and tokens seen above (the tokens axis equal to the logged tokens_seen), one y
scale across a figure's layer panels, legends off the data, titles without paths. Checked on the
matplotlib figure objects of a run's metrics written here; the checker itself is shown to catch
a figure drawn the old way (negative control). The figures of a real run: test_analysis.py."""
import json

import pytest

from megatron_kappa.analysis import figure_axes, plots
from tests.support.figure_checks import problems

STEPS = list(range(10, 101, 10))


@pytest.fixture(autouse=True)
def close_figures():
    yield
    import matplotlib.pyplot as plt
    plt.close("all")


def tokens_at(step):
    """A batch ramp: 512 tokens a step up to step 50, 1024 after (the mapping must follow it)."""
    return 512 * min(step, 50) + 1024 * max(step - 50, 0)


def record(step, layers):
    r = {"step": step, "loss": 7.0 - step / 50, "tokens_seen": tokens_at(step), "lr": 1e-3}
    if step % 50 == 0:
        r["valid_loss"] = 7.1 - step / 50
    for layer in layers:
        for family, centre in (("kappa", 1.0), ("align", 0.0), ("gate_bias", 0.0), ("token_cos", 0.1)):
            spread = 0.01 * step * layer / len(layers)
            r.update({f"{family}/layer{layer}/mean": centre, f"{family}/layer{layer}/top5": centre + spread,
                      f"{family}/layer{layer}/bottom5": centre - spread})
        r.update({f"kappa/layer{layer}/alpha_pos_mean": 0.001 * step, f"kappa/layer{layer}/bias_pos_mean": 0.002 * step,
                  f"kappa/layer{layer}/alpha_s_abs": 0.0005 * step, f"kappa/layer{layer}/bias_routed_abs": 0.002 * step,
                  f"load/layer{layer}/min": 100.0, f"load/layer{layer}/max": 900.0, f"load/layer{layer}/mean": 512.0,
                  f"load/layer{layer}/cv": 0.5, f"load/layer{layer}/dropped_frac": 0.01 * layer})
    return r


def write_run(tmp_path, layers):
    run = tmp_path / "some_run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(record(s, layers)) + "\n" for s in STEPS))
    return run


def test_every_figure_is_labelled_with_tokens_shared_scales_and_legends_off_the_data(tmp_path):
    layers = [1, 2, 3]
    figures = plots.build_figures(write_run(tmp_path, layers), checkpoint=False)
    assert set(figures) == {"overview.png", "loss.png", "kappa.png", "alpha_b.png", "alignment.png", "gate_bias.png",
                            "token_cos.png", "load.png", "dropped.png"}
    for name, fig in figures.items():
        assert problems(fig) == [], name
    assert figures["overview.png"]._suptitle.get_text() == "some_run"  # the folder's name, not its path
    load = figures["load.png"].axes[0]
    assert len([ax for ax in figures["load.png"].axes if ax.get_visible()]) == len(layers)  # no twin axes
    assert {line.get_label() for line in load.get_lines()} >= {"max / mean", "min / mean", "CV (std / mean)"}


def test_many_layers_get_a_colour_bar_not_a_long_legend():
    records = [record(s, list(range(1, 11))) for s in STEPS]
    fig = plots.overview_figure(records, unfreeze=30, title="ten")
    assert problems(fig) == []
    assert any(ax.get_label() == "<colorbar>" for ax in fig.axes)
    assert len(fig.axes[1].get_legend().get_texts()) == 4  # 95 %, mean, 5 %, unfrozen: no layer entries


def test_the_tokens_axis_is_the_logged_tokens_seen():
    """The top axis's map against the records themselves, through a batch ramp; a map from the
    last rate alone (a constant tokens per step) misses the early steps (negative control)."""
    records = [record(s, []) for s in STEPS]
    forward, inverse = figure_axes.step_to_tokens(records)
    for s in STEPS:
        assert forward(s) == pytest.approx(tokens_at(s)) and inverse(tokens_at(s)) == pytest.approx(s)
    assert forward(25) == pytest.approx(tokens_at(25)) and forward(75) == pytest.approx(tokens_at(75))
    assert forward(110) == pytest.approx(tokens_at(110))  # past the last record at its rate
    constant = records[-1]["tokens_seen"] / records[-1]["step"]
    assert abs(constant * 20 - tokens_at(20)) > 0.1 * tokens_at(20)
    assert figure_axes.step_to_tokens([{"step": 5, "loss": 1.0}]) is None  # nothing logged tokens: no axis


def test_the_checker_catches_a_figure_drawn_the_old_way(tmp_path):
    """Negative control of `problems`: the old overview (a path as title, an unlabelled twin axis,
    a legend inside the panel over the curves, panels on their own y scales)."""
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2)
    fig.suptitle(str(tmp_path / "run"))
    for ax, scale in ((a, 1.0), (b, 5.0)):
        ax.plot(range(10), [scale * (i % 3) for i in range(10)], label="layer 1 95 %")
        ax.set_title("layer 1")
        ax.set_xlabel("step")
        ax.legend(loc="center")
    a.set_ylabel("κ")  # no unit
    b.twinx().plot(range(10), range(10))
    found = problems(fig)
    plt.close(fig)
    assert any("a path in the title" in p for p in found)
    assert any("without a label" in p for p in found) and any("no unit" in p for p in found)
    assert any("without a tokens axis" in p for p in found)
    assert any("legend covers data" in p for p in found) and "layer panels on different y scales" in found


def test_the_softmoe_figure_reads_the_same_way(tmp_path):
    from megatron_kappa.analysis.softmoe import allocation_figure, plot_allocation
    run = tmp_path / "softmoe_run"
    run.mkdir()
    rows = [{"step": s, "tokens_seen": 512 * s, "softmoe/k_mean": 1.5, "softmoe/layer1/k": 1.4, "softmoe/layer2/k": 1.6,
             "softmoe/layer1/active_mean": 1.4, "softmoe/layer2/active_mean": 1.6,
             "softmoe/layer1/active_hist": [0.1, 0.5, 0.3, 0.1, 0.0], "softmoe/layer2/active_hist": [0, 0.5, 0.4, 0.1,
                                                                                                     0]}
            for s in STEPS]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from megatron_kappa.analysis.plots import layers_of
    assert plot_allocation(run).stat().st_size > 10_000
    assert problems(allocation_figure(rows, layers_of(rows, "softmoe"))) == []


def test_a_run_that_logged_nothing_yet_is_one_line(tmp_path, capsys):
    """An empty metrics.jsonl (a run stopped before its first log step): one line, status 2; it
    drew two empty figures and exited 0. A missing file likewise (control: the same message form)."""
    run = tmp_path / "fresh"
    run.mkdir()
    assert plots.main([str(run)]) == 2
    assert capsys.readouterr().err == (f"error: {run / 'metrics.jsonl'}: no such file "
                                       "(expected a training run directory)\n")
    (run / "metrics.jsonl").write_text("")
    assert plots.main([str(run)]) == 2
    assert capsys.readouterr().err == (f"error: {run / 'metrics.jsonl'}: no records yet "
                                       "(the run has not logged a step)\n")
    assert not (run / "plots").exists()
