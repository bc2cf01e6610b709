"""``plot RUN [RUN ...] --out curves.png``: training curves from metrics.jsonl.

A 2 x 2 figure against the iteration: loss, accuracy, learning rate and
images/s (tokens/s when every run is on token data: its rows have
``tokens_per_s``). Each run has its colour (the legend names its folder);
training rows are solid lines, test rows dashed lines with markers.

The panels do not mislead: a learning rate that holds its value (a step
schedule) is drawn as steps, each row's rate from the row before up to its
own (a smooth one stays a line), the accuracy axis spans at least
``ACCURACY_SPAN`` (so one test sample is not a cliff) and all of [0, 1]
once the values spread over half of it, and the loss axis is logarithmic
(``--loss-scale auto``, the default) when every loss is positive and they
span more than a factor of ``LOG_LOSS_RATIO``; ``--loss-scale log|linear``
chooses.

A RUN is
- a run folder holding ``metrics.jsonl`` (``runs/digits_lenet/2``, an ``--out``),
- a metrics file itself (any name), or
- a job's folder of numbered runs (``runs/digits_lenet``): its newest run
  that has a ``metrics.jsonl``, as ``--resume auto`` continues the newest.
  To overlay every run of a job, name them: ``plot runs/digits_lenet/*``.

matplotlib is optional (``pip install 'purine_mpi[plot]'``); the figure is
drawn with the Agg backend, so no display is needed.
"""
import json
import math
import os

from ..base.errors import UserError
from ..base.runfiles import make_parent, write_replacing
from ..job.metrics import FILE
from ..job.outputs import check_out
from ..job.rundir import numbered_runs

INSTALL = "pip install 'purine_mpi[plot]'"
# (key, panel title, y label)
PANELS = (("loss", "loss", "loss"), ("accuracy", "accuracy", "accuracy"),
          ("lr", "learning rate", "lr"), ("images_per_s", "throughput", "images/s"))
#: panels drawn as steps where the values are piecewise constant (a value
#: repeated by the next row): a row holds the rate of the iterations since the
#: row before, so a step policy's drop shows at its iteration ("steps-pre");
#: a smooth schedule (cosine, warm-up) stays a line between its rows
STEPPED = ("lr",)
#: the accuracy axis spans at least this much (one test sample of 2,000 is 0.0005)
ACCURACY_SPAN = 0.05
#: --loss-scale auto: a log axis when the positive losses span more than this factor
LOG_LOSS_RATIO = 10.0
LOSS_SCALES = ("auto", "log", "linear")
STYLE = {"train": {"linestyle": "-"},
         "test": {"linestyle": "--", "marker": "o", "markersize": 3}}


def resolve_run(arg):
    """(label, metrics path) of a RUN argument (see the module docstring)."""
    path = os.path.normpath(str(arg))
    if not os.path.exists(path):
        raise UserError(f"plot: run '{arg}' not found (give a run folder, its {FILE}, or "
                        "runs/<name>)")
    if os.path.isfile(path):
        return os.path.dirname(path) or ".", path
    if os.path.isfile(os.path.join(path, FILE)):
        return path, os.path.join(path, FILE)
    for _, sub in reversed(numbered_runs(path)):
        if os.path.isfile(os.path.join(sub, FILE)):
            return sub, os.path.join(sub, FILE)
    raise UserError(f"plot: folder '{arg}' holds no {FILE}, nor numbered run folders with "
                    f"one; give a run folder (the --out of train) or runs/<name>")


def read_rows(path):
    """The rows of a metrics file (dicts with ``phase`` and ``iter``). A last
    line without its newline (cut short by a kill) is ignored; any other line
    that is not a row, or a file with no rows, is a UserError."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError:
        raise UserError(f"plot: '{path}' is not a {FILE} (not text)") from None
    except OSError as e:
        raise UserError(f"plot: cannot read '{path}': {e.strerror}") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ok = isinstance(rec, dict) and isinstance(rec.get("phase"), str) \
                and isinstance(rec.get("iter"), int)
        except ValueError:
            ok = False
        if ok:
            rows.append(rec)
        elif not (n == len(lines) and not line.endswith("\n")):
            raise UserError(f"plot: {path}, line {n}: not a metrics row (expected a JSON "
                            "object with 'phase' and 'iter', as train writes)")
    if not rows:
        raise UserError(f"plot: '{path}' holds no metrics rows yet (train writes one every "
                        "solver.display iterations and one per test)")
    return rows


def series(rows, phase, key):
    """(iterations, values) of ``key`` in the ``phase`` rows, in file order;
    a null (non-finite) value is NaN, so the line has a gap there."""
    xs, ys = [], []
    for r in rows:
        if r["phase"] == phase and key in r:
            v = r[key]
            xs.append(r["iter"])
            ys.append(float(v) if isinstance(v, (int, float)) else math.nan)
    return xs, ys


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError:
        raise UserError(f"plot needs matplotlib: {INSTALL}") from None
    return Figure, FigureCanvasAgg, Line2D


def accuracy_limits(values):
    """(bottom, top) of the accuracy axis for ``values`` (finite): at least
    ACCURACY_SPAN wide, inside [0, 1], and all of [0, 1] when the values
    spread over half of it."""
    lo, hi = min(values), max(values)
    if hi - lo > 0.5 or lo < 0 or hi > 1:
        return min(0.0, lo), max(1.0, hi)
    span = max(ACCURACY_SPAN, (hi - lo) * 1.2)
    top = min(1.0, hi + (span - (hi - lo)) / 2)
    bottom = max(0.0, top - span)
    return bottom, bottom + span


def loss_scale(values, choice="auto"):
    """'log' or 'linear' for the loss panel of ``values`` (finite): ``choice``
    unless 'auto', which is 'log' when every value is positive and they span
    more than LOG_LOSS_RATIO."""
    if choice != "auto":
        return choice
    if values and min(values) > 0 and max(values) / min(values) > LOG_LOSS_RATIO:
        return "log"
    return "linear"


def draw(runs, loss_scale_choice="auto"):
    """A Figure of ``runs`` [(label, rows)]: one axes per PANELS entry, one
    line per (run, phase) that has the figure (its label '<run> <phase>')."""
    Figure, FigureCanvasAgg, Line2D = _matplotlib()
    fig = Figure(figsize=(11, 8), dpi=100)
    FigureCanvasAgg(fig)  # the Agg backend: no display
    axes = fig.subplots(2, 2).ravel()
    phases_seen = set()
    for ax, (key, title, ylabel) in zip(axes, PANELS):
        drawn = False
        if key == "images_per_s" and all(any("tokens_per_s" in r for r in rows)
                                         for _, rows in runs):
            key, ylabel = "tokens_per_s", "tokens/s"  # token data: tokens, not sequences
        finite = []
        for i, (label, rows) in enumerate(runs):
            for phase in ("train", "test"):
                xs, ys = series(rows, phase, key)
                if not any(math.isfinite(y) for y in ys):
                    continue
                stepped = key in STEPPED and any(a == b for a, b in zip(ys, ys[1:]))
                ax.plot(xs, ys, color=f"C{i % 10}", label=f"{label} {phase}",
                        drawstyle="steps-pre" if stepped else "default", **STYLE[phase])
                finite += [y for y in ys if math.isfinite(y)]
                phases_seen.add(phase)
                drawn = True
        if key == "accuracy" and finite:
            ax.set_ylim(*accuracy_limits(finite))
        if key == "loss" and finite:
            scale = loss_scale(finite, loss_scale_choice)
            if scale == "log" and min(finite) <= 0:
                raise UserError("plot: --loss-scale log needs positive losses; these runs "
                                f"have {min(finite):g}")
            ax.set_yscale(scale)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if not drawn:
            ax.text(0.5, 0.5, f"no '{key}' in these runs", ha="center", va="center",
                    transform=ax.transAxes, color="0.5")
    handles = [Line2D([], [], color=f"C{i % 10}", linewidth=3, label=label)
               for i, (label, _) in enumerate(runs)]
    handles += [Line2D([], [], color="0.3", label=phase, **STYLE[phase])
                for phase in ("train", "test") if phase in phases_seen]
    ncol = min(len(handles), 4)
    rows_of_legend = math.ceil(len(handles) / ncol)
    fig.legend(handles=handles, loc="lower center", ncol=ncol, frameon=False)
    fig.tight_layout(rect=(0, 0.02 + 0.035 * rows_of_legend, 1, 1))
    return fig


def plot_runs(args, out, loss_scale_choice="auto"):
    """Read every RUN of ``args``, draw them and save the figure to ``out``
    (``loss_scale_choice``: --loss-scale). Returns the Figure."""
    _matplotlib()  # the missing package is said before anything else
    runs = []
    for arg in args:
        label, path = resolve_run(arg)
        check_out(out, more=[("the metrics file", path)])  # nor a checkpoint
        runs.append((label, read_rows(path)))
    fig = draw(runs, loss_scale_choice)
    # the format of the extension out has (matplotlib's default where none),
    # written by a rename over out (base/runfiles): never through a link
    # planted there, never a half-written image under its name
    import matplotlib
    fmt = os.path.splitext(str(out))[1][1:].lower() or matplotlib.rcParams["savefig.format"]
    try:
        make_parent(out)
        write_replacing(out, lambda tmp: fig.savefig(tmp, format=fmt))
    except ValueError as e:  # an extension matplotlib cannot write
        raise UserError(f"plot: cannot write --out {out}: {e}") from None
    except OSError as e:
        raise UserError(f"plot: cannot write --out {out}: {e.strerror or e}") from None
    return fig
