//! A timeline picture (SVG) of co-location: when online work was busy, when offline work
//! was suspended, and (when known) how long online requests took.
//!
//! Input: the agent's preemption/release events (event log or `/state`'s
//! `recent_events`), optionally online request records `(arrival_ns, done_ns)`.

use crate::control::events::Event;
use std::fmt::Write;

/// One online request series to plot: label, colour, `(arrival_ns, done_ns)` records.
pub type Requests<'a> = (&'a str, &'a str, &'a [(u64, u64)]);

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Time intervals, `(start_ns, end_ns)`.
pub type Intervals = Vec<(u64, u64)>;

/// Busy and suspended intervals (ns) for `gpu` from preempt/release events.
pub fn intervals(events: &[Event], gpu: u32) -> (Intervals, Intervals) {
    let mut busy = Vec::new();
    let mut suspended = Vec::new();
    let mut open = None;
    for e in events {
        match e {
            Event::Preempt(p) if p.gpu == gpu => open = Some(p),
            Event::Release(r) if r.gpu == gpu => {
                if let Some(p) = open.take() {
                    let start = p.onset_ns;
                    let last_online = r.window_end_ns.saturating_sub(r.idle_window_ns);
                    busy.push((start, last_online.max(start)));
                    if let (Some(s), Some(r)) = (p.confirmed_ns, r.confirmed_ns) {
                        suspended.push((s, r));
                    }
                }
            }
            _ => {}
        }
    }
    (busy, suspended)
}

/// Renders the timeline of `gpu` between `t0` and `t1` (ns) as an SVG document.
pub fn svg(
    title: &str,
    events: &[Event],
    gpu: u32,
    requests: &[Requests<'_>],
    t0: u64,
    t1: u64,
) -> String {
    let (w, left, right) = (1000.0, 150.0, 20.0);
    let span = (t1.saturating_sub(t0)).max(1) as f64;
    let x = |t: u64| left + (t.saturating_sub(t0) as f64 / span) * (w - left - right);
    let (busy, suspended) = intervals(events, gpu);
    let lat_h = if requests.is_empty() { 0.0 } else { 180.0 };
    let h = 150.0 + lat_h;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="10" y="20" font-size="15" font-weight="bold">{}</text>
"#,
        esc(title)
    );
    for (i, (label, colour, iv)) in [
        ("online busy", "#1f77b4", &busy),
        ("offline suspended", "#d62728", &suspended),
    ]
    .iter()
    .enumerate()
    {
        let y = 40.0 + i as f64 * 35.0;
        let _ = writeln!(s, r#"<text x="10" y="{}">{label}</text>"#, y + 15.0);
        let _ = writeln!(
            s,
            r##"<rect x="{left}" y="{y}" width="{}" height="22" fill="#f2f2f2"/>"##,
            w - left - right
        );
        for (a, b) in iv.iter().filter(|(a, b)| *b >= t0 && *a <= t1) {
            let (xa, xb) = (x((*a).max(t0)), x((*b).min(t1)));
            let _ = writeln!(
                s,
                r#"<rect x="{xa:.1}" y="{y}" width="{:.1}" height="22" fill="{colour}"/>"#,
                (xb - xa).max(1.0)
            );
        }
    }
    // Time axis.
    let secs = span / 1e9;
    let step = [0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0]
        .into_iter()
        .find(|st| secs / st <= 12.0)
        .unwrap_or(60.0);
    let mut t = 0.0;
    while t <= secs + 1e-9 {
        let xt = left + t / secs * (w - left - right);
        let _ = writeln!(
            s,
            r##"<line x1="{xt:.1}" y1="110" x2="{xt:.1}" y2="116" stroke="#333"/><text x="{xt:.1}" y="130" text-anchor="middle">{t:.1} s</text>"##
        );
        t += step;
    }
    if !requests.is_empty() {
        let top = 150.0;
        let max_ms = requests
            .iter()
            .flat_map(|(_, _, r)| r.iter().map(|(a, d)| d.saturating_sub(*a) as f64 / 1e6))
            .fold(1.0f64, f64::max)
            * 1.1;
        let y = |ms: f64| top + 150.0 - ms / max_ms * 140.0;
        let _ = writeln!(
            s,
            r#"<text x="10" y="{}">online request</text><text x="10" y="{}">latency (ms)</text>"#,
            top + 60.0,
            top + 75.0
        );
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="#333"/>"##,
            top + 150.0,
            w - right,
            top + 150.0
        );
        for ms in [0.0, max_ms / 2.0, max_ms / 1.1] {
            let _ = writeln!(
                s,
                r##"<text x="{}" y="{:.1}" text-anchor="end">{ms:.0}</text><line x1="{left}" y1="{:.1}" x2="{}" y2="{:.1}" stroke="#ddd"/>"##,
                left - 5.0,
                y(ms) + 4.0,
                y(ms),
                w - right,
                y(ms)
            );
        }
        for (i, (label, colour, recs)) in requests.iter().enumerate() {
            for (a, d) in recs.iter().filter(|(a, _)| *a >= t0 && *a <= t1) {
                let ms = d.saturating_sub(*a) as f64 / 1e6;
                let _ = writeln!(
                    s,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{colour}"/>"#,
                    x(*a),
                    y(ms)
                );
            }
            let lx = left + 10.0 + i as f64 * 220.0;
            let _ = writeln!(
                s,
                r#"<circle cx="{lx}" cy="{}" r="4" fill="{colour}"/><text x="{}" y="{}">{}</text>"#,
                top + 5.0,
                lx + 8.0,
                top + 9.0,
                esc(label)
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_from_events() {
        let ev = crate::control::events::parse_log(concat!(
            r#"{"event":"preempt","gpu":0,"onset_ns":100,"signal":"nvml","decided_ns":105,"detection_s":0.0,"offline":1,"confirmed_ns":110}"#,
            "\n",
            r#"{"event":"release","gpu":0,"window_end_ns":400,"decided_ns":401,"idle_window_ns":100,"busy_for_s":0.0,"offline":1,"confirmed_ns":405}"#,
            "\n",
            "not an event\n",
            r#"{"event":"preempt","gpu":1,"onset_ns":150,"signal":"doorbell","decided_ns":155,"detection_s":0.0,"offline":1,"confirmed_ns":160}"#,
            "\n",
        ));
        assert_eq!(ev.len(), 3);
        let (busy, sus) = intervals(&ev, 0);
        assert_eq!(busy, vec![(100, 300)]);
        assert_eq!(sus, vec![(110, 405)]);
        let doc = svg("t", &ev, 0, &[("req", "#000", &[(120, 200)])], 0, 500);
        assert!(
            doc.starts_with("<svg") && doc.contains("offline suspended") && doc.contains("<circle")
        );
    }
}
