"""The scaling table as text and JSON, the ``--np`` list, and the scaling
curve (``--plot``: efficiency and images/s against N; matplotlib, the
``plot`` extra).
"""
import math
import os

from ...base.errors import UserError


def parse_np(text):
    """``"8"``, ``"2,4,8"``, ``"2,4,8,...,1024"`` (the ratio of the two
    before ``...`` continues up to the last) -> sorted rank counts >= 1."""
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    out = []
    try:
        for i, item in enumerate(items):
            if item in ("...", "…"):
                if len(out) < 2 or i + 1 >= len(items):
                    raise ValueError
                a, b, stop = out[-2], out[-1], int(items[i + 1])
                if b <= a:
                    raise ValueError
                while True:
                    nxt = b * b // a if b % a == 0 else b + (b - a)
                    if nxt >= stop:
                        break
                    out.append(nxt)
                    a, b = b, nxt
                continue
            out.append(int(item))
    except ValueError:
        raise UserError(f"--np: expected rank counts such as 8, 2,4,8 or 2,4,8,...,1024, got "
                        f"{text!r}") from None
    if not out or min(out) < 1:
        raise UserError(f"--np: expected rank counts >= 1, got {text!r}")
    return sorted(set(out))


def to_json(table, link, algorithm, folder, durations):
    """The JSON object ``predict --json`` prints (docs/formats.md)."""
    def ms(v):
        return None if v is None else round(1000 * v, 3)
    rows = []
    for r in table["rows"]:
        if "error" in r:
            rows.append({"np": r["np"], "error": r["error"]})
            continue
        rows.append({"np": r["np"], "iter_ms": ms(r["iter_s"]), "compute_ms": ms(r["compute_s"]),
                     "comm_ms": ms(r["comm_s"]), "exposed_comm_ms": ms(r["exposed_comm_s"]),
                     "efficiency": None if r["efficiency"] is None else round(r["efficiency"], 4),
                     "images_per_s": None if r["images_per_s"] is None else
                     round(r["images_per_s"], 1),
                     "comm_ops": r["comm_ops"], "comm_bytes": r["comm_bytes"],
                     "simulated_ranks": r["simulated_ranks"], "slowest_rank": r["slowest_rank"],
                     "untraced_ops": len(r["untraced"]),
                     "node": None if r.get("node") is None else r["node"].as_dict()})
    one = table["one_rank"]
    traced = durations.iter_seconds
    return {"trace": os.path.abspath(folder), "traced_ranks": len(durations.per_rank),
            "traced_iterations": durations.iterations,
            "traced_iter_ms": {str(k): ms(v) for k, v in traced.items()},
            "one_rank_iter_ms": ms(one["iter_s"]),
            "dispatch_overhead_us_per_op": round(1e6 * table.get("overhead_s", 0.0), 2),
            "per_iteration_ms": ms(table.get("per_iteration_s", 0.0)),
            "link": {"alpha_s": link.alpha, "beta_bytes_per_s": link.beta,
                     "gamma_s_per_byte": link.gamma, "origin": link.origin},
            "algorithm": algorithm, "rows": rows,
            "node": {"ranks_per_node": table.get("ranks_per_node", 1),
                     "measured": link.node is not None,
                     "calibration": None if link.node is None else link.node.as_dict()},
            "seconds": round(table["seconds"], 3)}


def format_table(data):
    """``predict`` without ``--json``: one line per N."""
    link = data["link"]
    head = [f"scaling prediction from {data['trace']} ({data['traced_ranks']} traced "
            f"rank{'s' if data['traced_ranks'] != 1 else ''}, {data['traced_iterations']} "
            f"iterations; traced iteration "
            + ", ".join(f"{v} ms" for v in data["traced_iter_ms"].values() if v is not None)
            + f"; simulated on 1 rank: {data['one_rank_iter_ms']} ms, with "
            f"{data['dispatch_overhead_us_per_op']} µs of dispatch per op and "
            f"{data['per_iteration_ms']} ms per iteration)",
            f"link: α = {link['alpha_s'] * 1e6:.3g} µs, β = {link['beta_bytes_per_s'] * 8 / 1e9:.4g} "
            f"Gbit/s, γ = {link['gamma_s_per_byte'] * 1e9:.3g} ns/byte, allreduce "
            f"{data['algorithm']} ({link['origin']})"]
    cols = ("ranks", "iter ms", "compute ms", "comm ms", "exposed ms", "efficiency", "images/s")
    lines = ["  ".join(f"{c:>10}" for c in cols)]
    for r in data["rows"]:
        if "error" in r:
            lines.append(f"{r['np']:>10}  n/a: {r['error']}")
            continue
        eff = "n/a" if r["efficiency"] is None else f"{100 * r['efficiency']:.1f}%"
        ips = "n/a" if r["images_per_s"] is None else f"{r['images_per_s']:,.0f}"
        lines.append("  ".join(f"{v:>10}" for v in (
            r["np"], f"{r['iter_ms']:.2f}", f"{r['compute_ms']:.2f}", f"{r['comm_ms']:.2f}",
            f"{r['exposed_comm_ms']:.2f}", eff, ips)))
    node = data["node"]
    if node["measured"]:
        parts = []
        for r in data["rows"]:
            if not r.get("node"):
                continue
            x = r["node"]
            parts.append(f"{r['np']} ranks: compute × "
                         + "/".join(f"{v:.3g}" for v in x["compute_factor"].values())
                         + f" (gemm/elementwise/dispatch), +{x['collective_wait_us']:.3g} µs "
                         "a collective" + (" (past the measured ranks)" if x["extrapolated"]
                                           else ""))
        head.append(f"ranks per node: {node['ranks_per_node']}; measured sharing "
                    "(predict --calibrate) applied: " + "; ".join(parts))
    untraced = max((r.get("untraced_ops", 0) for r in data["rows"]), default=0)
    tail = [f"{untraced} op(s) not in the trace were estimated (row chunks, bucket copies)"] \
        if untraced else []
    return "\n".join(head + lines + tail)


def plot_scaling(data, path):
    """Efficiency and images/s against N (log2 axis), written to ``path``."""
    from ..plot import _matplotlib
    Figure, FigureCanvasAgg, _ = _matplotlib()
    rows = [r for r in data["rows"] if "error" not in r and r["efficiency"] is not None]
    if not rows:
        raise UserError("--plot: no rank count of --np has a prediction to draw")
    fig = Figure(figsize=(9, 3.6))
    FigureCanvasAgg(fig)
    n = [r["np"] for r in rows]
    for k, (key, label) in enumerate((("efficiency", "scaling efficiency"),
                                      ("images_per_s", "images/s"))):
        ax = fig.add_subplot(1, 2, k + 1)
        ax.plot(n, [r[key] for r in rows], marker="o")
        ax.set_xscale("log", base=2)
        if key == "images_per_s":
            ax.set_yscale("log")
            ideal = rows[0][key] / rows[0]["np"]
            ax.plot(n, [ideal * x for x in n], linestyle="--", color="grey", label="linear")
            ax.legend()
        else:
            ax.set_ylim(0, max(1.05, math.ceil(max(r[key] for r in rows) * 10) / 10))
        ax.set_xlabel("ranks")
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except (ValueError, OSError) as exc:
        raise UserError(f"--plot {path}: cannot write it ({exc})") from None
    return path
