//! The commands. Each works over the opened outbox's `OperatorStore`, the
//! same code for every backend; only opening ([`crate::db`]) differs.

use std::time::Duration;

use outbox_api::{
    Backlog, ErrorKind, HealthStatus, ListQuery, Message, MessageId, MessageState, OperatorAction,
    Timestamp, backlog_reasons, format_age,
};
use serde_json::{Value, json};

use crate::args::{ListArgs, RetryArgs, ServeArgs};
use crate::db::{self, Found, Outbox, Target};
use crate::glob::Glob;
use crate::outboxes::READ_CONCURRENCY;
use crate::{CliError, EXIT_USAGE, Output, render};

/// How many processed messages one purge statement deletes.
const PURGE_BATCH: usize = 500;

pub(crate) fn to_json(value: &Value) -> String {
    let mut s = serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string());
    s.push('\n');
    s
}

pub async fn stats(outbox: &Outbox, json: bool) -> Result<Output, CliError> {
    let stats = outbox.store().stats().await?;
    let now = Timestamp::now();
    let age = stats.oldest_pending_created_at.map(|t| now.since(t));
    if json {
        return Ok(Output::ok(to_json(&json!({
            "table": outbox.name(),
            "pending": stats.pending,
            "poisoned": stats.poisoned,
            "processed": stats.processed,
            "oldest_pending_created_at": stats.oldest_pending_created_at.map(|t| t.to_string()),
            "oldest_pending_age_seconds": age.map(|a| a.as_secs_f64()),
        }))));
    }
    let oldest = match (stats.oldest_pending_created_at, age) {
        (Some(t), Some(age)) => format!("{} ago ({t})", format_age(age)),
        _ => "-".to_owned(),
    };
    Ok(Output::ok(format!(
        "table           {}\npending         {}\npoisoned        {}\nprocessed       {}\noldest pending  {oldest}\n",
        outbox.name(),
        stats.pending,
        stats.poisoned,
        stats.processed,
    )))
}

pub async fn list(outbox: &Outbox, args: &ListArgs, json: bool) -> Result<Output, CliError> {
    let mut query = ListQuery::new().limit(args.limit as usize);
    if let Some(state) = args.state {
        query = query.state(MessageState::from(state));
    }
    if let Some(message_type) = &args.message_type {
        query = query.message_type(message_type.clone());
    }
    let messages = outbox.store().list(&query).await?;
    if json {
        let items: Vec<Value> = messages
            .iter()
            .map(|m| render::message_json(m, false))
            .collect();
        return Ok(Output::ok(to_json(&Value::Array(items))));
    }
    if messages.is_empty() {
        return Ok(Output::ok("no messages match\n".to_owned()));
    }
    let mut out = render::message_table(&messages);
    if messages.len() == args.limit as usize {
        out.push_str(&format!(
            "({} shown; there may be more: raise --limit)\n",
            messages.len()
        ));
    }
    Ok(Output::ok(out))
}

/// The message, or a `not found` error naming the id and table.
async fn get(outbox: &Outbox, id: MessageId) -> Result<Message, CliError> {
    outbox.store().get(id).await?.ok_or_else(|| {
        CliError::failed(format!(
            "not found: no message with id {id} in outbox table `{}`",
            outbox.name()
        ))
    })
}

pub async fn show(outbox: &Outbox, id: MessageId, json: bool) -> Result<Output, CliError> {
    let message = get(outbox, id).await?;
    Ok(Output::ok(if json {
        to_json(&render::message_json(&message, true))
    } else {
        render::message_page(&message)
    }))
}

/// A short description of a message for action reports.
fn describe(m: &Message) -> String {
    let mut s = format!("{} ({}", m.id, render::one_line(&m.message_type));
    if let Some(key) = &m.key {
        s.push_str(&format!(", key {}", render::one_line(key)));
    }
    s.push_str(&format!(", {} attempts", m.attempts));
    if let Some(e) = &m.last_error {
        s.push_str(&format!(
            ", last error: {}",
            render::truncate(&render::one_line(e), 80)
        ));
    }
    s.push(')');
    s
}

pub async fn retry(outbox: &Outbox, args: &RetryArgs, json: bool) -> Result<Output, CliError> {
    let by = args.operator.name()?;
    let store = outbox.store();
    let targets: Vec<Message> = match args.id {
        Some(id) => {
            let m = get(outbox, id).await?;
            OperatorAction::Retry.check(m.id, m.state)?;
            vec![m]
        }
        None => {
            let poisoned = store.backlog().await?.poisoned;
            if poisoned == 0 {
                Vec::new()
            } else {
                store
                    .list(
                        &ListQuery::new()
                            .state(MessageState::Poisoned)
                            .limit(usize::try_from(poisoned).unwrap_or(usize::MAX)),
                    )
                    .await?
            }
        }
    };
    let mut done = Vec::new();
    let mut skipped = Vec::new();
    for m in &targets {
        if args.dry_run {
            done.push(m);
            continue;
        }
        match store.retry(m.id, &by, Timestamp::now()).await {
            Ok(()) => done.push(m),
            // With --all-poisoned, another operator or a discard may have
            // moved a message meanwhile: report it and go on.
            Err(e)
                if args.id.is_none()
                    && matches!(e.kind(), ErrorKind::Conflict | ErrorKind::NotFound) =>
            {
                skipped.push((m, e.to_string()));
            }
            Err(e) => return Err(e.into()),
        }
    }
    if json {
        return Ok(Output::ok(to_json(&json!({
            "action": "retry",
            "dry_run": args.dry_run,
            "by": by,
            "count": done.len(),
            "messages": done.iter().map(|m| json!({
                "id": m.id.to_string(),
                "message_type": m.message_type,
                "key": m.key,
                "attempts_before": m.attempts,
            })).collect::<Vec<_>>(),
            "skipped": skipped.iter().map(|(m, reason)| json!({
                "id": m.id.to_string(),
                "reason": reason,
            })).collect::<Vec<_>>(),
        }))));
    }
    let verb = if args.dry_run {
        "would retry"
    } else {
        "retried"
    };
    let mut out = String::new();
    for m in &done {
        out.push_str(&format!("{verb} {}\n", describe(m)));
    }
    for (m, reason) in &skipped {
        out.push_str(&format!("skipped {}: {}\n", m.id, render::one_line(reason)));
    }
    if targets.is_empty() {
        out.push_str("no poisoned messages\n");
    } else if args.dry_run {
        out.push_str(&format!(
            "dry run: {} poisoned message(s) would go back to pending with attempts 0 (by {}); nothing changed\n",
            done.len(),
            render::one_line(&by)
        ));
    } else {
        out.push_str(&format!(
            "{} message(s) back to pending with attempts 0 (by {})\n",
            done.len(),
            render::one_line(&by)
        ));
    }
    Ok(Output::ok(out))
}

pub async fn discard(
    outbox: &Outbox,
    id: MessageId,
    by: &str,
    dry_run: bool,
    json: bool,
) -> Result<Output, CliError> {
    let m = get(outbox, id).await?;
    OperatorAction::Discard.check(id, m.state)?;
    if !dry_run {
        // The store announces it to relays (a discard may unblock later
        // messages of its key) in the action's own transaction.
        outbox.store().discard(id, by, Timestamp::now()).await?;
    }
    if json {
        return Ok(Output::ok(to_json(&json!({
            "action": "discard",
            "dry_run": dry_run,
            "by": by,
            "id": id.to_string(),
            "message_type": m.message_type,
            "previous_state": m.state.as_str(),
        }))));
    }
    let verb = if dry_run {
        "would discard"
    } else {
        "discarded"
    };
    let mut out = format!(
        "{verb} {}: {} → processed without delivery (by {})\n",
        describe(&m),
        m.state,
        render::one_line(by)
    );
    if dry_run {
        out.push_str("dry run: nothing changed\n");
    }
    Ok(Output::ok(out))
}

pub async fn purge(outbox: &Outbox, older_than: Duration, json: bool) -> Result<Output, CliError> {
    let before = Timestamp::now().saturating_sub(older_than);
    // Batches that rest between them, so the application's writers get in.
    let purged = outbox_api::backend::purge_in_batches(
        PURGE_BATCH,
        || false,
        |limit| outbox.store().purge_processed(before, limit),
    )
    .await?;
    if json {
        return Ok(Output::ok(to_json(&json!({
            "action": "purge",
            "purged": purged,
            "processed_before": before.to_string(),
        }))));
    }
    Ok(Output::ok(format!(
        "purged {purged} processed message(s) processed before {before} (older than {})\n",
        format_age(older_than)
    )))
}

/// How `outbox health` and `outbox outboxes` judge an outbox they could
/// read: *degraded* while a message is poisoned or the oldest pending one
/// is older than `alert` (the reasons say which), else *healthy*. An outbox
/// that cannot be read is *unhealthy*.
pub fn judge(backlog: &Backlog, alert: Duration, now: Timestamp) -> (HealthStatus, Vec<String>) {
    let reasons = backlog_reasons(backlog, alert, now);
    let status = if reasons.is_empty() {
        HealthStatus::Healthy
    } else {
        HealthStatus::Degraded
    };
    (status, reasons)
}

/// The `unhealthy` report: exit 2, the reason on stdout and stderr.
pub fn unhealthy(json: bool, reason: String) -> Output {
    let stdout = if json {
        to_json(&json!({
            "status": "unhealthy",
            "reasons": [reason],
        }))
    } else {
        format!("unhealthy\n  - {}\n", render::one_line(&reason))
    };
    Output {
        stdout,
        error: Some(format!("unhealthy: {reason}")),
        code: EXIT_USAGE,
    }
}

pub async fn health(target: &Target, alert: Duration, json: bool) -> Output {
    let stats = match db::open(target).await {
        // The backlog only: a probe must not count the processed history.
        Ok(outbox) => {
            let backlog = outbox.store().backlog().await.map_err(CliError::from);
            outbox.close().await;
            backlog
        }
        Err(e) => Err(e),
    };
    let stats = match stats {
        Ok(stats) => stats,
        Err(e) => return unhealthy(json, e.message),
    };
    let now = Timestamp::now();
    let age = stats.oldest_pending_created_at.map(|t| now.since(t));
    let (status, reasons) = judge(&stats, alert, now);
    let code = match status {
        HealthStatus::Healthy => 0,
        _ => 1,
    };
    let status = status.as_str();
    let stdout = if json {
        to_json(&json!({
            "status": status,
            "reasons": reasons,
            "pending": stats.pending,
            "poisoned": stats.poisoned,
            "oldest_pending_age_seconds": age.map(|a| a.as_secs_f64()),
            "backlog_alert_seconds": alert.as_secs(),
        }))
    } else {
        let mut s = format!("{status}\n");
        for r in &reasons {
            s.push_str(&format!("  - {r}\n"));
        }
        s.push_str(&format!(
            "  pending {}, poisoned {}, oldest pending {}\n",
            stats.pending,
            stats.poisoned,
            age.map_or_else(|| "-".to_owned(), |a| format!("{} old", format_age(a)))
        ));
        s
    };
    Output {
        stdout,
        error: None,
        code,
    }
}

/// Refuses, before anything is opened or bound, to serve a non-loopback
/// address without a token.
pub fn check_serve_args(args: &ServeArgs) -> Result<(), CliError> {
    if !args.listen.ip().is_loopback() && args.token().is_none() {
        return Err(CliError::usage(format!(
            "refusing to serve the console on {} without a token: that address is not \
             loopback, so anyone who reaches it could retry and discard messages; pass \
             --token (or set {}) or listen on 127.0.0.1",
            args.listen,
            outbox_console::TOKEN_ENV
        )));
    }
    if args.matching.is_some() && args.refresh.is_zero() {
        return Err(CliError::usage(
            "--refresh 0s would look for schemas without pause: give at least 1s",
        ));
    }
    Ok(())
}

/// Serves the console over `outbox` until Ctrl-C or SIGTERM. Prints the
/// address it listens on (useful with port 0) as soon as it is bound.
pub async fn serve(outbox: &Outbox, args: &ServeArgs) -> Result<Output, CliError> {
    let console = outbox_console::Console::new()
        .outbox(outbox.console_name(), outbox.shared_store())
        .map_err(|e| CliError::usage(e.to_string()))?;
    serve_console(console, &format!("`{}`", outbox.name()), args).await
}

/// Serves the console over the outboxes `found` (`serve --matching`), each
/// under its schema's name, read [`READ_CONCURRENCY`] at a time. A schema
/// the console cannot show (a name it reserves for its own pages, or one
/// the stores refuse) is left out with a warning on stderr.
pub async fn serve_many(
    found: &Found,
    matching: &Glob,
    table: &str,
    args: &ServeArgs,
) -> Result<Output, CliError> {
    let console = outbox_console::Console::new().read_concurrency(READ_CONCURRENCY);
    let list = console.outbox_list();
    let mut shown = 0usize;
    // Warned of once: not tried again while the schema stays.
    let mut refused = std::collections::HashSet::new();
    for entry in &found.outboxes {
        match show_schema(&list, &entry.name, entry.store.clone()) {
            Ok(()) => shown += 1,
            Err(why) => {
                eprintln!(
                    "warning: schema `{}` is left out of the console: {}",
                    render::one_line(&entry.name),
                    render::one_line(&why)
                );
                refused.insert(entry.name.clone());
            }
        }
    }
    if shown == 0 {
        return Err(CliError::failed(format!(
            "none of the {} schema(s) matching `{matching}` can be shown (see the warnings above)",
            found.outboxes.len()
        )));
    }
    let what = format!(
        "{shown} outbox{} (schemas matching `{matching}` with a table `{table}`, looked for again every {} s)",
        if shown == 1 { "" } else { "es" },
        args.refresh.as_secs()
    );
    let following = found.pool().map(|pool| {
        tokio::spawn(follow_schemas(
            list,
            pool.clone(),
            table.to_owned(),
            matching.clone(),
            args.refresh,
            refused,
        ))
    });
    let output = serve_console(console, &what, args).await;
    if let Some(task) = following {
        task.abort();
    }
    output
}

/// Looks for the schemas matching `matching` every `every` while the
/// console serves: a new one is added to `list`, one gone is removed. A
/// failed look changes nothing; a schema that cannot be shown (`refused`
/// holds those already warned of) is warned of once.
async fn follow_schemas(
    list: outbox_console::OutboxList,
    pool: outbox_postgres::sqlx::PgPool,
    table: String,
    matching: Glob,
    every: Duration,
    mut refused: std::collections::HashSet<String>,
) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is at once: the console starts with what was found.
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let now = match db::schemas_matching(&pool, &table, &matching).await {
            Ok(now) => now,
            Err(e) => {
                tracing::warn!(error = %render::one_line(&e.message),
                    "looking for schemas matching `{matching}` again failed; the console shows the ones it had");
                continue;
            }
        };
        let shown = list.names();
        for gone in shown.iter().filter(|name| !now.contains(name)) {
            list.remove(gone);
            tracing::info!(schema = %gone, "schema gone: removed from the console");
        }
        refused.retain(|name| now.contains(name));
        for new in now.iter().filter(|name| !shown.contains(name)) {
            if refused.contains(new) {
                continue;
            }
            match show_schema(&list, new, db::open_schema(&pool, new, &table).await) {
                Ok(()) => tracing::info!(schema = %new, "new schema: added to the console"),
                Err(why) => {
                    tracing::warn!(schema = %render::one_line(new), error = %render::one_line(&why),
                        "a schema is left out of the console");
                    refused.insert(new.clone());
                }
            }
        }
    }
}

/// Adds schema `name`'s outbox, opened as `store`, to the console's `list`,
/// or says why it cannot be shown (a store that did not open, a name the
/// console refuses; the list is left as it was).
fn show_schema(
    list: &outbox_console::OutboxList,
    name: &str,
    store: Result<std::sync::Arc<dyn outbox_api::OperatorStore>, String>,
) -> Result<(), String> {
    list.add(name, store?).map_err(|e| e.to_string())
}

/// Serves `console` (describing it as `what`) until Ctrl-C or SIGTERM.
/// Prints the address it listens on (useful with port 0) as soon as it is
/// bound.
async fn serve_console(
    console: outbox_console::Console,
    what: &str,
    args: &ServeArgs,
) -> Result<Output, CliError> {
    use std::io::Write as _;
    check_serve_args(args)?;
    let mut console = console.backlog_age_alert(args.alert.backlog_alert);
    if let Some(token) = args.token() {
        console = console
            .token(token)
            .map_err(|e| CliError::usage(e.to_string()))?;
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| CliError::failed(format!("cannot listen on {}: {e}", args.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| CliError::failed(format!("cannot listen on {}: {e}", args.listen)))?;
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(
        stdout,
        "outbox console for {what} listening on http://{addr}/{}",
        if args.token().is_some() {
            " (token required)"
        } else {
            ""
        }
    );
    let _ = stdout.flush();
    drop(stdout);
    outbox_console::serve_on(listener, console, shutdown_signal())
        .await
        .map_err(|e| CliError::failed(e.to_string()))?;
    Ok(Output::ok("outbox console stopped\n".to_owned()))
}

/// Completes on Ctrl-C, or SIGTERM on Unix.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    () = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => ctrl_c.await,
        }
    }
    #[cfg(not(unix))]
    ctrl_c.await;
}
