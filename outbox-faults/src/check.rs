//! Enqueueing test messages, waiting on conditions, and checking what the
//! receiver recorded against what was enqueued.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use outbox_api::{MessageId, MessageKind, NewMessage};
use outbox_sqlite::SqliteOutbox;
use outbox_sqlite::rusqlite::{Connection, TransactionBehavior};

use crate::{MESSAGE_TYPE, open_connection};

/// One message the test enqueued (and committed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    /// Its id.
    pub id: MessageId,
    /// Its sequence number (also its payload); increasing in commit order
    /// among messages of one key.
    pub seq: i64,
    /// Its ordering key.
    pub key: Option<String>,
}

/// The test message with sequence number `seq` and optional `key`.
pub fn message(seq: i64, key: Option<&str>) -> NewMessage {
    let m = NewMessage::new(MessageKind::Domain, MESSAGE_TYPE, seq.to_string());
    match key {
        Some(k) => m.key(k),
        None => m,
    }
}

/// A seed from `OUTBOX_FAULTS_SEED`, or a fresh random one.
pub fn seed() -> u64 {
    std::env::var("OUTBOX_FAULTS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..))
}

/// Whether the soak sizes were asked for (`OUTBOX_SOAK=1`).
pub fn soak() -> bool {
    std::env::var("OUTBOX_SOAK").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Enqueues `count` messages with rusqlite in transactions of 1–8 messages
/// (sizes from `rng`); about one in three has a key out of `keys` keys
/// named `{key_prefix}{n}`. Sequence numbers start at `first_seq`.
pub fn enqueue_many(
    outbox: &SqliteOutbox,
    conn: &mut Connection,
    rng: &mut fastrand::Rng,
    first_seq: i64,
    count: usize,
    keys: usize,
    key_prefix: &str,
) -> Result<Vec<Expected>, String> {
    let mut out = Vec::with_capacity(count);
    let mut seq = first_seq;
    while out.len() < count {
        let n = rng.usize(1..=8).min(count - out.len());
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| format!("BEGIN IMMEDIATE: {e}"))?;
        let mut batch = Vec::with_capacity(n);
        for _ in 0..n {
            let key = (keys > 0 && rng.u8(..3) == 0)
                .then(|| format!("{key_prefix}{}", rng.usize(..keys)));
            let id = outbox
                .enqueue_rusqlite(&tx, message(seq, key.as_deref()))
                .map_err(|e| format!("enqueue_rusqlite: {e}"))?;
            batch.push(Expected { id, seq, key });
            seq += 1;
        }
        tx.commit().map_err(|e| format!("COMMIT: {e}"))?;
        out.extend(batch);
    }
    Ok(out)
}

/// Polls `condition` every 20 ms until it holds; panics naming `what` if it
/// still does not after `timeout`. Returns how long it took.
pub async fn wait_until(
    what: &str,
    timeout: Duration,
    mut condition: impl FnMut() -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        if condition() {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The outbox's pending count, read with a plain connection.
pub fn pending(conn: &Connection) -> u64 {
    conn.query_row(
        "SELECT COUNT(*) FROM outbox WHERE state = 'pending'",
        [],
        |r| r.get::<_, i64>(0),
    )
    .map(|n| n as u64)
    .unwrap_or(u64::MAX)
}

/// What the receiver recorded, compared with what was enqueued.
#[derive(Debug, Default)]
pub struct Report {
    /// Messages enqueued (and committed).
    pub messages: usize,
    /// Effect rows.
    pub effects: u64,
    /// Enqueued messages without an effect.
    pub missing: Vec<String>,
    /// Messages with more than one effect row.
    pub repeated: Vec<String>,
    /// Effects for ids that were never enqueued (or with the wrong payload).
    pub unknown: Vec<String>,
    /// The receiver's `duplicates` counter.
    pub duplicates: u64,
    /// Handler invocations that committed.
    pub calls: u64,
    /// Of those, the ones the inbox turned away.
    pub duplicate_calls: u64,
    /// Keys whose effects were not committed in increasing sequence order.
    pub order_violations: Vec<String>,
    /// Outbox rows not in state `processed`.
    pub not_processed: u64,
    /// Outbox rows with `attempts <> 0`.
    pub attempts_nonzero: u64,
    /// Effects per worker.
    pub per_worker: BTreeMap<String, u64>,
}

impl Report {
    /// Panics unless every enqueued message has exactly one effect, nothing
    /// else has one, per-key order held, and every outbox row is processed
    /// with no counted attempt.
    pub fn assert_exactly_once(&self, context: &str) {
        let few = |v: &Vec<String>| v.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
        assert!(
            self.missing.is_empty(),
            "{context}: {} message(s) never took effect, e.g. {}",
            self.missing.len(),
            few(&self.missing)
        );
        assert!(
            self.repeated.is_empty(),
            "{context}: {} message(s) took effect more than once, e.g. {}",
            self.repeated.len(),
            few(&self.repeated)
        );
        assert!(
            self.unknown.is_empty(),
            "{context}: {} effect(s) of messages never enqueued, e.g. {}",
            self.unknown.len(),
            few(&self.unknown)
        );
        assert_eq!(self.effects, self.messages as u64, "{context}: effect rows");
        assert!(
            self.order_violations.is_empty(),
            "{context}: per-key order broken: {}",
            few(&self.order_violations)
        );
        assert_eq!(
            self.not_processed, 0,
            "{context}: outbox rows not processed"
        );
        assert_eq!(
            self.attempts_nonzero, 0,
            "{context}: outbox rows with counted attempts"
        );
        assert_eq!(
            self.duplicates, self.duplicate_calls,
            "{context}: duplicates counter vs duplicate calls"
        );
        assert_eq!(
            self.calls,
            self.effects + self.duplicate_calls,
            "{context}: calls = first deliveries + duplicates"
        );
    }
}

/// The receiver's and the outbox's counts that [`Report::compare`] checks.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counts {
    /// Effect rows.
    pub effects: u64,
    /// The receiver's `duplicates` counter.
    pub duplicates: u64,
    /// Handler invocations that committed.
    pub calls: u64,
    /// Of those, the ones the inbox turned away.
    pub duplicate_calls: u64,
    /// Outbox rows not in state `processed`.
    pub not_processed: u64,
    /// Outbox rows with `attempts <> 0`.
    pub attempts_nonzero: u64,
}

/// One effect row: message id, key, sequence number, worker — read in the
/// order the effects were committed.
pub type EffectRow = (String, Option<String>, i64, String);

impl Report {
    /// Compares the effects (in commit order) and counts one backend's
    /// receiver recorded with what was enqueued.
    pub fn compare(
        expected: &[Expected],
        counts: Counts,
        effects: impl IntoIterator<Item = EffectRow>,
    ) -> Report {
        let mut report = Report {
            messages: expected.len(),
            effects: counts.effects,
            duplicates: counts.duplicates,
            calls: counts.calls,
            duplicate_calls: counts.duplicate_calls,
            not_processed: counts.not_processed,
            attempts_nonzero: counts.attempts_nonzero,
            ..Report::default()
        };
        let by_id: HashMap<String, &Expected> =
            expected.iter().map(|e| (e.id.to_string(), e)).collect();
        let mut seen: HashMap<String, u32> = HashMap::new();
        let mut last_seq: HashMap<String, i64> = HashMap::new();
        for (id, key, seq, worker) in effects {
            *report.per_worker.entry(worker).or_default() += 1;
            match by_id.get(&id) {
                Some(e) if e.seq == seq && e.key == key => {}
                _ => report.unknown.push(format!("{id} (seq {seq})")),
            }
            let n = seen.entry(id.clone()).or_default();
            *n += 1;
            if *n == 2 {
                report.repeated.push(id.clone());
            }
            if let Some(k) = key {
                if let Some(prev) = last_seq.insert(k.clone(), seq) {
                    if prev >= seq {
                        report
                            .order_violations
                            .push(format!("key {k}: seq {seq} took effect after seq {prev}"));
                    }
                }
            }
        }
        report.missing = expected
            .iter()
            .map(|e| e.id.to_string())
            .filter(|id| !seen.contains_key(id))
            .collect();
        report
    }
}

/// Compares the receiver's tables in `receiver_db` and the outbox in
/// `outbox_db` with `expected`.
pub fn verify(outbox_db: &Path, receiver_db: &Path, expected: &[Expected]) -> Report {
    let rx = open_connection(receiver_db).expect("open the receiver database");
    let ob = open_connection(outbox_db).expect("open the outbox database");
    let count = |c: &Connection, sql: &str| -> u64 {
        c.query_row(sql, [], |r| r.get::<_, i64>(0))
            .unwrap_or_else(|e| panic!("{sql}: {e}")) as u64
    };
    let counts = Counts {
        effects: count(&rx, "SELECT COUNT(*) FROM effects"),
        duplicates: count(
            &rx,
            "SELECT COALESCE((SELECT value FROM counters WHERE name = 'duplicates'), 0)",
        ),
        calls: count(&rx, "SELECT COUNT(*) FROM calls"),
        duplicate_calls: count(&rx, "SELECT COUNT(*) FROM calls WHERE duplicate <> 0"),
        not_processed: count(
            &ob,
            "SELECT COUNT(*) FROM outbox WHERE state <> 'processed'",
        ),
        attempts_nonzero: count(&ob, "SELECT COUNT(*) FROM outbox WHERE attempts <> 0"),
    };
    let mut stmt = rx
        .prepare("SELECT message_id, key, seq, worker FROM effects ORDER BY rowid")
        .unwrap();
    let rows: Vec<EffectRow> = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .unwrap()
        .map(|r| r.unwrap())
        .collect();
    Report::compare(expected, counts, rows)
}

/// The problem lines in a child's log: store errors, handler errors, and
/// anything the relay logged at WARN or ERROR.
pub fn log_problems(log: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter(|l| {
            l.contains("STORE_ERROR")
                || l.contains("HANDLER_ERROR")
                || l.contains(" ERROR ")
                || l.contains(" WARN ")
                || l.contains("panicked")
        })
        .map(str::to_owned)
        .collect()
}

/// The problem lines in a child's log ([`log_problems`]) that no line of
/// `outages` explains (what a relay logs while its database is out of
/// reach); a panic is a problem whatever it says.
pub fn log_problems_beyond(log: &Path, outages: &[&str]) -> Vec<String> {
    log_problems(log)
        .into_iter()
        .filter(|l| !outages.iter().any(|p| l.contains(p)) || l.contains("panicked"))
        .collect()
}

/// The last `n` lines of a child's log, for failure messages (the log lives
/// in the test's temporary directory, which is gone after a failure).
pub fn log_tail(log: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
