//! Charts drawn on the server as inline SVG (the console's pages allow no
//! scripts): an outbox's activity over the last hour
//! ([`outbox_api::activity`]) as line charts.

use maud::{Markup, html};
use outbox_api::activity::{Activity, LATENCY_BOUNDS_MS, latency_class};

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 190.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 12.0;
const TOP: f64 = 14.0;
const BOTTOM: f64 = 26.0;

/// One line of a chart: its name, colour, and a value per bucket (`None`:
/// no point there).
pub(crate) struct Series {
    pub(crate) name: &'static str,
    pub(crate) colour: &'static str,
    pub(crate) values: Vec<Option<f64>>,
}

/// How the vertical axis reads.
pub(crate) enum Axis {
    /// Counts from 0 to a round maximum.
    Count,
    /// Latency classes (values are class indexes), labelled by their
    /// upper bounds.
    Latency,
}

/// The largest value rounded up to 1, 2 or 5 times a power of ten (at
/// least 1).
fn round_up(max: f64) -> f64 {
    let mut step = 1.0;
    loop {
        for m in [1.0, 2.0, 5.0] {
            if max <= m * step {
                return m * step;
            }
        }
        step *= 10.0;
    }
}

/// A latency class's upper bound, short: `5 ms`, `2 s`, `5 min`, `> 5 min`.
pub(crate) fn class_label(class: usize) -> String {
    match LATENCY_BOUNDS_MS.get(class) {
        Some(&ms) if ms < 1_000 => format!("{ms} ms"),
        Some(&ms) if ms < 60_000 => format!("{} s", ms / 1_000),
        Some(&ms) => format!("{} min", ms / 60_000),
        None => format!("> {}", class_label(class - 1)),
    }
}

/// A line chart of `series` over `buckets` points, titled `title`; the
/// x axis is labelled with `first` and `last` (the window's ends).
pub(crate) fn line_chart(
    title: &str,
    axis: Axis,
    series: &[Series],
    buckets: usize,
    first: &str,
    last: &str,
) -> Markup {
    let (plot_w, plot_h) = (WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM);
    let top = match axis {
        Axis::Count => round_up(
            series
                .iter()
                .flat_map(|s| s.values.iter().flatten())
                .fold(0.0, |a: f64, &b| a.max(b)),
        ),
        Axis::Latency => LATENCY_BOUNDS_MS.len() as f64,
    };
    let x = |i: usize| LEFT + plot_w * i as f64 / (buckets.max(2) - 1) as f64;
    let y = |v: f64| TOP + plot_h * (1.0 - v / top);
    let ticks: Vec<(f64, String)> = match axis {
        Axis::Count => (0..=4)
            .map(|k| {
                let v = top * f64::from(k) / 4.0;
                (v, format!("{}", (v * 10.0).round() / 10.0))
            })
            .collect(),
        Axis::Latency => [0usize, 3, 6, 9, 12, 15]
            .iter()
            .map(|&c| (c as f64, class_label(c)))
            .collect(),
    };
    let summary: Vec<String> = series.iter().map(|s| s.name.to_owned()).collect();
    html! {
        figure.chart {
            figcaption { (title) }
            svg xmlns="http://www.w3.org/2000/svg" viewBox={ "0 0 " (WIDTH) " " (HEIGHT) }
                role="img" aria-label={ (title) ": " (summary.join(", ")) } {
                @for (v, label) in &ticks {
                    line x1=(LEFT) x2=(WIDTH - RIGHT) y1=(y(*v)) y2=(y(*v)) stroke="#e3e6eb" stroke-width="1" {}
                    text x=(LEFT - 6.0) y=(y(*v) + 4.0) text-anchor="end" font-size="11" fill="#5b6472" { (label) }
                }
                line x1=(LEFT) x2=(LEFT) y1=(TOP) y2=(TOP + plot_h) stroke="#8a93a3" stroke-width="1" {}
                text x=(LEFT) y=(HEIGHT - 8.0) font-size="11" fill="#5b6472" { (first) }
                text x=(WIDTH - RIGHT) y=(HEIGHT - 8.0) text-anchor="end" font-size="11" fill="#5b6472" { (last) }
                @for s in series {
                    @for run in runs(&s.values) {
                        @let points = run.iter().map(|&(i, v)| format!("{:.1},{:.1}", x(i), y(v))).collect::<Vec<_>>().join(" ");
                        @if run.len() == 1 {
                            circle cx=(x(run[0].0)) cy=(y(run[0].1)) r="2.5" fill=(s.colour) {}
                        } @else {
                            polyline points=(points) fill="none" stroke=(s.colour) stroke-width="2" {}
                        }
                    }
                }
            }
            p.legend {
                @for s in series {
                    span.key { svg width="12" height="12" { rect width="12" height="12" fill=(s.colour) {} } " " (s.name) }
                }
            }
        }
    }
}

/// The stretches of consecutive points that have a value.
fn runs(values: &[Option<f64>]) -> Vec<Vec<(usize, f64)>> {
    let mut out: Vec<Vec<(usize, f64)>> = Vec::new();
    let mut current = Vec::new();
    for (i, v) in values.iter().enumerate() {
        match v {
            Some(v) => current.push((i, *v)),
            None if !current.is_empty() => out.push(std::mem::take(&mut current)),
            None => {}
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// The three charts of an outbox's activity.
pub(crate) fn activity_charts(a: &Activity, first: &str, last: &str) -> Markup {
    let n = a.buckets.len();
    let count = |f: fn(&outbox_api::activity::ActivityBucket) -> u64| {
        a.buckets.iter().map(|b| Some(f(b) as f64)).collect()
    };
    let class_of = |q: f64| -> Vec<Option<f64>> {
        a.buckets
            .iter()
            .map(|b| {
                b.latency_quantile(q)
                    .map(|bound| latency_class(bound) as f64)
            })
            .collect()
    };
    html! {
        (line_chart("Messages per minute", Axis::Count, &[
            Series { name: "delivered", colour: "#1d4ed8", values: count(|b| b.delivered) },
            Series { name: "failed (last failed try)", colour: "#d97706", values: count(|b| b.failed) },
            Series { name: "poisoned", colour: "#b02a37", values: count(|b| b.poisoned) },
        ], n, first, last))
        (line_chart("Backlog (pending at the end of each minute)", Axis::Count, &[
            Series { name: "pending", colour: "#7c3aed", values: count(|b| b.backlog) },
        ], n, first, last))
        (line_chart("Commit → processed, per minute (upper bound of the class)", Axis::Latency, &[
            Series { name: "p50", colour: "#059669", values: class_of(0.5) },
            Series { name: "p99", colour: "#b02a37", values: class_of(0.99) },
        ], n, first, last))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_round_up_and_classes_read_as_times() {
        assert_eq!(round_up(0.0), 1.0);
        assert_eq!(round_up(3.0), 5.0);
        assert_eq!(round_up(170.0), 200.0);
        assert_eq!(class_label(0), "1 ms");
        assert_eq!(class_label(9), "1 s");
        assert_eq!(class_label(15), "5 min");
        assert_eq!(class_label(16), "> 5 min");
    }

    #[test]
    fn gaps_split_lines() {
        let r = runs(&[Some(1.0), None, Some(2.0), Some(3.0), None]);
        assert_eq!(r, vec![vec![(0, 1.0)], vec![(2, 2.0), (3, 3.0)]]);
    }

    #[test]
    fn a_chart_has_one_line_per_series_and_escapes_nothing_it_should_not() {
        let svg = line_chart(
            "t",
            Axis::Count,
            &[
                Series {
                    name: "a",
                    colour: "#000",
                    values: vec![Some(0.0), Some(4.0), Some(2.0)],
                },
                Series {
                    name: "b",
                    colour: "#111",
                    values: vec![None, Some(1.0), None],
                },
            ],
            3,
            "12:00",
            "13:00",
        )
        .into_string();
        assert_eq!(svg.matches("<polyline").count(), 1, "{svg}");
        assert_eq!(svg.matches("<circle").count(), 1, "{svg}");
        assert!(
            svg.contains(r#"points="64.0,164.0 386.0,44.0 708.0,104.0""#),
            "{svg}"
        );
    }
}
