//! `cargo bench --bench relay`: the figures of DESIGN §9, each beside a
//! baseline measured in the same run where one applies. Prints a table and
//! writes `target/outbox-bench/summary.json`. `OUTBOX_BENCH_QUICK=1` runs a
//! smoke version (CI runs it so the benches never rot).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use hdrhistogram::Histogram;
use outbox::memory::MemoryStore;
use outbox::{
    ClaimRequest, FailOutcome, Failure, Handlers, Message, MessageId, MessageKind, NewMessage,
    Relay, Release, Stats, Store, Timestamp,
};

struct Figure {
    name: String,
    value: f64,
    unit: &'static str,
    baseline: Option<(String, f64)>,
    target: &'static str,
}

impl Figure {
    fn ratio(&self) -> Option<f64> {
        self.baseline.as_ref().map(|(_, b)| self.value / b)
    }
}

fn quick() -> bool {
    std::env::var("OUTBOX_BENCH_QUICK").is_ok_and(|v| v != "0" && !v.is_empty())
}

fn noop_handlers(count: Arc<std::sync::atomic::AtomicU64>) -> Handlers {
    Handlers::new().on_message("Bench", move |_m: &Message| {
        count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        async { Ok::<_, std::io::Error>(()) }
    })
}

fn fill_memory(store: &MemoryStore, n: usize) {
    let mut tx = store.begin();
    for i in 0..n {
        tx.enqueue(NewMessage::new(
            MessageKind::Domain,
            "Bench",
            i.to_le_bytes().to_vec(),
        ))
        .unwrap();
    }
    tx.commit().unwrap();
}

/// Drain throughput of the relay over the memory store.
async fn drain_memory(n: usize, batch: usize) -> f64 {
    let store = MemoryStore::new();
    fill_memory(&store, n);
    let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let relay = Relay::builder(store.clone())
        .dispatcher(noop_handlers(count.clone()))
        .batch_size(batch)
        .build()
        .unwrap();
    let start = Instant::now();
    let report = relay.drain().await.unwrap();
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(report.delivered as usize, n);
    n as f64 / secs
}

/// Baseline for the memory drain: the same claim + complete calls on the
/// store, with no relay around them.
async fn drain_memory_bare(n: usize, batch: usize) -> f64 {
    let store = MemoryStore::new();
    fill_memory(&store, n);
    let start = Instant::now();
    let mut done = 0;
    loop {
        let now = Timestamp::now();
        let claimed = store
            .claim(&ClaimRequest {
                worker: "bare".into(),
                limit: batch,
                lease: Duration::from_secs(60),
                now,
                kind: None,
            })
            .await
            .unwrap();
        if claimed.is_empty() {
            break;
        }
        let ids: Vec<MessageId> = claimed.iter().map(|m| m.id).collect();
        store.complete(&ids, now).await.unwrap();
        done += ids.len();
    }
    assert_eq!(done, n);
    n as f64 / start.elapsed().as_secs_f64()
}

/// Commit → handled latency with a spawned relay, messages offered one at a
/// time with `gap` between them.
async fn latency_memory(samples: usize, gap: Duration) -> Histogram<u64> {
    let store = MemoryStore::new();
    let (tx_done, mut rx_done) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let handlers = Handlers::new().on_message("Bench", move |_m: &Message| {
        let _ = tx_done.send(Instant::now());
        async { Ok::<_, std::io::Error>(()) }
    });
    let relay = Relay::builder(store.clone())
        .dispatcher(handlers)
        .spawn()
        .unwrap();
    relay.until_idle().await.unwrap();
    let mut hist = Histogram::<u64>::new(3).unwrap();
    for i in 0..samples {
        let mut tx = store.begin();
        tx.enqueue(NewMessage::new(
            MessageKind::Domain,
            "Bench",
            i.to_le_bytes().to_vec(),
        ))
        .unwrap();
        let committed = Instant::now();
        tx.commit().unwrap();
        let handled = rx_done.recv().await.unwrap();
        hist.record(handled.duration_since(committed).as_micros() as u64)
            .unwrap();
        tokio::time::sleep(gap).await;
    }
    relay.shutdown().await;
    hist
}

/// A store that never wakes the relay: the original system's polling only.
#[derive(Debug)]
struct PollOnly(MemoryStore);

#[async_trait]
impl Store for PollOnly {
    async fn claim(&self, r: &ClaimRequest) -> outbox::Result<Vec<Message>> {
        self.0.claim(r).await
    }
    async fn complete(&self, ids: &[MessageId], now: Timestamp) -> outbox::Result<()> {
        self.0.complete(ids, now).await
    }
    async fn fail(&self, f: &Failure) -> outbox::Result<FailOutcome> {
        self.0.fail(f).await
    }
    async fn release(&self, r: &Release) -> outbox::Result<()> {
        self.0.release(r).await
    }
    async fn stats(&self) -> outbox::Result<Stats> {
        self.0.stats().await
    }
    async fn purge_processed(&self, before: Timestamp, limit: usize) -> outbox::Result<u64> {
        self.0.purge_processed(before, limit).await
    }
}

/// The original configuration: 2 s poll, batch 20, no wake on commit.
/// Returns (throughput over a backlog, mean latency of single messages).
async fn original_configuration(backlog: usize, samples: usize) -> (f64, Duration) {
    let store = MemoryStore::new();
    let handled: Arc<Mutex<Vec<Instant>>> = Default::default();
    let h = handled.clone();
    let handlers = Handlers::new().on_message("Bench", move |_m: &Message| {
        h.lock().unwrap().push(Instant::now());
        async { Ok::<_, std::io::Error>(()) }
    });
    // One round = one claim of 20: the original relay did not drain until empty.
    let relay = Relay::builder(PollOnly(store.clone()))
        .dispatcher(handlers)
        .batch_size(20)
        .poll_interval(Duration::from_secs(2))
        .build()
        .unwrap();
    // Throughput: rounds every 2 s, 20 messages each.
    fill_memory(&store, backlog);
    // Each round occupies one poll interval: throughput = handled / (rounds × 2 s).
    let mut next = Instant::now();
    let mut rounds = 0u32;
    while handled.lock().unwrap().len() < backlog {
        tokio::time::sleep_until(next.into()).await;
        relay.run_batch().await.unwrap();
        rounds += 1;
        next += Duration::from_secs(2);
    }
    let throughput = backlog as f64 / (rounds as f64 * 2.0);
    // Latency: single messages committed at random points between polls.
    let mut total = Duration::ZERO;
    for i in 0..samples {
        let offset = Duration::from_millis(fastrand::u64(0..2000));
        tokio::time::sleep(offset).await;
        fill_memory(&store, 1);
        let committed = Instant::now();
        let want = backlog + i + 1;
        tokio::time::sleep_until(next.into()).await;
        while tokio::time::Instant::now() >= next.into() {
            next += Duration::from_secs(2);
        }
        relay.run_batch().await.unwrap();
        let at = handled.lock().unwrap()[want - 1];
        total += at.duration_since(committed);
    }
    (throughput, total / samples as u32)
}

fn json_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

fn write_summary(figures: &[Figure]) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/outbox-bench");
    std::fs::create_dir_all(&dir).unwrap();
    let rows: Vec<String> = figures
        .iter()
        .map(|f| {
            let (bname, bval) = match &f.baseline {
                Some((n, v)) => (format!("\"{}\"", json_escape(n)), format!("{v:.3}")),
                None => ("null".into(), "null".into()),
            };
            let ratio = f.ratio().map_or("null".into(), |r| format!("{r:.3}"));
            format!(
                "  {{\"figure\": \"{}\", \"value\": {:.3}, \"unit\": \"{}\", \"baseline\": {}, \"baseline_value\": {}, \"ratio\": {}, \"target\": \"{}\"}}",
                json_escape(&f.name), f.value, f.unit, bname, bval, ratio, json_escape(f.target)
            )
        })
        .collect();
    let path = dir.join("summary.json");
    std::fs::write(&path, format!("[\n{}\n]\n", rows.join(",\n"))).unwrap();
    println!("\nwritten: {}", path.display());
}

fn print_table(figures: &[Figure]) {
    println!("\n| figure | value | baseline (same run) | ratio | target |");
    println!("|---|---|---|---|---|");
    for f in figures {
        let baseline = f
            .baseline
            .as_ref()
            .map_or("—".to_owned(), |(n, v)| format!("{n}: {v:.0} {}", f.unit));
        let ratio = f.ratio().map_or("—".to_owned(), |r| format!("{r:.2}"));
        let value = if f.unit == "ms" {
            format!("{:.3}", f.value)
        } else {
            format!("{:.0}", f.value)
        };
        println!(
            "| {} | {value} {} | {} | {} | {} |",
            f.name, f.unit, baseline, ratio, f.target
        );
    }
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument selects nothing here.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let quick = quick();
    let n = if quick { 10_000 } else { 100_000 };
    let mut figures = Vec::new();
    rt.block_on(async {
        for batch in [20, 100, 500] {
            let bare = drain_memory_bare(n, batch).await;
            let relay = drain_memory(n, batch).await;
            figures.push(Figure {
                name: format!("drain {n} to in-process handler, memory, batch {batch}"),
                value: relay,
                unit: "msg/s",
                baseline: Some(("bare claim+complete loop on the memory store".into(), bare)),
                target: "≥ 100k msg/s",
            });
        }
        let samples = if quick { 200 } else { 2000 };
        let hist = latency_memory(samples, Duration::from_micros(500)).await;
        for (label, q) in [("p50", 0.5), ("p99", 0.99)] {
            figures.push(Figure {
                name: format!("commit → handled, memory, light load, {label}"),
                value: hist.value_at_quantile(q) as f64 / 1000.0,
                unit: "ms",
                baseline: None,
                target: if q < 0.9 { "≤ 0.5 ms" } else { "≤ 2 ms" },
            });
        }
        let (thr, lat) =
            original_configuration(if quick { 40 } else { 100 }, if quick { 3 } else { 10 }).await;
        figures.push(Figure {
            name: "original configuration (2 s poll, batch 20): throughput".into(),
            value: thr,
            unit: "msg/s",
            baseline: None,
            target: "reference ≈ 10 msg/s",
        });
        figures.push(Figure {
            name: "original configuration (2 s poll, batch 20): mean latency".into(),
            value: lat.as_secs_f64() * 1000.0,
            unit: "ms",
            baseline: None,
            target: "reference ~1 s",
        });
    });
    print_table(&figures);
    write_summary(&figures);
}
