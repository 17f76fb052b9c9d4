"""Reports of runs from their ``metrics.h5``: ``hpcrl report`` and ``hpcrl compare``.

    hpcrl report runs/quickstart                    # summary on stdout; report.md + PNGs in runs/quickstart/report/
    hpcrl compare runs/qs0 runs/qs1 runs/qs2 -o cmp # side by side: compare.md + compare.png in cmp/

Modules, each importing only those above it (no cycle):
- ``run``: one run's columns, events and attributes, read once (SWMR: also while the run writes).
- ``summary``: the numbers (window means, step changes, phase times, interruptions) and their markdown.
- ``plots``: the PNGs; matplotlib is imported only when a plot is drawn.
- ``build``: ``build_report`` / ``build_compare``, which write report.md / compare.md and the plots.
- ``cli``: the two commands; building hpcrl's parser imports neither numpy nor h5py.

Nothing here imports torch, so a report runs on a login node. This module holds only the defaults that
the commands and the modules share, so that importing it stays free.
"""

from __future__ import annotations

METRICS_FILE = "metrics.h5"
DEFAULT_WINDOW = 10
"""N of the "first N / last N steps" means."""
DEFAULT_MAX_POINTS = 1000
"""Past this many steps, plots draw bin means with min-max bands."""
