//! Drawing: log-log line charts and horizontal log-scale bar charts, into SVG areas.

use std::error::Error;
use std::ops::Range;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::parse::Point;

/// Where a chart is drawn.
pub type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// Result of drawing.
pub type DrawResult = Result<(), Box<dyn Error>>;

/// Colour of the kube-persist redb series.
pub const REDB: RGBColor = RGBColor(31, 119, 180);
/// Colour of the kube-persist sled series.
pub const SLED: RGBColor = RGBColor(230, 120, 10);
/// Colour of kube-runtime's reflector.
pub const REFLECTOR: RGBColor = RGBColor(214, 39, 40);
/// Colour of the bare watcher (floor).
pub const FLOOR: RGBColor = RGBColor(120, 120, 120);

const FONT: &str = "sans-serif";
// Font sizes as given to plotters (its SVG output writes them 1.24 times smaller).
const TITLE: u32 = 24;
const DESC: u32 = 18;
const TEXT: u32 = 16;

/// One line of a line chart.
pub struct Series {
    /// Legend text.
    pub label: String,
    /// Line and marker colour.
    pub color: RGBColor,
    /// The values, sorted by N.
    pub points: Vec<Point>,
}

/// One bar of a bar chart.
pub struct Bar {
    /// Row label, left of the bar.
    pub label: String,
    /// Bar colour.
    pub color: RGBColor,
    /// The value and the line it came from.
    pub point: Point,
}

/// Texts of a chart.
pub struct Labels<'a> {
    /// Title above the plot.
    pub title: &'a str,
    /// X axis description, with its unit.
    pub x: &'a str,
    /// Y axis description, with its unit (unused by bar charts).
    pub y: &'a str,
}

/// A log-log chart of values against N.
pub fn line_chart(area: &Area, labels: &Labels, series: &[Series]) -> DrawResult {
    let points = || series.iter().flat_map(|s| &s.points);
    let x_range = log_range(points().map(|p| p.n as f64), 1.5);
    let mut y_range = log_range(points().map(|p| p.value), 1.6);
    // Room above the data for the legend (upper left): a share of the axis that grows with
    // the number of entries.
    let entries = series.len() + 1;
    let share = (0.05 * entries as f64).min(0.4);
    y_range.end *= (y_range.end / y_range.start).powf(share / (1.0 - share));
    let mut chart = ChartBuilder::on(area)
        .caption(labels.title, (FONT, TITLE))
        .margin(12)
        .margin_right(30)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(
            x_range.clone().log_scale().with_key_points(ticks(&x_range)),
            y_range.clone().log_scale().with_key_points(ticks(&y_range)),
        )?;
    chart
        .configure_mesh()
        .x_desc(labels.x)
        .y_desc(labels.y)
        .x_label_formatter(&|v| compact(*v))
        .y_label_formatter(&|v| plain(*v))
        .label_style((FONT, TEXT))
        .axis_desc_style((FONT, DESC))
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    for s in series {
        let color = s.color;
        let xy = |p: &Point| (p.n as f64, p.value);
        chart
            .draw_series(LineSeries::new(
                s.points.iter().map(xy),
                color.stroke_width(2),
            ))?
            .label(&s.label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 22, y)], color.stroke_width(2)));
        chart.draw_series(
            s.points
                .iter()
                .map(|p| Circle::new(xy(p), 5, color.filled())),
        )?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FONT, TEXT))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()?;
    Ok(())
}

/// Horizontal bars on a log scale, first bar on top, each labelled with its value and `unit`.
pub fn bar_chart(area: &Area, labels: &Labels, unit: &str, bars: &[Bar]) -> DrawResult {
    if bars.is_empty() {
        return Ok(());
    }
    let rows = bars.len() as i32;
    let mut x_range = log_range(bars.iter().map(|b| b.point.value), 2.0);
    // A fifth of the width right of the longest bar, for its value label.
    x_range.end *= (x_range.end / x_range.start).powf(0.25);
    // About 7 pixels a character at the label font size.
    let longest = bars
        .iter()
        .map(|b| b.label.chars().count())
        .max()
        .unwrap_or(0);
    let label_width = 24 + 7 * longest as u32;
    let mut chart = ChartBuilder::on(area)
        .caption(labels.title, (FONT, TITLE))
        .margin(12)
        .margin_right(30)
        .x_label_area_size(50)
        .y_label_area_size(label_width)
        .build_cartesian_2d(
            x_range.clone().log_scale().with_key_points(ticks(&x_range)),
            // A discrete i32 range includes its end: rows 0..=rows-1.
            (0..rows - 1).into_segmented(),
        )?;
    let row_label = |v: &SegmentValue<i32>| match v {
        SegmentValue::CenterOf(i) if (0..rows).contains(i) => {
            bars[(rows - 1 - i) as usize].label.clone()
        }
        _ => String::new(),
    };
    chart
        .configure_mesh()
        .x_desc(labels.x)
        .x_label_formatter(&|v| plain(*v))
        .y_labels(bars.len())
        .y_label_formatter(&row_label)
        .disable_y_mesh()
        .label_style((FONT, TEXT))
        .axis_desc_style((FONT, DESC))
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    let value_style =
        TextStyle::from((FONT, TEXT).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    for (i, bar) in bars.iter().enumerate() {
        let row = rows - 1 - i as i32;
        let mut rect = Rectangle::new(
            [
                (x_range.start, SegmentValue::Exact(row)),
                (bar.point.value, SegmentValue::Exact(row + 1)),
            ],
            bar.color.filled(),
        );
        rect.set_margin(5, 5, 0, 0);
        chart.draw_series([rect])?;
        chart.draw_series([Text::new(
            format!("{} {unit}", plain(bar.point.value)),
            (bar.point.value * 1.1, SegmentValue::CenterOf(row)),
            value_style.clone(),
        )])?;
    }
    Ok(())
}

/// A grey note along the bottom of `area`.
pub fn footnote(area: &Area, text: &str) -> DrawResult {
    let style = TextStyle::from((FONT, 15).into_font()).color(&RGBColor(80, 80, 80));
    area.draw(&Text::new(text, (14, 6), style))?;
    Ok(())
}

/// A log axis range around `values`, widened by `pad` on each side (a factor).
fn log_range(values: impl Iterator<Item = f64>, pad: f64) -> Range<f64> {
    let (lo, hi) = values
        .filter(|v| *v > 0.0)
        .fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo > hi {
        return 1.0..10.0; // nothing positive to show
    }
    lo / pad..hi * pad
}

/// Axis ticks at 1, 2 and 5 times the powers of ten in `range`; at the powers of ten alone
/// over more than four decades.
fn ticks(range: &Range<f64>) -> Vec<f64> {
    let steps: &[f64] = if range.end / range.start > 1e4 {
        &[1.0]
    } else {
        &[1.0, 2.0, 5.0]
    };
    let mut out = Vec::new();
    let mut decade = 10f64.powf(range.start.log10().floor());
    while decade <= range.end {
        out.extend(
            steps
                .iter()
                .map(|s| s * decade)
                .filter(|t| range.contains(t)),
        );
        decade *= 10.0;
    }
    out
}

/// 2,500 as "2.5k", 1,000,000 as "1M": for numbers of objects.
pub fn compact(v: f64) -> String {
    match v {
        v if v >= 1e6 => format!("{}M", plain(v / 1e6)),
        v if v >= 1e3 => format!("{}k", plain(v / 1e3)),
        v => plain(v),
    }
}

/// Three significant digits at most, with thousands separators: "7,040", "45.8", "0.96".
pub fn plain(v: f64) -> String {
    let decimals = match v.abs() {
        a if a >= 100.0 => 0,
        a if a >= 10.0 => 1,
        a if a >= 1.0 => 2,
        _ => 3,
    };
    let s = format!("{v:.decimals$}");
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    };
    let (int, frac) = s
        .split_once('.')
        .map_or((s.as_str(), None), |(i, f)| (i, Some(f)));
    let (sign, digits) = int.strip_prefix('-').map_or(("", int), |d| ("-", d));
    let mut grouped = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(c);
    }
    match frac {
        Some(f) => format!("{sign}{grouped}.{f}"),
        None => format!("{sign}{grouped}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_well() {
        assert_eq!(plain(7040.6), "7,041");
        assert_eq!(plain(14054.3), "14,054");
        assert_eq!(plain(45.83), "45.8");
        assert_eq!(plain(50.0), "50");
        assert_eq!(plain(0.96), "0.96");
        assert_eq!(plain(1.304), "1.3");
        assert_eq!(plain(-1234.0), "-1,234");
        assert_eq!(compact(10_000.0), "10k");
        assert_eq!(compact(1_000_000.0), "1M");
        assert_eq!(compact(2_500.0), "2.5k");
    }

    #[test]
    fn ticks_follow_the_range() {
        assert_eq!(ticks(&(7.0..120.0)), [10.0, 20.0, 50.0, 100.0]);
        assert_eq!(ticks(&(0.3..20000.0)), [1.0, 10.0, 100.0, 1000.0, 10000.0]);
    }
}
