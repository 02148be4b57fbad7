//! SVG plots of one or several reports (configurations) overlaid:
//! - `ttft_cdf.svg`, `tpot_cdf.svg`, `e2e_cdf.svg`: the empirical CDF of each latency over
//!   completed requests, one line per configuration and run (only the runs at
//!   `cdf_rate`, when given);
//! - `attainment_vs_rate.svg`: SLO attainment against the offered rate, one line per
//!   configuration, with the attainment target (reports that have a sweep);
//! - `ttft_p90_vs_rate.svg`, `tpot_p90_vs_rate.svg`: p90 latency against the offered rate.
//!
//! Invariants: a plot without any data is not written (and not listed); a CDF rises from
//! 1/n to 1 over the sorted values; line colours follow the order of the reports.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::error::{BenchError, Result};
use crate::record::RequestRecord;
use crate::report::{Report, RunReport};
use crate::stats::Dist;

const SIZE: (u32, u32) = (900, 560);

/// (file stem, title, values of one record in seconds).
type RecordMetric = (&'static str, &'static str, fn(&RequestRecord) -> Vec<f64>);
/// (file stem, title, summary of one run).
type RunMetric = (&'static str, &'static str, fn(&RunReport) -> Option<&Dist>);

/// A named line.
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
    colour: RGBAColor,
}

/// Sorted values as CDF points (value, fraction of values <= it).
pub fn cdf(values: impl IntoIterator<Item = f64>) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.into_iter()
        .enumerate()
        .map(|(i, x)| (x, (i + 1) as f64 / n))
        .collect()
}

/// Tableau's ten qualitative colours: one per configuration (report).
const COLOURS: [(u8, u8, u8); 10] = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
];

/// Colour of report `i`; run `j` of `n` is drawn lighter the lower its rank (rate).
fn colour(i: usize, j: usize, n: usize) -> RGBAColor {
    let (r, g, b) = COLOURS[i % COLOURS.len()];
    let alpha = if n <= 1 {
        1.0
    } else {
        0.3 + 0.7 * j as f64 / (n - 1) as f64
    };
    RGBColor(r, g, b).mix(alpha)
}

fn run_name(report: &Report, run: &RunReport) -> String {
    match (report.runs.len(), run.summary.rate) {
        (1, _) | (_, None) => report.label.clone(),
        (_, Some(r)) => format!("{} @ {r} req/s", report.label),
    }
}

fn plot_err(path: &Path, e: impl std::fmt::Display) -> BenchError {
    BenchError::Plot {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

/// Draws `series` as lines; returns false (and writes nothing) when there is no point.
fn draw(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[Series],
    y_range: Option<(f64, f64)>,
    hline: Option<f64>,
) -> Result<bool> {
    let all = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    let mut any = false;
    for &(x, y) in all {
        any = true;
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if !any {
        return Ok(false);
    }
    let (x0, x1) = (x0.min(0.0), if x1 > 0.0 { x1 * 1.05 } else { 1.0 });
    let (y0, y1) = y_range.unwrap_or((y0.min(0.0), if y1 > 0.0 { y1 * 1.1 } else { 1.0 }));
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| plot_err(path, e))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(|e| plot_err(path, e))?;
    if let Some(h) = hline {
        chart
            .draw_series(LineSeries::new(
                [(x0, h), (x1, h)],
                BLACK.mix(0.5).stroke_width(1),
            ))
            .map_err(|e| plot_err(path, e))?
            .label(format!("target {:.0}%", h * 100.0))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.mix(0.5)));
    }
    for s in series {
        let c = s.colour;
        chart
            .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
            .map_err(|e| plot_err(path, e))?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        if s.points.len() < 30 {
            chart
                .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, c.filled())))
                .map_err(|e| plot_err(path, e))?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| plot_err(path, e))?;
    root.present().map_err(|e| plot_err(path, e))?;
    Ok(true)
}

/// Writes every plot the reports have data for into `dir`; returns the files written.
pub fn write_plots(reports: &[Report], dir: &Path, cdf_rate: Option<f64>) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| BenchError::file(dir, e))?;
    let mut written = Vec::new();
    let latency: [RecordMetric; 3] = [
        ("ttft", "TTFT", |r| r.ttft_s.into_iter().collect()),
        ("tpot", "TPOT", |r| r.tpot_s.into_iter().collect()),
        ("e2e", "end-to-end latency", |r| {
            r.e2e_s.into_iter().collect()
        }),
    ];
    for (file, name, values) in latency {
        let mut series = Vec::new();
        for (i, rep) in reports.iter().enumerate() {
            for (j, run) in rep.runs.iter().enumerate() {
                if cdf_rate.is_some_and(|want| run.summary.rate != Some(want)) {
                    continue;
                }
                let ms = run
                    .requests
                    .iter()
                    .filter(|r| r.ok())
                    .flat_map(values)
                    .map(|s| s * 1000.0);
                series.push(Series {
                    name: run_name(rep, run),
                    points: cdf(ms),
                    colour: colour(i, j, rep.runs.len()),
                });
            }
        }
        let path = dir.join(format!("{file}_cdf.svg"));
        if draw(
            &path,
            &format!("{name}: CDF"),
            &format!("{name} (ms)"),
            "fraction of completed requests",
            &series,
            Some((0.0, 1.0)),
            None,
        )? {
            written.push(path);
        }
    }

    // Attainment against the offered rate.
    let mut series = Vec::new();
    let mut target = None;
    for (i, rep) in reports.iter().enumerate() {
        if let Some(sw) = &rep.sweep {
            target = Some(sw.attainment_target);
            let mut pts: Vec<(f64, f64)> =
                sw.points.iter().map(|p| (p.rate, p.attainment)).collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            series.push(Series {
                name: match sw.goodput_rate {
                    Some(g) => format!("{} (goodput {g} req/s)", rep.label),
                    None => rep.label.clone(),
                },
                points: pts,
                colour: colour(i, 0, 1),
            });
        }
    }
    let path = dir.join("attainment_vs_rate.svg");
    if draw(
        &path,
        "SLO attainment",
        "offered request rate (req/s)",
        "share of requests meeting the SLO",
        &series,
        Some((0.0, 1.05)),
        target,
    )? {
        written.push(path);
    }

    // p90 latency against the offered rate.
    let metrics: [RunMetric; 2] = [
        ("ttft", "TTFT", |r| r.summary.ttft_ms.as_ref()),
        ("tpot", "TPOT", |r| r.summary.tpot_ms.as_ref()),
    ];
    for (file, name, dist) in metrics {
        let mut series = Vec::new();
        for (i, rep) in reports.iter().enumerate() {
            let mut pts: Vec<(f64, f64)> = rep
                .runs
                .iter()
                .filter_map(|r| Some((r.summary.rate?, dist(r)?.p90)))
                .collect();
            if pts.len() < 2 {
                continue;
            }
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            series.push(Series {
                name: rep.label.clone(),
                points: pts,
                colour: colour(i, 0, 1),
            });
        }
        let path = dir.join(format!("{file}_p90_vs_rate.svg"));
        if draw(
            &path,
            &format!("{name} p90 against load"),
            "offered request rate (req/s)",
            &format!("{name} p90 (ms)"),
            &series,
            None,
            None,
        )? {
            written.push(path);
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_rises_to_one_over_sorted_values() {
        let xs = [5.0, 1.0, 3.0, f64::NAN, 2.0];
        let c = cdf(xs);
        let finite = xs.iter().filter(|x| x.is_finite()).count();
        assert_eq!(c.len(), finite);
        assert!(c.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1));
        assert_eq!(c.last().map(|p| p.1), Some(1.0));
        assert_eq!(c.first().map(|p| p.1), Some(1.0 / finite as f64));
        assert!(cdf(Vec::new()).is_empty());
    }
}
