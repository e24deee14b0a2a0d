//! What every figure shares: the figure record, the table, the JSON file.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use hdrhistogram::Histogram;
use outbox::{Handlers, Message, MessageId, NewMessage, Outcome, Relay, RelayBuilder, Transport};

/// One measured figure, possibly beside a baseline from the same run.
pub struct Figure {
    pub name: String,
    pub value: f64,
    pub unit: &'static str,
    pub baseline: Option<(String, f64)>,
    pub target: &'static str,
}

impl Figure {
    pub fn new(
        name: impl Into<String>,
        value: f64,
        unit: &'static str,
        target: &'static str,
    ) -> Self {
        Figure {
            name: name.into(),
            value,
            unit,
            baseline: None,
            target,
        }
    }

    pub fn beside(mut self, baseline: impl Into<String>, value: f64) -> Self {
        self.baseline = Some((baseline.into(), value));
        self
    }

    pub fn ratio(&self) -> Option<f64> {
        self.baseline.as_ref().map(|(_, b)| self.value / b)
    }
}

/// A figure that could not be measured, said so in the table.
pub fn not_measured(name: &str, why: &str) -> Figure {
    Figure::new(format!("{name} — NOT MEASURED: {why}"), f64::NAN, "", "")
}

pub fn quick() -> bool {
    std::env::var("OUTBOX_BENCH_QUICK").is_ok_and(|v| v != "0" && !v.is_empty())
}

/// p50 and p99 rows (µs histogram → ms).
pub fn latency_rows(
    name: &str,
    hist: &Histogram<u64>,
    p50: &'static str,
    p99: &'static str,
) -> Vec<Figure> {
    vec![
        Figure::new(
            format!("{name}, p50"),
            hist.value_at_quantile(0.5) as f64 / 1000.0,
            "ms",
            p50,
        ),
        Figure::new(
            format!("{name}, p99"),
            hist.value_at_quantile(0.99) as f64 / 1000.0,
            "ms",
            p99,
        ),
        Figure::new(
            format!("{name}, max"),
            hist.max() as f64 / 1000.0,
            "ms",
            "—",
        ),
    ]
}

pub fn histogram() -> Histogram<u64> {
    Histogram::<u64>::new(3).expect("histogram")
}

/// Handlers for `Bench` messages that only count.
pub fn counting_handlers(count: Arc<AtomicU64>) -> Handlers {
    Handlers::new().on_message("Bench", move |_m: &Message| {
        count.fetch_add(1, Ordering::Relaxed);
        async { Ok::<_, std::io::Error>(()) }
    })
}

fn json_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

fn json_number(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.4}")
    } else {
        "null".into()
    }
}

pub fn write_summary(figures: &[Figure]) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/outbox-bench");
    std::fs::create_dir_all(&dir).expect("bench output dir");
    let rows: Vec<String> = figures
        .iter()
        .map(|f| {
            let (bname, bval) = match &f.baseline {
                Some((n, v)) => (format!("\"{}\"", json_escape(n)), json_number(*v)),
                None => ("null".into(), "null".into()),
            };
            format!(
                "  {{\"figure\": \"{}\", \"value\": {}, \"unit\": \"{}\", \"baseline\": {bname}, \"baseline_value\": {bval}, \"ratio\": {}, \"target\": \"{}\"}}",
                json_escape(&f.name),
                json_number(f.value),
                f.unit,
                f.ratio().map_or("null".into(), json_number),
                json_escape(f.target)
            )
        })
        .collect();
    let path = dir.join("summary.json");
    std::fs::write(&path, format!("[\n{}\n]\n", rows.join(",\n"))).expect("write summary");
    println!("\nwritten: {}", path.display());
}

fn show(v: f64, unit: &str) -> String {
    if !v.is_finite() {
        "—".into()
    } else if unit == "ms" || v < 10.0 {
        format!("{v:.3} {unit}")
    } else {
        format!("{v:.0} {unit}")
    }
}

pub fn print_table(figures: &[Figure]) {
    println!("\n| figure | value | baseline (same run) | ratio | target |");
    println!("|---|---|---|---|---|");
    for f in figures {
        let baseline = f.baseline.as_ref().map_or("—".to_owned(), |(n, v)| {
            format!("{n}: {}", show(*v, f.unit))
        });
        let ratio = f.ratio().map_or("—".to_owned(), |r| format!("{r:.2}"));
        println!(
            "| {} | {} | {baseline} | {ratio} | {} |",
            f.name,
            show(f.value, f.unit),
            f.target
        );
    }
}

/// Builds the relay, drains the backlog of `n` once (all must be
/// delivered) and returns messages per second.
pub async fn drain_rate(relay: RelayBuilder, n: usize) -> f64 {
    let relay = relay.build().unwrap();
    let start = std::time::Instant::now();
    let report = relay.drain().await.unwrap();
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(report.delivered as usize, n, "{report:?}");
    n as f64 / secs
}

/// The figure "drain `n` …, `store`, batch 100, Prometheus recorder
/// installed" beside the same drain without a recorder, measured by
/// [`metrics_on_off`] on a blocking thread of its own.
pub async fn metrics_figure<F, Fut>(store: &str, n: usize, rounds: usize, drain: F) -> Figure
where
    F: Fn() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = f64>,
{
    let (on, off) = tokio::task::spawn_blocking(move || metrics_on_off(n, rounds, drain))
        .await
        .unwrap();
    Figure::new(
        format!(
            "drain {n} to an in-process handler, {store}, batch 100, Prometheus recorder installed, median of {rounds}"
        ),
        on,
        "msg/s",
        "ratio ≥ 0.95",
    )
    .beside("the same drain without a recorder", off)
}

/// Runs `drain` (a drain of `n` messages returning msg/s) `rounds` times
/// with a Prometheus recorder installed and `rounds` times without, on a
/// current-thread runtime of the calling (blocking) thread — a local
/// recorder covers one thread. Each round runs both, in alternating order
/// so neither side always follows the other; between rounds the
/// exporter's upkeep runs, as an application runs it every few seconds,
/// outside the timed drains. Returns each side's median (on, off), after
/// checking that the recorder saw every delivery of the "on" runs.
fn metrics_on_off<F, Fut>(n: usize, rounds: usize, drain: F) -> (f64, f64)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = f64>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let run = |on: bool| {
        let once = || rt.block_on(drain());
        if on {
            metrics::with_local_recorder(&recorder, once)
        } else {
            once()
        }
    };
    // Warm both paths once.
    run(false);
    run(true);
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        handle.run_upkeep();
        if round % 2 == 0 {
            off.push(run(false));
            on.push(run(true));
        } else {
            on.push(run(true));
            off.push(run(false));
        }
    }
    // The "on" runs did record: the scrape counts every delivery.
    let scrape = handle.render();
    let line = scrape
        .lines()
        .find(|l| l.starts_with("outbox_messages_delivered{"))
        .unwrap_or_else(|| panic!("no delivered counter in the scrape:\n{scrape}"));
    assert!(line.ends_with(&format!(" {}", (rounds + 1) * n)), "{line}");
    (median(on), median(off))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Records when each message's confirm (acknowledgement) came back.
#[derive(Debug)]
struct Timed {
    inner: Arc<dyn Transport>,
    confirmed: Arc<Mutex<HashMap<MessageId, Instant>>>,
}

#[async_trait]
impl Transport for Timed {
    async fn send(&self, batch: &[Message]) -> Vec<Outcome> {
        let outcomes = self.inner.send(batch).await;
        let now = Instant::now();
        let mut map = self.confirmed.lock().unwrap();
        for (m, o) in batch.iter().zip(&outcomes) {
            if *o == Outcome::Delivered {
                map.insert(m.id, now);
            }
        }
        outcomes
    }
    async fn probe(&self) -> outbox::Result<()> {
        self.inner.probe().await
    }
}

/// Commit (SQLite) → broker confirm or acknowledgement through
/// `transport`, one message (`message(i)`) per transaction, `rate` msg/s.
pub async fn commit_to_ack_latency(
    transport: Arc<dyn Transport>,
    message: fn(usize) -> NewMessage,
    rate: u64,
    duration: Duration,
) -> hdrhistogram::Histogram<u64> {
    let dir = tempfile::tempdir().unwrap();
    let store = crate::sqlite::open(dir.path()).await;
    let confirmed: Arc<Mutex<HashMap<MessageId, Instant>>> = Default::default();
    let relay = Relay::builder(store.clone())
        .transport(Timed {
            inner: transport,
            confirmed: confirmed.clone(),
        })
        .batch_size(100)
        .spawn()
        .unwrap();
    relay.until_idle().await.unwrap();
    let total = (rate as f64 * duration.as_secs_f64()) as usize;
    let path = store.path().to_owned();
    let outbox = store.outbox();
    let commits = tokio::task::spawn_blocking(move || {
        let mut conn = crate::sqlite::app_connection(&path);
        let mut commits = Vec::with_capacity(total);
        let gap = Duration::from_secs_f64(1.0 / rate as f64);
        let mut next = Instant::now();
        for i in 0..total {
            let tx = conn
                .transaction_with_behavior(outbox_sqlite::rusqlite::TransactionBehavior::Immediate)
                .unwrap();
            let id = outbox.enqueue_rusqlite(&tx, message(i)).unwrap();
            let at = Instant::now();
            tx.commit().unwrap();
            commits.push((id, at));
            next += gap;
            if let Some(w) = next.checked_duration_since(Instant::now()) {
                std::thread::sleep(w);
            }
        }
        commits
    })
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while confirmed.lock().unwrap().len() < total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    relay.shutdown().await;
    let confirmed = confirmed.lock().unwrap();
    let mut hist = histogram();
    for (id, at) in commits {
        if let Some(c) = confirmed.get(&id) {
            hist.record(c.duration_since(at).as_micros() as u64)
                .unwrap();
        }
    }
    assert_eq!(hist.len() as usize, total, "every message confirmed");
    hist
}
