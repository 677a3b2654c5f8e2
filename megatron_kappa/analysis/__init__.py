"""Analyses of finished runs: figures (plots.py, drawn on the axes of figure_axes.py) and a study's
table (study_table.py).

Modules:
  figure_axes.py  The axes every run figure shares: steps below and tokens seen above, one y scale
                  across a figure's layer panels, a labelled axis everywhere, and the legend outside
                  the data
  kappa_range.py  κ's spread at the end of each run of a study: per MoE layer, the 5 % and 95 %
                  quantiles of κ over the routed (token, unit) pairs as the run logged them last
                  (kappa/layerN/bottom5, top5 in metrics.jsonl), and whether they left a band around
                  1
  plots.py        Figures of a training run: one PNG per figure under <run.dir>/plots/
                  (docs/analysis.md)
  softmoe.py      The SoftMoE allocation figure of a training run (model.moe.router: softmoe;
                  docs/softmoe.md)
  study_table.py  A study's table (launch/study.py): per variant, mean ± sd over seeds of the final
                  validation loss, bits per byte and centered CORE, the paired per-seed difference
                  to the SwiGLU baseline, and tokens/s — as in the paper's tables (3 seeds, mean ±
                  sd)
"""
