"""The draft-step benchmark's report (``bench_draft_step.py``): the
timing spread, the one table (parts summed over the layers, the whole step,
its weight floor, the bits compared) and the plot."""

from __future__ import annotations

import statistics
from pathlib import Path


def spread(times: list[float]) -> dict:
    s = sorted(times)
    q = lambda p: s[min(len(s) - 1, int(p * len(s)))]  # noqa: E731
    return {"median": statistics.median(s), "p10": q(0.1), "p90": q(0.9), "min": s[0], "max": s[-1], "n": len(s)}


def group(name: str) -> str:
    """A part's row in the table: per-layer parts summed over the layers."""
    return name.split(" ", 1)[1] if name[:1] == "L" and name[1:2].isdigit() else name


def summarize(result: dict) -> dict:
    """Per table row: stock and DSpark µs (medians summed over the layers),
    differing elements (None: the same op on both sides)."""
    rows: dict[str, dict] = {}
    for p in result["parts"]:
        name = group(p["part"])
        if name.endswith(" input norm") and name.startswith("FFN boundary"):
            name = "FFN boundary + next input norm"
        r = rows.setdefault(name, {"stock": 0.0, "dspark": 0.0, "differing": None, "same_op": True})
        r["stock"] += p["stock"]["median"]
        r["dspark"] += p["dspark"]["median"]
        r["same_op"] &= p["same_op"]
        if p["differing"] is not None:
            r["differing"] = (r["differing"] or 0) + p["differing"]
    return rows


def table(results: list[dict], meta: dict) -> str:
    ms = [r["m"] for r in results]
    sums = [summarize(r) for r in results]
    names = list(sums[0])
    head = "| part | " + " | ".join(f"m={m}" for m in ms) + " |"
    lines = [f"# Draft step, {meta['device']}, {meta['date']}: vLLM 0.33.0 stock -> DSpark, us (medians; "
             "CUDA graphs)", "", meta["setup"], "", head, "|---|" + "---|" * len(ms)]
    for name in names:
        cells = []
        for s in sums:
            r = s[name]
            if r["same_op"]:
                cells.append(f"{r['stock']:.1f} (same op)")
            else:
                bits = "" if r["differing"] in (0, None) else f" **{r['differing']} differ**"
                cells.append(f"{r['stock']:.1f} -> {r['dspark']:.1f} ({r['stock'] / r['dspark']:.2f}x){bits}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    tot = lambda r, k: r["total"][k]["median"]  # noqa: E731
    lines.append("| sum of parts | " + " | ".join(
        f"{sum(v['stock'] for v in s.values()):.0f} -> {sum(v['dspark'] for v in s.values()):.0f}" for s in sums)
        + " |")
    lines.append("| **whole step, one graph** | " + " | ".join(
        f"**{tot(r, 'stock'):.0f} -> {tot(r, 'dspark'):.0f} ({tot(r, 'stock') / tot(r, 'dspark'):.2f}x)**"
        for r in results) + " |")
    lines.append("| spread p10-p90 | " + " | ".join(
        f"{r['total']['stock']['p10']:.0f}-{r['total']['stock']['p90']:.0f} / "
        f"{r['total']['dspark']['p10']:.0f}-{r['total']['dspark']['p90']:.0f}" for r in results) + " |")
    floor, peak = meta.get("floor_us"), meta.get("hbm_peak")
    if floor:
        lines.append(f"| step / weight floor at this card's HBM peak ({floor:.0f} us) | " + " | ".join(
            f"{tot(r, 'stock') / floor:.2f} -> {tot(r, 'dspark') / floor:.2f}" for r in results) + " |")
    if meta.get("weight_bytes") and peak:
        # The weight bytes one step streams over the step's time, against this card's HBM peak.
        frac = lambda r, k: meta["weight_bytes"] / (tot(r, k) * 1e-6) / peak  # noqa: E731
        lines.append(f"| whole step: weight bytes / time, of this card's HBM peak ({peak / 1e12:.2f} TB/s) | "
                     + " | ".join(f"{100 * frac(r, 'stock'):.1f}% -> {100 * frac(r, 'dspark'):.1f}%"
                                  for r in results) + " |")
    for name, nbytes in meta.get("part_bytes", {}).items():
        cells = []
        for s_ in sums:
            r = s_.get(name)
            cells.append("-" if r is None else
                         f"{nbytes / r['stock'] / 1e6:.2f} -> {nbytes / r['dspark'] / 1e6:.2f}")
        lines.append(f"| {name}: weight TB/s | " + " | ".join(cells) + " |")
    exact = [[p for p in r["parts"] if p["differing"] is not None] for r in results]
    if any(exact):
        lines.append("| DSpark's own parts: differing elements | " + " | ".join(
            f"{sum(p['differing'] for p in e)} of {sum(p['elements'] for p in e)}" for e in exact) + " |")
    whole = [r.get("whole_step_differing") for r in results]
    if any(whole):
        lines.append("| whole step: differing elements (out, logits, tokens, caches) | " + " | ".join(
            "-" if w is None else " / ".join(str(v[0]) for v in w.values()) for w in whole) + " |")
    lines += ["", meta["notes"]]
    if meta.get("decisions"):
        lines += ["", "The build's decisions (the order check against the live cuBLAS, then the timing on this "
                  "card):", ""] + [f"- {d}" for d in meta["decisions"]]
    return "\n".join(lines)


def plot(results: list[dict], floor: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    ms = [r["m"] for r in results]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for side, label in (("stock", "vLLM 0.33.0 stock"), ("dspark", "DSpark")):
        ax.plot(ms, [r["total"][side]["median"] for r in results], marker="o", label=label)
    if floor:
        ax.axhline(floor, color="gray", linestyle="--", label="weight floor")
    ax.set(xscale="log", yscale="log", xlabel="rows m = requests x N", ylabel="us per draft step")
    ax.set_xscale("log", base=2)
    ax.legend()
    bx.plot(ms, [r["total"]["stock"]["median"] / r["total"]["dspark"]["median"] for r in results], marker="o")
    bx.set(xlabel="rows m", ylabel="stock / DSpark")
    bx.set_xscale("log", base=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


