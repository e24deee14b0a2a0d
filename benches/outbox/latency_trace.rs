//! `OUTBOX_BENCH_TRACE=1`: what each open-loop run did, message by message,
//! and what the WAL did meanwhile, for finding where a latency tail comes
//! from (`docs/latency.md`). Each run writes `target/outbox-bench/<run>.csv`
//! (per message: scheduled, began, committing, committed, handled; µs
//! since the run's start, 0 for never) and `<run>-wal.csv` (each change of
//! the WAL's counters), and prints a summary line.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub fn enabled() -> bool {
    std::env::var("OUTBOX_BENCH_TRACE").is_ok_and(|v| v != "0" && !v.is_empty())
}

/// The WAL's counters at one moment: pages in the WAL (`mxFrame`) and pages
/// already copied into the database (`nBackfill`).
#[derive(Debug, Clone, Copy)]
pub struct WalSample {
    at: u64,
    pages: u32,
    copied: u32,
}

/// Reads the WAL's counters from the wal-index (`-shm`) header every
/// 200 µs, keeping each change. A rise of `nBackfill` is a checkpoint at
/// work; a fall of `mxFrame` a WAL restart (after a complete checkpoint).
pub struct WalSampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<WalSample>>,
}

impl WalSampler {
    pub fn start(db: &Path, base: Instant) -> Self {
        let shm = PathBuf::from(format!("{}-shm", db.display()));
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            use std::io::Read;
            let mut out: Vec<WalSample> = Vec::new();
            let mut buf = [0u8; 100];
            while !s.load(Ordering::Acquire) {
                let read = std::fs::File::open(&shm).and_then(|mut f| f.read_exact(&mut buf));
                if read.is_ok() {
                    let word = |at: usize| u32::from_ne_bytes(buf[at..at + 4].try_into().unwrap());
                    let (pages, copied) = (word(16), word(96));
                    if out
                        .last()
                        .is_none_or(|l| (l.pages, l.copied) != (pages, copied))
                    {
                        let at = base.elapsed().as_micros() as u64;
                        out.push(WalSample { at, pages, copied });
                    }
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            out
        });
        WalSampler { stop, thread }
    }

    pub fn stop(self) -> Vec<WalSample> {
        self.stop.store(true, Ordering::Release);
        self.thread.join().unwrap()
    }
}

/// One run's per-message times (µs since the run's start; 0: never).
pub struct Trace {
    pub scheduled: Vec<u64>,
    pub began: Vec<u64>,
    pub committing: Vec<u64>,
    pub committed: Vec<u64>,
    pub handled: Vec<u64>,
    pub wal: Vec<WalSample>,
}

impl Trace {
    /// Writes the two CSV files and prints the summary.
    pub fn write(&self, name: &str) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/outbox-bench");
        std::fs::create_dir_all(&dir).unwrap();
        let mut csv =
            String::from("i,scheduled_us,began_us,committing_us,committed_us,handled_us\n");
        for i in 0..self.scheduled.len() {
            csv += &format!(
                "{i},{},{},{},{},{}\n",
                self.scheduled[i],
                self.began[i],
                self.committing[i],
                self.committed[i],
                self.handled[i]
            );
        }
        std::fs::write(dir.join(format!("{name}.csv")), csv).unwrap();
        let mut csv = String::from("at_us,wal_pages,copied_pages\n");
        for w in &self.wal {
            csv += &format!("{},{},{}\n", w.at, w.pages, w.copied);
        }
        std::fs::write(dir.join(format!("{name}-wal.csv")), csv).unwrap();
        eprintln!("{name}: {}", self.summary());
    }

    /// Moments the WAL showed checkpoint work: a rise of the copied pages
    /// or a restart.
    fn checkpoint_work(&self) -> (Vec<u64>, usize, usize) {
        let (mut at, mut steps, mut restarts) = (Vec::new(), 0, 0);
        for w in self.wal.windows(2) {
            let (a, b) = (w[0], w[1]);
            if b.copied > a.copied {
                steps += 1;
                at.push(b.at);
            }
            if b.pages < a.pages {
                restarts += 1;
                at.push(b.at);
            }
        }
        (at, steps, restarts)
    }

    fn summary(&self) -> String {
        let (work, steps, restarts) = self.checkpoint_work();
        // Checkpoint work seen between `from` and `to` (the sampler looks
        // every 200 µs, so a little after).
        let during = |from: u64, to: u64| work.iter().any(|&t| t >= from && t <= to + 500);
        let max_pages = self.wal.iter().map(|w| w.pages).max().unwrap_or(0);
        let n = self.scheduled.len();
        let (mut slow, mut slow_ckpt) = (0, 0);
        for i in 0..n {
            let (b, c) = (self.began[i], self.committed[i]);
            if c >= b + 1_000 {
                slow += 1;
                slow_ckpt += usize::from(during(b, c));
            }
        }
        let mut out = format!(
            "{n} msgs; WAL at most {max_pages} pages, {restarts} restarts, {steps} checkpoint steps; \
             producer commits ≥ 1 ms: {slow} ({slow_ckpt} with checkpoint work)"
        );
        if self.handled.iter().any(|&h| h > 0) {
            let (mut late, mut behind, mut relay, mut relay_ckpt) = (0, 0, 0, 0);
            for i in 0..n {
                let (s, c, h) = (self.scheduled[i], self.committed[i], self.handled[i]);
                if h < s + 2_000 {
                    continue;
                }
                late += 1;
                if c >= s + 2_000 {
                    behind += 1;
                } else {
                    relay += 1;
                    relay_ckpt += usize::from(during(c.saturating_sub(1_000), h));
                }
            }
            out += &format!(
                "; handled ≥ 2 ms after schedule: {late} ({behind} committed ≥ 2 ms late, \
                 {relay} after a timely commit, {relay_ckpt} of them with checkpoint work)"
            );
        }
        out
    }
}
