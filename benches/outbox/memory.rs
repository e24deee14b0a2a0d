//! Figures on the in-memory backend, and the original configuration.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox::memory::MemoryStore;
use outbox::{
    ClaimRequest, FailOutcome, Failure, Handlers, Message, MessageId, MessageKind, NewMessage,
    Relay, Release, Stats, Store, Timestamp,
};

use crate::common::{
    Figure, counting_handlers, drain_rate, histogram, latency_rows, metrics_figure,
};

/// Enqueues `n` messages made by `make` in one transaction.
pub fn fill_with(store: &MemoryStore, n: usize, make: impl Fn(usize) -> NewMessage) {
    let mut tx = store.begin();
    for i in 0..n {
        tx.enqueue(make(i)).unwrap();
    }
    tx.commit().unwrap();
}

fn fill(store: &MemoryStore, n: usize) {
    fill_with(store, n, |i| {
        NewMessage::new(MessageKind::Domain, "Bench", i.to_le_bytes().to_vec())
    });
}

async fn drain(n: usize, batch: usize) -> f64 {
    let store = MemoryStore::new();
    fill(&store, n);
    let relay = Relay::builder(store)
        .dispatcher(counting_handlers(Arc::new(AtomicU64::new(0))))
        .batch_size(batch);
    drain_rate(relay, n).await
}

/// The same claim + complete calls on the store, with no relay around them.
async fn drain_bare(n: usize, batch: usize) -> f64 {
    let store = MemoryStore::new();
    fill(&store, n);
    let start = Instant::now();
    let mut done = 0;
    loop {
        let now = Timestamp::now();
        let claimed = store
            .claim(&ClaimRequest::new(
                "bare",
                batch,
                Duration::from_secs(60),
                now,
            ))
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

async fn latency(samples: usize, gap: Duration) -> hdrhistogram::Histogram<u64> {
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
    let mut hist = histogram();
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
    async fn release_worker(&self, worker: &str) -> outbox::Result<u64> {
        self.0.release_worker(worker).await
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

/// The original configuration: 2 s poll, batch 20, one batch per round, no
/// wake on commit. Returns (throughput over a backlog, mean latency).
async fn original_configuration(backlog: usize, samples: usize) -> (f64, Duration) {
    let store = MemoryStore::new();
    let handled: Arc<Mutex<Vec<Instant>>> = Default::default();
    let h = handled.clone();
    let handlers = Handlers::new().on_message("Bench", move |_m: &Message| {
        h.lock().unwrap().push(Instant::now());
        async { Ok::<_, std::io::Error>(()) }
    });
    let relay = Relay::builder(PollOnly(store.clone()))
        .dispatcher(handlers)
        .batch_size(20)
        .poll_interval(Duration::from_secs(2))
        .build()
        .unwrap();
    // Each round occupies one poll interval: throughput = handled / (rounds × 2 s).
    fill(&store, backlog);
    let mut next = Instant::now();
    let mut rounds = 0u32;
    while handled.lock().unwrap().len() < backlog {
        tokio::time::sleep_until(next.into()).await;
        relay.run_batch().await.unwrap();
        rounds += 1;
        next += Duration::from_secs(2);
    }
    let throughput = backlog as f64 / (f64::from(rounds) * 2.0);
    // Latency: single messages committed at random points between polls.
    let mut total = Duration::ZERO;
    for i in 0..samples {
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..2000))).await;
        fill(&store, 1);
        let committed = Instant::now();
        while Instant::now() >= next {
            next += Duration::from_secs(2);
        }
        tokio::time::sleep_until(next.into()).await;
        relay.run_batch().await.unwrap();
        let at = handled.lock().unwrap()[backlog + i];
        total += at.duration_since(committed);
    }
    (throughput, total / samples as u32)
}

/// Whether message `i` of the slow-handler figures is slow: 1 in 100, at
/// most one per key (key `i % 1000`, position `i / 1000` in its key), so
/// no key chains two slow handlers and the slot time is the only bound.
fn is_slow(i: usize) -> bool {
    (i % 1000 + 37 * (i / 1000)) % 100 == 0
}

fn slow_handlers(
    slow: Duration,
    done: Option<tokio::sync::mpsc::UnboundedSender<(usize, Instant)>>,
) -> Handlers {
    Handlers::new().on_message("Bench", move |m: &Message| {
        let i = usize::from_le_bytes(m.payload[..8].try_into().unwrap());
        let done = done.clone();
        async move {
            if is_slow(i) {
                tokio::time::sleep(slow).await;
            }
            if let Some(done) = done {
                let _ = done.send((i, Instant::now()));
            }
            Ok::<_, std::io::Error>(())
        }
    })
}

fn keyed(i: usize) -> NewMessage {
    NewMessage::new(MessageKind::Domain, "Bench", i.to_le_bytes().to_vec())
        .key(format!("key-{}", i % 1000))
}

/// Drains `n` keyed messages of which 1 in 100 sleeps `slow` (async);
/// returns msg/s and two bounds in msg/s: the slot-time bound (the slow
/// handlers alone occupy `slow_count × slow / concurrency` of the slots)
/// and the least makespan of that many equal-length handlers on
/// `concurrency` slots (`⌈slow_count / concurrency⌉ × slow`), which no
/// scheduler can beat.
async fn drain_with_slow(n: usize, batch: usize, concurrency: usize) -> (f64, f64, f64) {
    let slow = Duration::from_millis(100);
    let store = MemoryStore::new();
    fill_with(&store, n, keyed);
    let relay = Relay::builder(store)
        .dispatcher(slow_handlers(slow, None))
        .batch_size(batch)
        .concurrency(concurrency);
    let rate = drain_rate(relay, n).await;
    let slow_count = (0..n).filter(|&i| is_slow(i)).count();
    let bound_secs = slow_count as f64 * slow.as_secs_f64() / concurrency as f64;
    let packed_secs = slow_count.div_ceil(concurrency) as f64 * slow.as_secs_f64();
    (rate, n as f64 / bound_secs, n as f64 / packed_secs)
}

/// Commit → handled of the fast messages while 1 in 100 handlers sleeps
/// 100 ms, at `rate` msg/s offered on a fixed schedule (open loop).
async fn latency_with_slow(rate: u64, secs: u64) -> hdrhistogram::Histogram<u64> {
    let store = MemoryStore::new();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let relay = Relay::builder(store.clone())
        .dispatcher(slow_handlers(Duration::from_millis(100), Some(tx)))
        .spawn()
        .unwrap();
    relay.until_idle().await.unwrap();
    let n = (rate * secs) as usize;
    let gap = Duration::from_nanos(1_000_000_000 / rate);
    let start = Instant::now();
    let mut scheduled = Vec::with_capacity(n);
    for i in 0..n {
        let at = start + gap * i as u32;
        tokio::time::sleep_until(at.into()).await;
        fill_with(&store, 1, |_| keyed(i));
        scheduled.push(at);
    }
    let mut hist = histogram();
    let mut seen = 0;
    while seen < n {
        let (i, at) = rx.recv().await.unwrap();
        seen += 1;
        if !is_slow(i) {
            hist.record(at.duration_since(scheduled[i]).as_micros() as u64)
                .unwrap();
        }
    }
    relay.shutdown().await;
    hist
}

pub async fn figures(quick: bool) -> Vec<Figure> {
    let n = if quick { 10_000 } else { 100_000 };
    let mut out = Vec::new();
    for batch in [20, 100, 500] {
        let bare = drain_bare(n, batch).await;
        let relay = drain(n, batch).await;
        out.push(
            Figure::new(
                format!("drain {n} to an in-process handler, memory, batch {batch}"),
                relay,
                "msg/s",
                "≥ 100k msg/s",
            )
            .beside("bare claim+complete loop, memory store", bare),
        );
    }
    let slow_n = if quick { 5_000 } else { 20_000 };
    for batch in [20, 64] {
        let (relay, bound, packed) = drain_with_slow(slow_n, batch, 64).await;
        out.push(
            Figure::new(
                format!("drain {slow_n} keyed, 1 % slow handlers (100 ms), memory, batch {batch}, concurrency 64"),
                relay,
                "msg/s",
                "≥ 0.8 of the bound",
            )
            .beside("slot-time bound: slow × 100 ms / concurrency", bound),
        );
        out.push(
            Figure::new(
                format!("… the same drain (batch {batch})"),
                relay,
                "msg/s",
                "—",
            )
            .beside("least makespan: ⌈slow / concurrency⌉ × 100 ms", packed),
        );
    }
    let hist = latency_with_slow(1000, if quick { 1 } else { 5 }).await;
    out.extend(latency_rows(
        "commit → handled of the fast messages, 1 % slow handlers (100 ms), 1k msg/s open loop, memory",
        &hist,
        "—",
        "—",
    ));
    let hist = latency(if quick { 300 } else { 3000 }, Duration::from_micros(500)).await;
    out.extend(latency_rows(
        "commit → handled, memory, closed loop (one message at a time, 0.5 ms apart)",
        &hist,
        "≤ 0.5 ms",
        "≤ 2 ms",
    ));
    let (thr, lat) =
        original_configuration(if quick { 40 } else { 100 }, if quick { 3 } else { 10 }).await;
    out.push(Figure::new(
        "original configuration (2 s poll, batch 20): throughput",
        thr,
        "msg/s",
        "reference ≈ 10 msg/s",
    ));
    out.push(Figure::new(
        "original configuration (2 s poll, batch 20): mean latency",
        lat.as_secs_f64() * 1000.0,
        "ms",
        "reference ~1 s",
    ));
    out
}

/// Drain throughput with a Prometheus recorder installed beside the same
/// drain without one (group `memory-metrics`): the relay's own cost with
/// no database to hide it, the worst case for the recorder.
pub async fn metrics_figures(quick: bool) -> Vec<Figure> {
    let (n, rounds) = if quick { (10_000, 3) } else { (100_000, 15) };
    vec![metrics_figure("memory", n, rounds, move || drain(n, 100)).await]
}
