//! The HTML form of an assessment: one self-contained page (inline CSS and SVG, no script, no
//! external resource) with, per model, the duplicated prefill over time, each replica's hit rate
//! and the thrash (recomputation after eviction) over time.

use std::fmt::Write;

use super::report::{ModelReport, Report};

/// Width and height of a plot, in SVG user units.
const W: f64 = 640.0;
const H: f64 = 220.0;
/// Left and bottom margins for the axes' labels.
const ML: f64 = 60.0;
const MB: f64 = 30.0;

const COLOURS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// The whole page.
pub fn page(r: &Report) -> String {
    let mut out = String::with_capacity(16 * 1024);
    out.push_str(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>kvroute assess</title>\n<style>body{font-family:sans-serif;max-width:720px;\
         margin:2em auto;color:#222}svg{background:#fafafa;border:1px solid #ddd}\
         .verdict{background:#eef;padding:.6em}table{border-collapse:collapse}\
         td,th{padding:2px 8px;text-align:right}</style></head><body>\n",
    );
    let _ = writeln!(
        out,
        "<h1>kvroute assess</h1><p>{:.0} s window. Thresholds: low reuse below {:.0} % of \
         computed prompt tokens computed twice; thrash above {:.0} % recomputed after an eviction \
         the fleet's whole KV would not have avoided, or any preemption; session affinity would \
         do when kvroute saves less than the low-reuse share of the prefill session affinity \
         still computes.</p>",
        r.window_s,
        r.thresholds.low_reuse_share * 100.0,
        r.thresholds.thrash_share * 100.0
    );
    for m in &r.models {
        model_section(&mut out, m);
    }
    out.push_str("</body></html>\n");
    out
}

fn model_section(out: &mut String, m: &ModelReport) {
    let _ = writeln!(
        out,
        "<h2>model {}</h2><p class=\"verdict\">{}</p>",
        escape(&m.model),
        escape(&m.summary)
    );
    let t: Vec<f64> = m.series.iter().map(|p| p.t_s).collect();
    let dup: Vec<Option<f64>> = m
        .series
        .iter()
        .map(|p| Some(share(p.duplicated_tokens, p.computed_tokens) * 100.0))
        .collect();
    line_plot(
        out,
        "duplicated-prefill",
        "Duplicated prefill over time (% of computed prompt tokens another replica held)",
        &t,
        &[("duplicated", dup)],
        "%",
    );
    let bars: Vec<(String, f64)> = m
        .replicas
        .iter()
        .map(|r| (r.replica.clone(), r.hit_rate * 100.0))
        .collect();
    bar_plot(
        out,
        "hit-rate",
        "Prefix-cache hit rate per replica over the window",
        &bars,
    );
    let recomputed: Vec<Option<f64>> = m
        .series
        .iter()
        .map(|p| Some(share(p.recomputed_tokens, p.computed_tokens) * 100.0))
        .collect();
    let beyond_fleet: Vec<Option<f64>> = m
        .series
        .iter()
        .map(|p| Some(share(p.capacity_recomputed_tokens, p.computed_tokens) * 100.0))
        .collect();
    line_plot(
        out,
        "thrash",
        "Thrash over time (% of computed prompt tokens recomputed after an eviction; beyond the \
         fleet's KV: what one copy per block in the whole fleet would have recomputed too)",
        &t,
        &[
            ("recomputed", recomputed),
            ("beyond the fleet's KV", beyond_fleet),
        ],
        "%",
    );
    if let Some(a) = &m.audit {
        audit_section(out, a);
    }
}

/// The prompt audit's divergences (`--audit`) as a table, with the text under `--show-text`.
fn audit_section(out: &mut String, a: &super::audit::AuditReport) {
    let _ = writeln!(out, "<h3>Prompt audit</h3><p>{}.</p>", a.examined());
    if a.divergences.is_empty() {
        out.push_str("<p>No early divergence found.</p>\n");
        return;
    }
    out.push_str(
        "<table id=\"audit\"><tr><th>at token</th><th>differing tokens</th><th>requests</th>\
         <th>families</th><th>tokens stored again</th><th>of stored</th></tr>\n",
    );
    for d in &a.divergences {
        out.push_str("<tr>");
        for cell in d.cells() {
            let _ = write!(out, "<td>{cell}</td>");
        }
        out.push_str("</tr>\n");
    }
    out.push_str("</table>\n");
    for d in &a.divergences {
        for line in d.text.iter().flatten() {
            let _ = writeln!(out, "<pre>{}</pre>", escape(line));
        }
    }
}

fn share(part: f64, whole: f64) -> f64 {
    if whole > 0.0 {
        (part / whole).min(1.0)
    } else {
        0.0
    }
}

/// A line plot of `series` against `t` (a `None` point breaks the line).
fn line_plot(
    out: &mut String,
    id: &str,
    title: &str,
    t: &[f64],
    series: &[(&str, Vec<Option<f64>>)],
    unit: &str,
) {
    let t_max = t.iter().copied().fold(0.0, f64::max).max(1e-9);
    let y_max = series
        .iter()
        .flat_map(|(_, v)| v.iter().flatten().copied())
        .fold(0.0, f64::max)
        .max(1.0);
    open_svg(out, id, title);
    axes(out, y_max, unit, &format!("seconds (0 to {t_max:.0})"));
    for (i, (name, values)) in series.iter().enumerate() {
        let mut path = String::new();
        let mut pen_up = true;
        for (x, y) in t.iter().zip(values) {
            let Some(y) = y else {
                pen_up = true;
                continue;
            };
            let px = ML + x / t_max * (W - ML - 10.0);
            let py = (H - MB) - y / y_max * (H - MB - 10.0);
            let _ = write!(path, "{}{px:.1},{py:.1} ", if pen_up { "M" } else { "L" });
            pen_up = false;
        }
        let _ = writeln!(
            out,
            "<path class=\"series\" d=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\">\
             <title>{}</title></path>",
            path.trim_end(),
            COLOURS[i % COLOURS.len()],
            escape(name)
        );
    }
    out.push_str("</svg>\n");
}

/// A bar per (label, value in %).
fn bar_plot(out: &mut String, id: &str, title: &str, bars: &[(String, f64)]) {
    open_svg(out, id, title);
    axes(out, 100.0, "%", "replica");
    let n = bars.len().max(1) as f64;
    let slot = (W - ML - 10.0) / n;
    for (i, (label, v)) in bars.iter().enumerate() {
        let h = v.clamp(0.0, 100.0) / 100.0 * (H - MB - 10.0);
        let x = ML + i as f64 * slot + slot * 0.15;
        let _ = writeln!(
            out,
            "<rect class=\"bar\" x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{h:.1}\" \
             fill=\"{}\"><title>{}: {v:.1} %</title></rect>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"middle\">{}</text>",
            H - MB - h,
            slot * 0.7,
            COLOURS[i % COLOURS.len()],
            escape(label),
            x + slot * 0.35,
            H - MB + 14.0,
            escape(label)
        );
    }
    out.push_str("</svg>\n");
}

fn open_svg(out: &mut String, id: &str, title: &str) {
    let _ = writeln!(
        out,
        "<h3>{}</h3><svg id=\"{id}\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" \
         height=\"{H}\" viewBox=\"0 0 {W} {H}\" role=\"img\" aria-label=\"{}\">",
        escape(title),
        escape(title)
    );
}

fn axes(out: &mut String, y_max: f64, unit: &str, x_label: &str) {
    let _ = writeln!(
        out,
        "<line x1=\"{ML}\" y1=\"10\" x2=\"{ML}\" y2=\"{y0}\" stroke=\"#444\"/>\
         <line x1=\"{ML}\" y1=\"{y0}\" x2=\"{x1}\" y2=\"{y0}\" stroke=\"#444\"/>\
         <text x=\"4\" y=\"16\" font-size=\"11\">{y_max:.0} {unit}</text>\
         <text x=\"4\" y=\"{y0}\" font-size=\"11\">0</text>\
         <text x=\"{xm}\" y=\"{yl}\" font-size=\"11\" text-anchor=\"middle\">{}</text>",
        escape(x_label),
        y0 = H - MB,
        x1 = W - 10.0,
        xm = (ML + W) / 2.0,
        yl = H - 4.0,
    );
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}
