//! One side of `scripts/compare-graphile`: outbox-rs on PostgreSQL as a
//! job queue's worker and producer processes, so that it can be measured
//! the way graphile-worker is, in processes of their own, in the same run.
//!
//! ```text
//! pg_worker fill    URL SCHEMA N
//! pg_worker drain   URL SCHEMA WORKER BATCH CONCURRENCY KEEP_PROCESSED
//! pg_worker listen  URL SCHEMA WORKER BATCH CONCURRENCY KEEP_PROCESSED OUT
//! pg_worker produce URL SCHEMA RATE N WRITERS OUT
//! ```
//!
//! * `fill` migrates the outbox in `SCHEMA` and enqueues `N` no-op domain
//!   messages (transactions of 1,000).
//! * `drain` runs one relay until nothing is left to claim and prints
//!   `handled=H first_us=F last_us=L`: how many its handler ran and the wall
//!   clock (µs since the Unix epoch) of the first and the last.
//! * `listen` runs a relay (woken by `LISTEN`/`NOTIFY`, polling every 2 s)
//!   until its standard input closes, then writes one line `SEQ US` per
//!   message handled to `OUT` (the payload is the producer's sequence
//!   number). It prints `ready` once its relay runs.
//! * `produce` is the application: an open loop of `N` transactions at
//!   `RATE` a second, each started at its scheduled time on a pool of
//!   `WRITERS` connections (at most that many open at once), each one
//!   message in its own transaction. It writes `SEQ US` per commit, the wall
//!   clock when `COMMIT` returned, to `OUT`.
//!
//! Run with `cargo run --release --example pg_worker -- …`; the script
//! drives it.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use outbox::{Handlers, Message, MessageKind, NewMessage, Relay};
use outbox_postgres::PgStore;
use outbox_postgres::sqlx::postgres::PgPoolOptions;

type Failure = Box<dyn std::error::Error + Send + Sync>;

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

fn noop(seq: u64) -> NewMessage {
    NewMessage::new(MessageKind::Domain, "Noop", seq.to_string().into_bytes())
}

/// The positional argument `i`, parsed, or an error naming it.
fn arg<T: std::str::FromStr>(args: &[String], i: usize, name: &str) -> Result<T, Failure> {
    let raw = args
        .get(i)
        .ok_or_else(|| format!("missing argument {name} (see the example's docs)"))?;
    raw.parse()
        .map_err(|_| format!("argument {name}: `{raw}` is not valid").into())
}

/// The positional argument `i` as text, or an error naming it.
fn text<'a>(args: &'a [String], i: usize, name: &str) -> Result<&'a str, Failure> {
    args.get(i)
        .map(String::as_str)
        .ok_or_else(|| format!("missing argument {name} (see the example's docs)").into())
}

async fn store(url: &str, schema: &str, keep_processed: bool) -> Result<PgStore, Failure> {
    Ok(PgStore::builder(url)
        .schema(schema)
        .max_connections(4)
        .keep_processed(keep_processed)
        .connect()
        .await?)
}

/// A relay whose one handler records when it ran for each sequence number.
fn relay(
    store: PgStore,
    worker: &str,
    batch: usize,
    concurrency: usize,
    seen: Seen,
) -> Result<Relay, Failure> {
    let handlers = Handlers::new().on_message("Noop", move |m: &Message| {
        let at = now_us();
        let seq = std::str::from_utf8(&m.payload)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(u64::MAX);
        seen.lock().unwrap().push((seq, at));
        async { Ok::<_, std::io::Error>(()) }
    });
    Ok(Relay::builder(store)
        .dispatcher(handlers)
        .worker_id(worker.to_owned())
        .batch_size(batch)
        .concurrency(concurrency)
        .build()?)
}

async fn fill(url: &str, schema: &str, n: u64) -> Result<(), Failure> {
    let store = store(url, schema, true).await?;
    store.migrate().await?;
    let outbox = store.outbox();
    for start in (0..n).step_by(1000) {
        let mut tx = store.pool().begin().await?;
        outbox
            .enqueue_many(&mut tx, (start..(start + 1000).min(n)).map(noop).collect())
            .await?;
        tx.commit().await?;
    }
    Ok(())
}

/// What its handler saw: (sequence number, µs since the epoch) per message.
type Seen = Arc<Mutex<Vec<(u64, u64)>>>;

/// The relay `drain` and `listen` run, from their arguments `URL SCHEMA
/// WORKER BATCH CONCURRENCY KEEP_PROCESSED`.
async fn relay_from(args: &[String]) -> Result<(Relay, Seen), Failure> {
    let (url, schema) = (text(args, 2, "URL")?, text(args, 3, "SCHEMA")?);
    let store = store(url, schema, arg(args, 7, "KEEP_PROCESSED")?).await?;
    let seen = Seen::default();
    let relay = relay(
        store,
        text(args, 4, "WORKER")?,
        arg(args, 5, "BATCH")?,
        arg(args, 6, "CONCURRENCY")?,
        seen.clone(),
    )?;
    Ok((relay, seen))
}

async fn drain(args: &[String]) -> Result<(), Failure> {
    let (relay, seen) = relay_from(args).await?;
    relay.drain().await?;
    let seen = seen.lock().unwrap();
    let first = seen.iter().map(|s| s.1).min().unwrap_or(0);
    let last = seen.iter().map(|s| s.1).max().unwrap_or(0);
    println!("handled={} first_us={first} last_us={last}", seen.len());
    Ok(())
}

fn write_pairs(path: &str, pairs: &[(u64, u64)]) -> Result<(), Failure> {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    for (seq, us) in pairs {
        writeln!(out, "{seq} {us}")?;
    }
    out.flush()?;
    Ok(())
}

async fn listen(args: &[String]) -> Result<(), Failure> {
    let (relay, seen) = relay_from(args).await?;
    let handle = relay.spawn()?;
    println!("ready");
    // Until the driver closes our standard input.
    tokio::task::spawn_blocking(|| std::io::copy(&mut std::io::stdin(), &mut std::io::sink()))
        .await??;
    handle.shutdown().await;
    write_pairs(text(args, 8, "OUT")?, &seen.lock().unwrap())
}

async fn produce(args: &[String]) -> Result<(), Failure> {
    let (url, schema) = (text(args, 2, "URL")?, text(args, 3, "SCHEMA")?);
    let rate: f64 = arg(args, 4, "RATE")?;
    let n: u64 = arg(args, 5, "N")?;
    let writers: u32 = arg(args, 6, "WRITERS")?;
    let store = store(url, schema, true).await?;
    let outbox = store.outbox();
    let pool = PgPoolOptions::new()
        .max_connections(writers)
        .min_connections(writers)
        .connect(url)
        .await?;
    let commits = Arc::new(Mutex::new(Vec::with_capacity(n as usize)));
    let start = Instant::now() + Duration::from_millis(200);
    let mut tasks = Vec::new();
    for seq in 0..n {
        let at = start + Duration::from_secs_f64(seq as f64 / rate);
        tokio::time::sleep_until(at.into()).await;
        let (pool, outbox, commits) = (pool.clone(), outbox.clone(), commits.clone());
        tasks.push(tokio::spawn(async move {
            let mut tx = pool.begin().await?;
            outbox.enqueue(&mut tx, noop(seq)).await?;
            tx.commit().await?;
            commits.lock().unwrap().push((seq, now_us()));
            Ok::<_, Failure>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let out = text(args, 7, "OUT")?;
    write_pairs(out, &commits.lock().unwrap())
}

#[tokio::main]
async fn main() -> Result<(), Failure> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("fill") => {
            let (url, schema) = (text(&args, 2, "URL")?, text(&args, 3, "SCHEMA")?);
            fill(url, schema, arg(&args, 4, "N")?).await
        }
        Some("drain") => drain(&args).await,
        Some("listen") => listen(&args).await,
        Some("produce") => produce(&args).await,
        _ => Err("usage: pg_worker fill|drain|listen|produce … (see the example's docs)".into()),
    }
}
