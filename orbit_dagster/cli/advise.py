"""`orbit advise`'s report: the offers compared, the recommendations with their evidence, how to reproduce."""
from __future__ import annotations


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _usd(x: float) -> str:
    """Dollars to 3 significant digits (a compressed market's bills are fractions of a cent), sign first."""
    return f"{'-' if x < 0 else ''}${abs(x):.3g}"


def advice_text(doc: dict) -> str:
    s = doc["scope"]
    lines = [f"advice on {s['of']}: the last {s['jobs']} finished jobs on {s['gpu']} x{s['gpus_per_instance']} "
             f"({s['mean_job_hours']:.3g} h of useful work each on average), replayed with the {s['policy']} policy "
             f"on each offer's recorded spot availability ({s['starts']} starts per offer; hours, rates and $/h in "
             "market time)", ""]
    head = ["offer", "share", "up h", "reclaims", "/h (90% interval)", "$/h", "$/job replayed", "finished"]
    rows = [head]
    for o in doc["offers"]:
        lo, hi = o["rate_interval"]
        sim = o["simulated"]
        rows.append([o["offer_id"], _pct(o["share"]), f"{o['exposure_hours']:.2f}", str(o["reclaims"]),
                     f"{o['reclaims_per_hour']:.3g} ({lo:.3g}-{hi:.3g})", f"{o['usd_per_hour']:.4g}",
                     _usd(sim["cost_usd"]), f"{sim['finished']}/{sim['jobs']}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    if doc.get("other_work_share"):
        lines.append(f"(work on offers with too little recorded history, on demand or rented boxes: "
                     f"{_pct(doc['other_work_share'])})")
    lines.append("")
    for r in doc["recommendations"]:
        verb = {"raise": "raise", "lower": "lower", "keep": "keep"}[r["action"]]
        lo, hi = r["saved_interval"]
        lines.append(f"{verb} {r['offer_id']} from {_pct(r['share'])} to {_pct(r['to_share'])} of the work: "
                     f"would have saved {_usd(r['saved_usd'])} on these {r['jobs']} jobs "
                     f"({_usd(lo)} to {_usd(hi)}; confidence {r['confidence']})")
        lines.append(f"  evidence: {r['evidence']}")
        lines.append(f"  uncertainty: {r['uncertainty']}")
    if doc.get("refused"):
        lines.append(f"no recommendation: {doc['refused']}")
    if doc["not_replayed"]:
        lines.append("")
        lines.append("offers of this shape with no recorded availability (not replayed): "
                     + ", ".join(f"{r['offer_id']} (${r['usd_per_gpu_hour_spot']:.4g}/GPU-h spot)"
                                 for r in doc["not_replayed"]))
    lines.append("")
    lines.append("forecast, next hours (shown, not used for choice: docs/cost.md):")
    for o in doc["offers"]:
        f = o["forecast"]
        price = ", ".join("-" if v is None else f"{v:.4g}" for v in f["price_usd_per_hour"])
        rate = ", ".join(f"{v:.3g}" for v in f["reclaims_per_hour"])
        lines.append(f"  {o['offer_id']}: $/h {price}; reclaims/h {rate}")
    if doc["offers"]:
        f = doc["offers"][0]["forecast"]
        lines.append(f"  (price: {f['price_model']}; rate: {f['rate_model']})")
    return "\n".join(lines)
