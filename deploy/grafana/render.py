#!/usr/bin/env python3
"""Draws the first screen of the dashboard (deploy/grafana/gpu-coloc.json) as an SVG from a
live Prometheus, without Grafana: each panel at its place, its queries as Grafana runs them
(the variables at All, $__rate_interval 1m), time series as lines with their legend and
last value, tables as rows. For documentation pictures and for a look at a test run:

    deploy/grafana/render.py --prometheus http://127.0.0.1:9090 --out dashboard.svg

`--until-y` picks how much of the dashboard (grid rows, Grafana's units) is drawn."""
import argparse, html, json, math, os, time, urllib.parse, urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
COL, ROW = 40, 30  # pixels per grid column and grid row
COLORS = ["#7eb26d", "#eab839", "#6ed0e0", "#ef843c", "#e24d42", "#1f78c1", "#ba43a9", "#705da0"]


def query(base, path, **params):
    url = base.rstrip("/") + path + "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise SystemExit(f"{url}: {body}")
    return body["data"]["result"]


def substitute(expr, range_s):
    return (expr.replace("$__rate_interval", "1m").replace("$__range", f"{range_s}s")
            .replace("$cluster", ".*").replace("$node", ".*").replace("$gpu", ".*"))


def legend(fmt, labels):
    out = fmt
    for k, v in labels.items():
        out = out.replace("{{" + k + "}}", v)
    while "{{" in out:  # a label the series lacks
        a = out.index("{{")
        out = out[:a] + out[out.index("}}", a) + 2:]
    return " ".join(out.split())


def fmt(v, unit):
    if v is None or math.isnan(v):
        return "–"
    if unit == "s":
        return f"{v * 1e3:.3g} ms" if abs(v) < 1 else f"{v:.3g} s"
    if unit == "percentunit":
        return f"{v * 100:.3g} %"
    if unit == "bytes":
        for u in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(v) < 1024:
                return f"{v:.3g} {u}"
            v /= 1024
    return f"{v:.3g}"


def text(x, y, s, size=11, color="#d8d9da", anchor="start", weight="normal"):
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" fill="{color}" text-anchor="{anchor}" '
            f'font-weight="{weight}" font-family="sans-serif">{html.escape(s)}</text>')


def timeseries(p, x, y, w, h, series, unit):
    out = []
    plot_x, plot_y, plot_w = x + 8, y + 28, w - 16
    nleg = min(len(series), 4)
    plot_h = h - 40 - 14 * nleg
    vals = [float(v) for _, _, pts in series for _, v in pts if not math.isnan(float(v))]
    ts = [t for _, _, pts in series for t, _ in pts]
    if not vals:
        return [text(x + w / 2, y + h / 2, "No data", 12, "#888", "middle")]
    lo, hi = min(0.0, min(vals)), max(vals)
    hi = hi if hi > lo else lo + 1
    t0, t1 = min(ts), max(ts)
    t1 = t1 if t1 > t0 else t0 + 1
    out.append(f'<rect x="{plot_x}" y="{plot_y}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>')
    out.append(text(plot_x + 2, plot_y + 10, fmt(hi, unit), 9, "#888"))
    out.append(text(plot_x + 2, plot_y + plot_h - 2, fmt(lo, unit), 9, "#888"))
    for i, (name, last, pts) in enumerate(series):
        c = COLORS[i % len(COLORS)]
        xy = [(plot_x + (t - t0) / (t1 - t0) * plot_w, plot_y + plot_h - (float(v) - lo) / (hi - lo) * plot_h)
              for t, v in pts if not math.isnan(float(v))]
        if xy:
            out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="'
                       + " ".join(f"{a:.1f},{b:.1f}" for a, b in xy) + '"/>')
        if i < nleg:
            ly = plot_y + plot_h + 14 + 14 * i
            out.append(f'<rect x="{plot_x}" y="{ly - 8}" width="10" height="3" fill="{c}"/>')
            out.append(text(plot_x + 14, ly - 4, name[:int(plot_w / 6.5) - 12], 10))
            out.append(text(plot_x + plot_w, ly - 4, fmt(last, unit), 10, anchor="end"))
    if len(series) > nleg:
        out.append(text(plot_x + plot_w, y + 14, f"+{len(series) - nleg} more series", 9, "#888", "end"))
    return out


def table(x, y, w, h, rows, hidden):
    out = []
    if not rows:
        return [text(x + w / 2, y + h / 2, "No data", 12, "#888", "middle")]
    cols = sorted({k for r in rows for k in r if k != "__name__" and k not in hidden})
    cw = (w - 16) / len(cols)
    for j, c in enumerate(cols):
        out.append(text(x + 8 + j * cw, y + 42, c, 10, "#6ed0e0", weight="bold"))
    for i, r in enumerate(rows[: int((h - 56) / 14)]):
        for j, c in enumerate(cols):
            out.append(text(x + 8 + j * cw, y + 58 + 14 * i, r.get(c, "")[: int(cw / 6.2)], 10))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prometheus", required=True, help="Prometheus base URL")
    ap.add_argument("--out", required=True, help="SVG file to write")
    ap.add_argument("--range-seconds", type=int, default=300, help="time range drawn (default 300)")
    ap.add_argument("--until-y", type=int, default=47, help="draw panels starting above this grid row (default 47: the on-call screen and what co-location earned)")
    a = ap.parse_args()
    dash = json.load(open(os.path.join(HERE, "gpu-coloc.json")))
    end = time.time()
    start = end - a.range_seconds
    step = max(1, a.range_seconds // 150)
    panels = [p for p in dash["panels"] if p["gridPos"]["y"] < a.until_y]
    width = 24 * COL
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels) * ROW + 4
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
           f'<rect width="{width}" height="{height}" fill="#111217"/>']
    for p in panels:
        g = p["gridPos"]
        x, y, w, h = g["x"] * COL + 2, g["y"] * ROW + 2, g["w"] * COL - 4, g["h"] * ROW - 4
        out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="3" fill="#181b1f" stroke="#2c3235"/>')
        out.append(text(x + 8, y + 17, p["title"], 12, "#ccccdc", weight="bold"))
        unit = p["fieldConfig"]["defaults"].get("unit", "short")
        if p["type"] == "table":
            rows = []
            for t in p["targets"]:
                for r in query(a.prometheus, "/api/v1/query", query=substitute(t["expr"], a.range_seconds), time=end):
                    rows.append(dict(r["metric"], Value=fmt(float(r["value"][1]), unit)))
            hidden = {k for tr in p.get("transformations", []) if tr["id"] == "organize"
                      for k, v in tr["options"].get("excludeByName", {}).items() if v}
            out += table(x, y, w, h, rows, hidden)
            continue
        series = []
        for t in p["targets"]:
            for r in query(a.prometheus, "/api/v1/query_range", query=substitute(t["expr"], a.range_seconds),
                           start=start, end=end, step=step):
                pts = [(float(ts), v) for ts, v in r["values"]]
                last = float(pts[-1][1]) if pts else None
                series.append((legend(t.get("legendFormat", ""), r["metric"]), last, pts))
        # The legend lists the largest last values first.
        series.sort(key=lambda s: -(s[1] if s[1] is not None and not math.isnan(s[1]) else -math.inf))
        out += timeseries(p, x, y, w, h, series, unit)
    out.append("</svg>")
    with open(a.out, "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
