"""What makes a figure unreadable, found by looking at the drawn figure (tests/test_plots.py,
tests/test_analysis.py)."""
from megatron_kappa.analysis import figure_axes


def problems(fig) -> list[str]:
    """What a reader could not use: an unlabelled axis (or one without a unit), a title with a
    path, a legend over the data, panels of one figure on different y scales."""
    found = []
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    axes = [ax for ax in fig.axes if ax.get_visible() and ax.get_label() != "<colorbar>"]
    for text in [fig._suptitle] + [ax.title for ax in axes]:
        if text is not None and "/" in text.get_text():
            found.append(f"a path in the title {text.get_text()!r}")
    areas = [ax.get_window_extent(renderer) for ax in axes]
    for ax in axes:
        name = ax.get_title() or "?"
        if ax.get_xlabel() == "" or ax.get_ylabel() == "":
            found.append(f"{name}: an axis without a label")
        elif "(" not in ax.get_ylabel():
            found.append(f"{name}: no unit in {ax.get_ylabel()!r}")
        if ax.get_xlabel() == figure_axes.STEP_LABEL and not any(
                child.get_xlabel() == figure_axes.TOKENS_LABEL for child in ax.child_axes):
            found.append(f"{name}: steps without a tokens axis")
        legend = ax.get_legend()
        if legend is not None:
            box = legend.get_window_extent(renderer)
            points = [line.get_transform().transform(xy) for line in ax.get_lines() for xy in line.get_xydata()
                      if not line.get_label().startswith("_")]
            if any(box.contains(*p) for p in points):
                found.append(f"{name}: its legend covers data points")
    for legend in fig.legends:
        box = legend.get_window_extent(renderer)
        if any(box.overlaps(area) for area in areas):
            found.append("the figure's legend overlaps a panel")
    panels = [ax for ax in axes if ax.get_title().startswith("layer ")]
    if len({ax.get_ylim() for ax in panels}) > 1:
        found.append("layer panels on different y scales")
    return found
