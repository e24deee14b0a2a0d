//! `outbox outboxes`: the outboxes of a database — on PostgreSQL one per
//! schema, a thousand tenants' say — each with its health as `outbox
//! health` judges it, read a few at a time over one pool.

use std::time::Duration;

use outbox_api::{Backlog, HealthStatus, Timestamp, format_age};
use serde_json::{Value, json};

use crate::args::OutboxesArgs;
use crate::commands::{judge, to_json};
use crate::db::{self, Entry, Target};
use crate::{CliError, Output, render};
use futures_util::StreamExt;

/// How many outboxes are read at the same time (as many as the shared
/// pool has connections).
pub const READ_CONCURRENCY: usize = db::SHARED_POOL_SIZE as usize;

/// Most outboxes the summary line names before it says how many more.
const NAMED: usize = 10;

/// One outbox's line.
struct Row<'a> {
    name: &'a str,
    status: HealthStatus,
    reasons: Vec<String>,
    /// `None` when it could not be read.
    backlog: Option<Backlog>,
}

/// Lists the outboxes `target` names (all schemas on PostgreSQL), filtered
/// by `args`.
pub async fn outboxes(
    target: &Target,
    args: &OutboxesArgs,
    json: bool,
) -> Result<Output, CliError> {
    let found = db::open_all(target, args.matching.as_ref()).await?;
    let rows = read_all(&found.outboxes, args.alert.backlog_alert).await;
    let now = Timestamp::now();
    let table = match target {
        Target::Sqlite { table, .. }
        | Target::Postgres { table, .. }
        | Target::MySql { table, .. } => table.as_str(),
    };
    let out = if json {
        as_json(&rows, table, args, now)
    } else {
        as_text(&rows, args.not_healthy, now)
    };
    found.close().await;
    Ok(Output::ok(out))
}

/// Every outbox's backlog and judgement, [`READ_CONCURRENCY`] at a time,
/// in the outboxes' order.
async fn read_all(entries: &[Entry], alert: Duration) -> Vec<Row<'_>> {
    let reads = entries.iter().map(|entry| async move {
        let backlog = match &entry.store {
            // The backlog only: health never counts the processed history.
            Ok(store) => store.backlog().await.map_err(|e| e.to_string()),
            Err(why) => Err(why.clone()),
        };
        match backlog {
            Ok(backlog) => {
                let (status, reasons) = judge(&backlog, alert, Timestamp::now());
                Row {
                    name: &entry.name,
                    status,
                    reasons,
                    backlog: Some(backlog),
                }
            }
            Err(why) => Row {
                name: &entry.name,
                status: HealthStatus::Unhealthy,
                reasons: vec![why],
                backlog: None,
            },
        }
    });
    // In order, at most READ_CONCURRENCY at a time, in this task.
    futures_util::stream::iter(reads)
        .buffered(READ_CONCURRENCY)
        .collect()
        .await
}

fn age(backlog: &Backlog, now: Timestamp) -> Option<Duration> {
    backlog.oldest_pending_created_at.map(|t| now.since(t))
}

/// The statuses, best first.
const STATUSES: [HealthStatus; 3] = [
    HealthStatus::Healthy,
    HealthStatus::Degraded,
    HealthStatus::Unhealthy,
];

/// `3 outboxes: 2 healthy, 1 degraded (tenant_2)`: every outbox counted by
/// status, and the names of at most [`NAMED`] that are not healthy, the
/// worst first.
fn summary(rows: &[Row<'_>]) -> String {
    let count = |s: HealthStatus| rows.iter().filter(|r| r.status == s).count();
    let mut budget = NAMED;
    let mut named: Vec<(HealthStatus, Vec<&str>)> = Vec::new();
    for status in STATUSES
        .iter()
        .rev()
        .filter(|s| **s != HealthStatus::Healthy)
    {
        let names: Vec<&str> = rows
            .iter()
            .filter(|r| r.status == *status)
            .take(budget)
            .map(|r| r.name)
            .collect();
        budget -= names.len();
        named.push((*status, names));
    }
    let parts: Vec<String> = STATUSES
        .iter()
        .filter(|s| count(**s) > 0)
        .map(|s| {
            let n = count(*s);
            let names = named
                .iter()
                .find(|(status, _)| status == s)
                .map(|(_, names)| names.as_slice())
                .unwrap_or_default();
            let mut part = format!("{n} {}", s.as_str());
            if !names.is_empty() {
                part.push_str(&format!(" ({}", render::one_line(&names.join(", "))));
                if n > names.len() {
                    part.push_str(&format!(" and {} more", n - names.len()));
                }
                part.push(')');
            }
            part
        })
        .collect();
    format!(
        "{} outbox{}: {}\n",
        rows.len(),
        if rows.len() == 1 { "" } else { "es" },
        parts.join(", ")
    )
}

fn as_text(rows: &[Row<'_>], not_healthy: bool, now: Timestamp) -> String {
    let shown: Vec<[String; 6]> = rows
        .iter()
        .filter(|r| !not_healthy || r.status != HealthStatus::Healthy)
        .map(|r| {
            let number = |n: Option<u64>| n.map_or_else(|| "-".to_owned(), |n| n.to_string());
            [
                render::one_line(r.name),
                r.status.as_str().to_owned(),
                number(r.backlog.map(|b| b.pending)),
                number(r.backlog.map(|b| b.poisoned)),
                r.backlog
                    .and_then(|b| age(&b, now))
                    .map_or_else(|| "-".to_owned(), format_age),
                render::one_line(&r.reasons.join("; ")),
            ]
        })
        .collect();
    let mut out = if shown.is_empty() {
        "no outbox is degraded or unhealthy\n".to_owned()
    } else {
        render::table(
            &[
                "OUTBOX",
                "STATUS",
                "PENDING",
                "POISONED",
                "OLDEST_PENDING",
                "REASONS",
            ],
            &shown,
        )
    };
    out.push_str(&summary(rows));
    out
}

fn as_json(rows: &[Row<'_>], table: &str, args: &OutboxesArgs, now: Timestamp) -> String {
    let count = |s: HealthStatus| rows.iter().filter(|r| r.status == s).count();
    let listed: Vec<Value> = rows
        .iter()
        .filter(|r| !args.not_healthy || r.status != HealthStatus::Healthy)
        .map(|r| {
            json!({
                "name": r.name,
                "status": r.status.as_str(),
                "reasons": r.reasons,
                "pending": r.backlog.map(|b| b.pending),
                "poisoned": r.backlog.map(|b| b.poisoned),
                "oldest_pending_created_at": r.backlog
                    .and_then(|b| b.oldest_pending_created_at)
                    .map(|t| t.to_string()),
                "oldest_pending_age_seconds": r.backlog
                    .and_then(|b| age(&b, now))
                    .map(|a| a.as_secs_f64()),
            })
        })
        .collect();
    to_json(&json!({
        "table": table,
        "matching": args.matching.as_ref().map(|g| g.as_str()),
        "backlog_alert_seconds": args.alert.backlog_alert.as_secs(),
        "count": {
            "outboxes": rows.len(),
            "healthy": count(HealthStatus::Healthy),
            "degraded": count(HealthStatus::Degraded),
            "unhealthy": count(HealthStatus::Unhealthy),
        },
        "not_healthy": rows
            .iter()
            .filter(|r| r.status != HealthStatus::Healthy)
            .map(|r| r.name)
            .collect::<Vec<_>>(),
        "outboxes": listed,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, status: HealthStatus) -> Row<'_> {
        Row {
            name,
            status,
            reasons: Vec::new(),
            backlog: None,
        }
    }

    #[test]
    fn the_summary_counts_and_names_the_worst_first() {
        let names: Vec<String> = (0..30).map(|i| format!("t{i}")).collect();
        let mut rows: Vec<Row<'_>> = names
            .iter()
            .map(|n| row(n, HealthStatus::Healthy))
            .collect();
        assert_eq!(summary(&rows), "30 outboxes: 30 healthy\n");
        rows[17].status = HealthStatus::Degraded;
        rows[3].status = HealthStatus::Degraded;
        assert_eq!(
            summary(&rows),
            "30 outboxes: 28 healthy, 2 degraded (t3, t17)\n"
        );
        for r in &mut rows[20..] {
            r.status = HealthStatus::Degraded;
        }
        rows[0].status = HealthStatus::Unhealthy;
        assert_eq!(
            summary(&rows),
            "30 outboxes: 17 healthy, 12 degraded (t3, t17, t20, t21, t22, t23, t24, t25, t26 \
             and 3 more), 1 unhealthy (t0)\n"
        );
        assert_eq!(
            summary(&[row("solo", HealthStatus::Unhealthy)]),
            "1 outbox: 1 unhealthy (solo)\n"
        );
    }
}
