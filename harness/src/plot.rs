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

const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
];

/// Writes `<stem>.png` and `<stem>.svg` into `dir` by drawing with `draw` on both backends.
fn both(
    dir: &Path,
    stem: &str,
    draw: impl Fn(&DrawingArea<SVGBackend<'_>, Shift>, &DrawingArea<BitMapBackend<'_>, Shift>) -> Result<()>,
) -> Result<()> {
    both_sized(dir, stem, (900, 500), draw)
}

/// [`both`] on a canvas of `size` pixels.
fn both_sized(
    dir: &Path,
    stem: &str,
    size: (u32, u32),
    draw: impl Fn(&DrawingArea<SVGBackend<'_>, Shift>, &DrawingArea<BitMapBackend<'_>, Shift>) -> Result<()>,
) -> Result<()> {
    register_font();
    let svg_path = dir.join(format!("{stem}.svg"));
    let png_path = dir.join(format!("{stem}.png"));
    let svg = SVGBackend::new(&svg_path, size).into_drawing_area();
    let png = BitMapBackend::new(&png_path, size).into_drawing_area();
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

/// A chart on `area` with the report's look: a caption, labelled axes over `x` and `y`.
fn frame<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    caption: String,
    x: std::ops::Range<f64>,
    y: std::ops::Range<f64>,
    (x_desc, y_desc): (&str, &str),
) -> Result<
    ChartContext<'a, DB, Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>>,
> {
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x, y)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    Ok(chart)
}

/// Draws the chart's series labels at `pos` in `size`-point type.
fn legend<'a, DB: DrawingBackend + 'a>(
    chart: &mut ChartContext<
        'a,
        DB,
        Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
    >,
    pos: SeriesLabelPosition,
    size: u32,
) -> Result<()> {
    chart
        .configure_series_labels()
        .position(pos)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", size))
        .draw()
        .map_err(|e| anyhow!("{e}"))
}

fn draw_rates<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, r: &Report) -> Result<()> {
    let series = rate_series(r);
    area.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let xmax = series.iter().flat_map(|s| s.1.iter().map(|p| p.0)).fold(1.0, f64::max);
    let ymax = series.iter().flat_map(|s| s.1.iter().map(|p| p.1)).fold(1.0, f64::max);
    let mut chart = frame(
        area,
        format!("{}: tok/s vs prompt tokens", r.scenario),
        0.0..xmax * 1.05,
        0.0..ymax * 1.15,
        ("prompt tokens", "tok/s (median)"),
    )?;
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
    legend(&mut chart, SeriesLabelPosition::MiddleRight, 13)?;
    Ok(())
}

/// The memory timeline: the host's (RSS) above, and, where workers read their device's memory, the device's
/// below ([`device_readings`]).
fn draw_memory<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, r: &Report) -> Result<()> {
    let readings = device_readings(r);
    if readings.is_empty() {
        return draw_host_memory(area, r);
    }
    let (top, bottom) = area.split_vertically(area.dim_in_pixel().1 / 2);
    draw_host_memory(&top, r)?;
    draw_device_readings(&bottom, r, &readings)
}

/// One arm's device memory over time: its worker's `memory` readings (op `reading`) on the run's clock, and the
/// parts its start allocated as reference levels.
struct DeviceReadings {
    arm: String,
    total_gib: f64,
    /// (seconds since the run started, GiB of the card in use).
    used: Vec<(f64, f64)>,
    /// (GiB of the card in use once the part was allocated, the part): the memory plan's parts as the start
    /// allocated them, in order.
    parts: Vec<(f64, String)>,
    /// The arm's last host-memory sample, seconds since the run started (where its line ends).
    end: f64,
}

/// The run's clock of arm `a` (ms since it started) minus the wall clock (ms since the Unix epoch), from any
/// request that has both: what puts a worker's event (`ts_ms`) on the run's clock.
fn run_clock_offset(a: &crate::report::ArmReport) -> Option<i64> {
    a.rows
        .iter()
        .flat_map(|row| &row.samples)
        .find(|s| s.t_start_unix_ms > 0)
        .map(|s| s.t_start_unix_ms as i64 - s.t_start_ms as i64)
}

fn device_readings(r: &Report) -> Vec<DeviceReadings> {
    let gib = |b: f64, scale: f64| b / scale / (1u64 << 30) as f64;
    let mut out = Vec::new();
    for a in &r.arms {
        let Some(offset) = run_clock_offset(a) else {
            continue;
        };
        let mut d = DeviceReadings {
            arm: a.name.clone(),
            total_gib: 0.0,
            used: vec![],
            parts: vec![],
            end: a.memory.last().map_or(0.0, |m| m.t_ms as f64 / 1e3),
        };
        let mut loaded = false;
        for e in &a.raw_events {
            if e["event"] == "load" {
                loaded = true;
            }
            if e["event"] != "memory" {
                continue;
            }
            let scale = e["scale"].as_f64().filter(|s| *s > 0.0).unwrap_or(1.0);
            let total = e["total_bytes"].as_f64().unwrap_or(0.0);
            let used = total - e["free_bytes"].as_f64().unwrap_or(0.0);
            d.total_gib = gib(total, scale);
            match e["op"].as_str() {
                Some("reading") => {
                    if let Some(ts) = e["ts_ms"].as_i64() {
                        d.used.push(((ts - offset) as f64 / 1e3, gib(used, scale)));
                    }
                }
                // The first start's parts (a restarted worker allocates them again).
                Some("alloc" | "register") if !loaded => {
                    d.parts
                        .push((gib(used, scale), e["what"].as_str().unwrap_or("").to_string()));
                }
                _ => {}
            }
        }
        if !d.used.is_empty() {
            out.push(d);
        }
    }
    out
}

fn draw_device_readings<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    r: &Report,
    series: &[DeviceReadings],
) -> Result<()> {
    area.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let tmax = r
        .arms
        .iter()
        .flat_map(|a| a.memory.iter().map(|m| m.t_ms as f64 / 1e3))
        .chain(series.iter().flat_map(|d| d.used.iter().map(|p| p.0)))
        .fold(1.0, f64::max);
    let ymax = series.iter().map(|d| d.total_gib).fold(0.001, f64::max);
    let mut chart = frame(
        area,
        format!("{}: device memory in use over time (GiB of the card)", r.scenario),
        0.0..tmax * 1.02,
        0.0..ymax * 1.1,
        ("seconds since start", "GiB in use"),
    )?;
    for (i, d) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        // A reading holds until the next one; the last holds to the end of the run.
        let mut pts = Vec::new();
        for (j, p) in d.used.iter().enumerate() {
            if j > 0 {
                pts.push((p.0, d.used[j - 1].1));
            }
            pts.push(*p);
        }
        // To the arm's last host sample: its server's end.
        if let Some(&(t, y)) = d.used.last() {
            pts.push((d.end.max(t), y));
        }
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))
            .map_err(|e| anyhow!("{e}"))?
            .label(format!("{} (card {:.1} GiB)", d.arm, d.total_gib))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        // The plan's parts: a dashed level where each part's allocation left the card, named at the right.
        for (level, what) in &d.parts {
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(0.0, *level), (tmax, *level)],
                    6,
                    4,
                    c.mix(0.5).stroke_width(1),
                ))
                .map_err(|e| anyhow!("{e}"))?;
            chart
                .draw_series(std::iter::once(Text::new(
                    what.clone(),
                    (tmax * 0.75, *level + ymax * 0.02),
                    ("sans-serif", 10).into_font().color(&c),
                )))
                .map_err(|e| anyhow!("{e}"))?;
        }
    }
    legend(&mut chart, SeriesLabelPosition::LowerRight, 11)?;
    Ok(())
}

fn draw_host_memory<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, r: &Report) -> Result<()> {
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
    let mut chart = frame(
        area,
        format!("{}: memory (RSS, MiB) over time", r.scenario),
        0.0..tmax * 1.02,
        0.0..ymax * 1.2,
        ("seconds since start", "MiB"),
    )?;
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
    legend(&mut chart, SeriesLabelPosition::LowerRight, 13)?;
    Ok(())
}

/// Series of (seconds since the run started, decode hit rate in %) per arm: one point per `expert_cache` event
/// of phase `decode` (one a request), placed by the worker's timestamp on the run's clock.
fn hit_rate_series(r: &Report) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut out = Vec::new();
    for a in &r.arms {
        let Some(offset) = run_clock_offset(a) else {
            continue;
        };
        let pts: Vec<(f64, f64)> = a
            .raw_events
            .iter()
            .filter(|e| e["event"] == "expert_cache" && e["phase"] == "decode")
            .filter_map(|e| {
                let (ts, l, h) = (e["ts_ms"].as_i64()?, e["lookups"].as_f64()?, e["hits"].as_f64()?);
                (l > 0.0).then(|| ((ts - offset) as f64 / 1e3, h / l * 100.0))
            })
            .collect();
        if !pts.is_empty() {
            out.push((a.name.clone(), pts));
        }
    }
    out
}

fn draw_hit_rate<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, r: &Report) -> Result<()> {
    let series = hit_rate_series(r);
    area.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let tmax = series.iter().flat_map(|s| s.1.iter().map(|p| p.0)).fold(1.0, f64::max);
    let mut chart = frame(
        area,
        format!("{}: decode expert cache hit rate per request", r.scenario),
        0.0..tmax * 1.02,
        0.0..105.0,
        ("seconds since start", "hit rate, %"),
    )?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled())))
            .map_err(|e| anyhow!("{e}"))?
            .label(name.clone())
            .legend(move |(x, y)| Circle::new((x + 10, y), 4, c.filled()));
    }
    legend(&mut chart, SeriesLabelPosition::LowerRight, 11)?;
    Ok(())
}

/// One arm's device memory from its worker's `memory` events (issue 17, point 7): the free memory after each
/// allocation, registration or failure, in GiB of the card (the simulation's scale undone), with the card's total
/// and what each step was.
struct DeviceMemory {
    arm: String,
    total_gib: f64,
    /// (step, free GiB after it, what, whether it failed).
    steps: Vec<(f64, f64, String, bool)>,
}

fn device_memory_series(r: &Report) -> Vec<DeviceMemory> {
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let mut out = Vec::new();
    for a in &r.arms {
        let mut d = DeviceMemory {
            arm: a.name.clone(),
            total_gib: 0.0,
            steps: Vec::new(),
        };
        // The worker restarts after a fault and replays its start: the first start is the one drawn, up to the
        // first worker's `load` event.
        let mut loaded = false;
        for e in &a.raw_events {
            if e["event"] == "load" {
                loaded |= !d.steps.is_empty();
                continue;
            }
            if e["event"] != "memory" || e["op"] == "reading" {
                continue;
            }
            if loaded {
                break;
            }
            let scale = e["scale"].as_f64().filter(|s| *s > 0.0).unwrap_or(1.0);
            let free = gib(e["free_bytes"].as_f64().unwrap_or(0.0) / scale);
            let (op, what) = (e["op"].as_str().unwrap_or(""), e["what"].as_str().unwrap_or(""));
            d.total_gib = gib(e["total_bytes"].as_f64().unwrap_or(0.0) / scale);
            if d.steps.is_empty() {
                // The free memory before the first change: the first change's free plus what it took.
                let before =
                    free + gib(e["bytes"].as_f64().unwrap_or(0.0) / scale) * f64::from(!op.ends_with("_failed"));
                d.steps.push((0.0, before, "start".into(), false));
            }
            let failed = op.ends_with("_failed");
            d.steps
                .push((d.steps.len() as f64, free, format!("{op} {what}"), failed));
            if failed {
                // What follows is the failed start's teardown.
                break;
            }
        }
        if !d.steps.is_empty() {
            out.push(d);
        }
    }
    out
}

fn draw_device_memory<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, r: &Report) -> Result<()> {
    let series = device_memory_series(r);
    area.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let ymax = series.iter().map(|d| d.total_gib).fold(1.0, f64::max);
    let xmax = series.iter().map(|d| d.steps.len() as f64).fold(2.0, f64::max);
    let mut chart = frame(
        area,
        format!(
            "{}: device memory free after each allocation (GiB of the card)",
            r.scenario
        ),
        0.0..xmax,
        0.0..ymax * 1.1,
        ("allocations and registrations, in order", "GiB free"),
    )?;
    for (i, d) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let pts: Vec<(f64, f64)> = d.steps.iter().map(|s| (s.0, s.1)).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(|e| anyhow!("{e}"))?
            .label(format!("{} (card {:.1} GiB)", d.arm, d.total_gib))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(d.steps.iter().map(|s| {
                let style = if s.3 { RED.filled() } else { c.filled() };
                Circle::new((s.0, s.1), if s.3 { 6 } else { 3 }, style)
            }))
            .map_err(|e| anyhow!("{e}"))?;
        // Name the step that took the most free memory, and a failure.
        let biggest = d
            .steps
            .windows(2)
            .map(|w| w[0].1 - w[1].1)
            .enumerate()
            .fold(
                (0, 0.0),
                |best, (j, drop)| if drop > best.1 { (j + 1, drop) } else { best },
            );
        let labels = d.steps.iter().enumerate().filter_map(|(j, s)| {
            ((j == biggest.0 && biggest.1 >= d.total_gib * 0.1) || s.3).then(|| {
                Text::new(
                    s.2.clone(),
                    (s.0, s.1 + ymax * (0.02 + 0.03 * (i % 3) as f64)),
                    ("sans-serif", 11).into_font().color(&c),
                )
            })
        });
        chart.draw_series(labels).map_err(|e| anyhow!("{e}"))?;
    }
    legend(&mut chart, SeriesLabelPosition::LowerLeft, 11)?;
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
        let tall = if device_readings(r).is_empty() { 500 } else { 800 };
        both_sized(dir, "memory_timeline", (900, tall), |s, p| {
            draw_memory(s, r)?;
            draw_memory(p, r)
        })?;
        out.push("memory_timeline.png".to_string());
    }
    if !device_memory_series(r).is_empty() {
        both(dir, "device_memory", |s, p| {
            draw_device_memory(s, r)?;
            draw_device_memory(p, r)
        })?;
        out.push("device_memory.png".to_string());
    }
    if !hit_rate_series(r).is_empty() {
        both(dir, "hit_rate_over_time", |s, p| {
            draw_hit_rate(s, r)?;
            draw_hit_rate(p, r)
        })?;
        out.push("hit_rate_over_time.png".to_string());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{ArmReport, CaseRow, Sample};

    /// The hit-rate plot is drawn from the decode `expert_cache` events on the run's clock, and only when some
    /// arm has them.
    #[test]
    fn hit_rate_points_come_from_decode_events_on_the_runs_clock() {
        let mut r = Report::empty("t");
        let sample = Sample {
            status: 200,
            t_start_ms: 500,
            t_start_unix_ms: 10_500,
            ..Sample::default()
        };
        let ev = |ts: u64, phase: &str, l: u64, h: u64| serde_json::json!({"event": "expert_cache", "ts_ms": ts, "phase": phase, "lookups": l, "hits": h});
        r.arms.push(ArmReport {
            name: "cache=small".into(),
            rows: vec![CaseRow {
                samples: vec![sample],
                ..CaseRow::default()
            }],
            raw_events: vec![
                ev(12_000, "decode", 200, 150),
                ev(12_000, "prefill", 10, 1),
                ev(13_000, "decode", 0, 0),
            ],
            ..ArmReport::default()
        });
        let s = hit_rate_series(&r);
        assert_eq!(s, vec![("cache=small".to_string(), vec![(2.0, 75.0)])]);
        let dir = tempfile::tempdir().unwrap();
        let files = write_all(dir.path(), &r).unwrap();
        assert!(files.contains(&"hit_rate_over_time.png".to_string()), "{files:?}");
        assert!(dir.path().join("hit_rate_over_time.svg").is_file());
        r.arms[0].raw_events.clear();
        assert!(hit_rate_series(&r).is_empty());
    }
}
