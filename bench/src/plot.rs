//! Line charts, grids of them, and grouped bar charts as PNG, for results people compare.
//!
//! Text needs a font: DejaVu Sans from the Debian package `fonts-dejavu-core` (installed by
//! `ops/install-packages.sh`), loaded once at run time.

use std::path::Path;
use std::sync::Once;

use anyhow::Context;
use plotters::prelude::*;

const FONT_PATHS: &[&str] =
    &["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/dejavu/DejaVuSans.ttf"];

fn register_font() -> anyhow::Result<()> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = (|| {
            let path = FONT_PATHS
                .iter()
                .find(|p| Path::new(p).exists())
                .context("no DejaVu Sans font found: install fonts-dejavu-core")?;
            let bytes: &'static [u8] = Box::leak(std::fs::read(path)?.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| anyhow::anyhow!("{path} is not a usable font"))?;
            Ok(())
        })();
    });
    result
}

/// One line of a chart.
pub struct Series {
    /// Its name in the legend.
    pub name: String,
    /// Its (x, y) points.
    pub points: Vec<(f64, f64)>,
}

/// How x values are labelled (e.g. `2^x` when x is a log2).
pub type XFormat<'a> = &'a dyn Fn(&f64) -> String;

/// Writes a line chart of `series` to `path` (PNG, 1200 x 700).
/// Where a plot went, for a report: the figures stand without the picture (e.g. in the test
/// VM, which has no fonts), so a plot that could not be drawn is a warning, not an error.
pub fn drawn(path: &Path, result: anyhow::Result<()>) -> Option<String> {
    match result {
        Ok(()) => Some(path.display().to_string()),
        Err(e) => {
            eprintln!("warning: no plot at {}: {e:#}", path.display());
            None
        }
    }
}

/// Writes a line chart of `series` to `path` (PNG, 1200 x 700) with plain x labels.
pub fn line_chart(path: &Path, title: &str, x_label: &str, y_label: &str, series: &[Series]) -> anyhow::Result<()> {
    line_chart_with(path, title, x_label, y_label, series, None)
}

/// Like [`line_chart`], with the x labels drawn by `x_format`.
pub fn line_chart_with(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    x_format: Option<XFormat<'_>>,
) -> anyhow::Result<()> {
    let root = canvas(path, (1200, 700))?;
    draw_lines(&root, title, x_label, y_label, series, x_format)?;
    root.present().map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    Ok(())
}

/// One chart of a grid: its title and lines.
pub struct Panel {
    /// The chart's title.
    pub title: String,
    /// Its lines.
    pub series: Vec<Series>,
}

/// Writes `panels` as a grid of line charts, `columns` wide (PNG, 600 x 450 a chart),
/// under one title.
pub fn line_grid(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    panels: &[Panel],
    columns: usize,
    x_format: Option<XFormat<'_>>,
) -> anyhow::Result<()> {
    let columns = columns.clamp(1, panels.len().max(1));
    let rows = panels.len().div_ceil(columns).max(1);
    let root = canvas(path, (600 * columns as u32, 450 * rows as u32 + 50))?;
    let root = root.titled(title, ("sans-serif", 28)).map_err(|e| anyhow::anyhow!("{e}"))?;
    for (area, panel) in root.split_evenly((rows, columns)).iter().zip(panels) {
        draw_lines(area, &panel.title, x_label, y_label, &panel.series, x_format)?;
    }
    root.present().map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    Ok(())
}

/// A white PNG canvas at `path` (its folder made), with the font registered.
fn canvas(path: &Path, size: (u32, u32)) -> anyhow::Result<DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>> {
    register_font()?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(root)
}

const COLORS: [RGBColor; 6] = [RED, BLUE, GREEN, MAGENTA, CYAN, BLACK];

/// Draws a line chart of `series` on `area`.
fn draw_lines(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    x_format: Option<XFormat<'_>>,
) -> anyhow::Result<()> {
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let ys = series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
    let (x_min, x_max) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)));
    let y_max = ys.fold(0.0f64, f64::max) * 1.1;
    anyhow::ensure!(x_min.is_finite() && x_max > x_min, "nothing to plot");
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 26))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(90)
        .build_cartesian_2d(x_min..x_max, 0.0..y_max.max(1.0))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let plain = |x: &f64| format!("{x}");
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .x_label_formatter(x_format.unwrap_or(&plain))
        .label_style(("sans-serif", 16))
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(s.points.iter().copied(), color.stroke_width(2)))
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 18))
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

/// Bars of one name, one per group.
pub struct BarSeries {
    /// Its name in the legend.
    pub name: String,
    /// One value per group (in the order of the groups).
    pub values: Vec<f64>,
}

/// Writes a grouped bar chart to `path` (PNG, 1200 x 700): one cluster per group, one bar
/// per series in it.
pub fn bar_chart(
    path: &Path,
    title: &str,
    y_label: &str,
    groups: &[String],
    series: &[BarSeries],
) -> anyhow::Result<()> {
    anyhow::ensure!(!groups.is_empty() && !series.is_empty(), "nothing to plot");
    let root = canvas(path, (1200, 700))?;
    let y_max = series.iter().flat_map(|s| s.values.iter().copied()).fold(0.0f64, f64::max) * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 26))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(90)
        .build_cartesian_2d(0.0..groups.len() as f64, 0.0..y_max.max(1.0))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let label = |x: &f64| {
        let i = x.floor() as usize;
        if (x - x.floor() - 0.5).abs() < 1e-6 && i < groups.len() {
            groups[i].clone()
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(groups.len() * 2 + 1)
        .x_label_formatter(&label)
        .y_desc(y_label)
        .label_style(("sans-serif", 16))
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let width = 0.8 / series.len() as f64;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let bars = s.values.iter().enumerate().map(|(g, &v)| {
            let x0 = g as f64 + 0.1 + width * i as f64;
            Rectangle::new([(x0, 0.0), (x0 + width * 0.9, v)], color.filled())
        });
        chart
            .draw_series(bars)
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .label(s.name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 18))
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    Ok(())
}
