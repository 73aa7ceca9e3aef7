//! Plots in PNG and SVG (plotters, pure Rust; text drawn with the bundled DejaVu Sans, so no system fonts are
//! needed): tok/s against prompt tokens per arm, and the memory timeline with phase markers.

use std::path::Path;
use std::sync::Once;

use anyhow::{Result, anyhow};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::report::Report;

static FONT: Once = Once::new();

fn register_font() {
    FONT.call_once(|| {
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    });
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// Writes `<stem>.png` and `<stem>.svg` into `dir` by drawing with `draw` on both backends.
fn both(
    dir: &Path,
    stem: &str,
    draw: impl Fn(&DrawingArea<SVGBackend<'_>, Shift>, &DrawingArea<BitMapBackend<'_>, Shift>) -> Result<()>,
) -> Result<()> {
    register_font();
    let svg_path = dir.join(format!("{stem}.svg"));
    let png_path = dir.join(format!("{stem}.png"));
    let svg = SVGBackend::new(&svg_path, (900, 500)).into_drawing_area();
    let png = BitMapBackend::new(&png_path, (900, 500)).into_drawing_area();
    draw(&svg, &png)?;
    svg.present().map_err(|e| anyhow!("{e}"))?;
    png.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// Series of (prompt tokens, median tok/s) per arm and metric.
fn rate_series(r: &Report) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut out = Vec::new();
    for a in &r.arms {
        for (metric, pick) in [("prefill", 0usize), ("decode", 1)] {
            let mut pts: Vec<(f64, f64)> = a
                .rows
                .iter()
                .filter_map(|row| {
                    let n = row
                        .samples
                        .iter()
                        .find_map(|s| s.prompt_tokens)
                        .or(row.tokens_requested)?;
                    let st = if pick == 0 { row.prefill_tok_s } else { row.decode_tok_s }?;
                    Some((n as f64, st.median))
                })
                .collect();
            pts.sort_by(|x, y| x.0.total_cmp(&y.0));
            if !pts.is_empty() {
                out.push((format!("{} {metric}", a.name), pts));
            }
        }
    }
    out
}

fn draw_rates<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, r: &Report) -> Result<()> {
    let series = rate_series(r);
    area.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let xmax = series.iter().flat_map(|s| s.1.iter().map(|p| p.0)).fold(1.0, f64::max);
    let ymax = series.iter().flat_map(|s| s.1.iter().map(|p| p.1)).fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(area)
        .caption(format!("{}: tok/s vs prompt tokens", r.scenario), ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..xmax * 1.05, 0.0..ymax * 1.15)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("prompt tokens")
        .y_desc("tok/s (median)")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            .map_err(|e| anyhow!("{e}"))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(|e| anyhow!("{e}"))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

fn draw_memory<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, r: &Report) -> Result<()> {
    area.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let mib = |b: u64| b as f64 / 1048576.0;
    let tmax = r
        .arms
        .iter()
        .flat_map(|a| a.memory.iter().map(|m| m.t_ms as f64 / 1e3))
        .fold(1.0, f64::max);
    let ymax = r
        .arms
        .iter()
        .flat_map(|a| a.memory.iter().map(|m| mib(m.worker_rss_bytes + m.serve_rss_bytes)))
        .fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!("{}: memory (RSS, MiB) over time", r.scenario),
            ("sans-serif", 20),
        )
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..tmax * 1.02, 0.0..ymax * 1.2)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("seconds since start")
        .y_desc("MiB")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    for (i, a) in r.arms.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let pts: Vec<(f64, f64)> = a
            .memory
            .iter()
            .map(|m| (m.t_ms as f64 / 1e3, mib(m.worker_rss_bytes + m.serve_rss_bytes)))
            .collect();
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))
            .map_err(|e| anyhow!("{e}"))?
            .label(format!("{} serve+worker RSS", a.name))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        // Phase markers: a thin line at the start of each case row.
        let marks = a
            .markers
            .iter()
            .map(|(t, _)| PathElement::new(vec![(*t as f64 / 1e3, 0.0), (*t as f64 / 1e3, ymax * 0.06)], c.mix(0.6)));
        chart.draw_series(marks).map_err(|e| anyhow!("{e}"))?;
        if let Some((t, label)) = a.markers.first() {
            chart
                .draw_series(std::iter::once(Text::new(
                    format!("{}: {label}", a.name),
                    (*t as f64 / 1e3, ymax * (1.05 + 0.06 * (i % 2) as f64)),
                    ("sans-serif", 12).into_font().color(&c),
                )))
                .map_err(|e| anyhow!("{e}"))?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// Draws every plot of `r` into `dir`; returns the PNG file names.
///
/// Errors: a file cannot be written.
pub fn write_all(dir: &Path, r: &Report) -> Result<Vec<String>> {
    let mut out = Vec::new();
    if !rate_series(r).is_empty() {
        both(dir, "tok_s_vs_prompt", |s, p| {
            draw_rates(s, r)?;
            draw_rates(p, r)
        })?;
        out.push("tok_s_vs_prompt.png".to_string());
    }
    if r.arms.iter().any(|a| !a.memory.is_empty()) {
        both(dir, "memory_timeline", |s, p| {
            draw_memory(s, r)?;
            draw_memory(p, r)
        })?;
        out.push("memory_timeline.png".to_string());
    }
    Ok(out)
}
