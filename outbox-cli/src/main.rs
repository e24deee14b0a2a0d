//! `outbox`: the operator's command line for outbox-rs tables.
//!
//! It inspects an outbox table of an existing SQLite database and does what
//! a human does with one: count, list and show messages, retry or discard
//! poisoned ones, purge delivered ones, and answer a health probe.
//!
//! ```text
//! outbox --database sqlite:app.db [--table outbox] [--json] <command>
//!   stats                                  counts and the oldest pending age
//!   list [--state S] [--type T] [--limit N]
//!   show ID
//!   retry ID | --all-poisoned [--dry-run] [--by NAME]
//!   discard ID [--dry-run] [--by NAME]
//!   purge --older-than 7d
//!   health [--backlog-alert 5m]
//! ```
//!
//! It never creates or migrates a database: a missing file, a file that is
//! not SQLite, or a database without the named outbox table is an error.
//!
//! # Exit codes
//! * `0` — success.
//! * `1` — the command failed: the database is missing, unreadable or has
//!   no such outbox table, the message does not exist, or it is in a state
//!   the action does not apply to.
//! * `2` — usage error: unknown option or subcommand, malformed id, unknown
//!   state, bad duration, a `--database` that is not `sqlite:PATH`.
//! * `health` has its own: `0` healthy, `1` degraded, `2` unhealthy (the
//!   outbox cannot be read — or the probe itself is misconfigured).
//!
//! Every failure prints one line starting with `error:` on stderr.
#![forbid(unsafe_code)]

mod db;
mod duration;
mod render;

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use outbox_api::{
    ErrorKind, ListQuery, Message, MessageId, MessageState, OperatorStore, Store, Timestamp,
};
use outbox_sqlite::SqliteStore;
use serde_json::{Value, json};

use crate::duration::{format_age, parse_duration};

/// How many processed messages one purge statement deletes.
const PURGE_BATCH: usize = 500;

/// Exit code of a usage error (and of `health` when unhealthy).
const EXIT_USAGE: u8 = 2;
/// Exit code of a failed command.
const EXIT_FAILED: u8 = 1;

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "outbox",
    version,
    about = "Inspect and repair an outbox-rs outbox table",
    long_about = "Inspect and repair an outbox-rs outbox table in an existing SQLite database.\n\n\
        Exit codes: 0 success, 1 the command failed (missing database or table, unknown \
        message, wrong state), 2 usage error. `health`: 0 healthy, 1 degraded, 2 unhealthy."
)]
struct Cli {
    /// The database, as `sqlite:PATH`. Never created or migrated.
    #[arg(
        long,
        global = true,
        env = "OUTBOX_DATABASE",
        hide_env_values = true,
        value_name = "URL"
    )]
    database: Option<String>,

    /// The outbox table.
    #[arg(
        long,
        global = true,
        env = "OUTBOX_TABLE",
        hide_env_values = true,
        default_value = "outbox",
        value_name = "NAME",
        value_parser = db::parse_table_name
    )]
    table: String,

    /// Print machine-readable JSON on stdout instead of text.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Count pending, poisoned and processed messages; age of the oldest pending one.
    Stats,
    /// List messages, oldest first.
    List(ListArgs),
    /// Show every field of one message, the payload pretty-printed.
    Show {
        /// The message id (a UUID).
        #[arg(value_parser = parse_id)]
        id: MessageId,
    },
    /// Move poisoned messages back to pending with attempts reset to 0.
    Retry(RetryArgs),
    /// Mark a pending or poisoned message processed without delivering it.
    Discard {
        /// The message id (a UUID).
        #[arg(value_parser = parse_id)]
        id: MessageId,
        #[command(flatten)]
        operator: Operator,
        /// Show what would be done; change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Delete processed messages older than a retention, in batches of 500
    /// that rest between them so that the application's writers get in.
    Purge {
        /// How long processed messages are kept: e.g. 30m, 12h, 7d (units s, m, h, d).
        #[arg(
            long,
            value_parser = parse_duration,
            value_name = "DURATION",
            allow_hyphen_values = true
        )]
        older_than: Duration,
    },
    /// Probe the outbox: exit 0 healthy, 1 degraded, 2 unhealthy.
    Health {
        /// Degraded when the oldest pending message is older than this (units s, m, h, d).
        #[arg(
            long,
            value_parser = parse_duration,
            default_value = "5m",
            value_name = "DURATION",
            allow_hyphen_values = true
        )]
        backlog_alert: Duration,
    },
}

/// Arguments of `list`.
#[derive(Debug, Args)]
struct ListArgs {
    /// Only messages in this state.
    #[arg(long, value_enum)]
    state: Option<StateArg>,
    /// Only messages of this type, e.g. OrderPlaced.
    #[arg(long = "type", value_name = "TYPE")]
    message_type: Option<String>,
    /// At most this many messages.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    limit: u32,
}

/// Arguments of `retry`.
#[derive(Debug, Args)]
struct RetryArgs {
    /// The poisoned message's id (a UUID).
    #[arg(
        value_parser = parse_id,
        required_unless_present = "all_poisoned",
        conflicts_with = "all_poisoned"
    )]
    id: Option<MessageId>,
    /// Retry every poisoned message.
    #[arg(long)]
    all_poisoned: bool,
    /// Show what would be retried; change nothing.
    #[arg(long)]
    dry_run: bool,
    #[command(flatten)]
    operator: Operator,
}

/// Who performs an action; recorded in the message's `last_error`.
#[derive(Debug, Args)]
struct Operator {
    /// The operator's name, recorded with the action [default: $USER, else "cli"].
    #[arg(long, value_name = "NAME")]
    by: Option<String>,
}

impl Operator {
    fn name(&self) -> Result<String, CliError> {
        let name = match &self.by {
            Some(by) => by.trim().to_owned(),
            None => std::env::var("USER")
                .ok()
                .map(|u| u.trim().to_owned())
                .filter(|u| !u.is_empty())
                .unwrap_or_else(|| "cli".to_owned()),
        };
        if name.is_empty() || name.chars().any(char::is_control) {
            return Err(CliError::usage(format!(
                "operator name `{}` given with --by must be non-empty text without control characters",
                name.escape_debug()
            )));
        }
        Ok(name)
    }
}

/// Message states, as typed on the command line.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum StateArg {
    /// Waiting for delivery.
    Pending,
    /// Failed too often; waits for an operator.
    Poisoned,
    /// Delivered or discarded.
    Processed,
}

impl From<StateArg> for MessageState {
    fn from(s: StateArg) -> Self {
        match s {
            StateArg::Pending => MessageState::Pending,
            StateArg::Poisoned => MessageState::Poisoned,
            StateArg::Processed => MessageState::Processed,
        }
    }
}

fn parse_id(text: &str) -> Result<MessageId, String> {
    text.trim()
        .parse::<MessageId>()
        .map_err(|_| format!("`{}` is not a message id (a UUID)", text.escape_debug()))
}

/// A failure, with the exit code it leads to.
#[derive(Debug)]
pub struct CliError {
    code: u8,
    message: String,
}

impl CliError {
    /// A usage error (exit 2).
    pub fn usage(message: impl Into<String>) -> Self {
        CliError {
            code: EXIT_USAGE,
            message: message.into(),
        }
    }

    /// A failed command (exit 1).
    pub fn failed(message: impl Into<String>) -> Self {
        CliError {
            code: EXIT_FAILED,
            message: message.into(),
        }
    }
}

impl From<outbox_api::Error> for CliError {
    fn from(e: outbox_api::Error) -> Self {
        match e.kind() {
            ErrorKind::Config | ErrorKind::InvalidInput => CliError::usage(e.to_string()),
            _ => CliError::failed(e.to_string()),
        }
    }
}

/// What a command prints and how the process exits.
struct Output {
    stdout: String,
    /// A failure line for stderr (without the `error: ` prefix).
    error: Option<String>,
    code: u8,
}

impl Output {
    fn ok(stdout: String) -> Self {
        Output {
            stdout,
            error: None,
            code: 0,
        }
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return clap_error(&e),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_FAILED);
        }
    };
    let output = runtime.block_on(run(cli)).unwrap_or_else(|e| Output {
        stdout: String::new(),
        error: Some(e.message),
        code: e.code,
    });
    emit(&output)
}

/// Prints help and version as clap does; any other parse error as one line.
fn clap_error(e: &clap::Error) -> ExitCode {
    use clap::error::ErrorKind as K;
    if matches!(e.kind(), K::DisplayHelp | K::DisplayVersion) {
        let _ = e.print();
        return ExitCode::SUCCESS;
    }
    let text = e.to_string();
    let parts: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty() && !l.starts_with("For more information") && !l.starts_with("Usage:")
        })
        .collect();
    let mut line = String::new();
    for part in parts {
        if !line.is_empty() {
            line.push_str(if line.ends_with(':') { " " } else { "; " });
        }
        line.push_str(part);
    }
    if !line.starts_with("error:") {
        line = format!("error: {line}");
    }
    eprintln!("{line} (see --help)");
    ExitCode::from(EXIT_USAGE)
}

/// Writes the output; a closed stdout (`outbox list | head`) is not an error.
fn emit(output: &Output) -> ExitCode {
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout
        .write_all(output.stdout.as_bytes())
        .and_then(|()| stdout.flush())
    {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            eprintln!("error: cannot write to stdout: {e}");
            return ExitCode::from(EXIT_FAILED);
        }
    }
    if let Some(message) = &output.error {
        let message = render::one_line(message);
        eprintln!("error: {message}");
    }
    ExitCode::from(output.code)
}

async fn run(cli: Cli) -> Result<Output, CliError> {
    let Cli {
        database,
        table,
        json,
        command,
    } = cli;
    const NO_DATABASE: &str =
        "no database given: pass --database sqlite:PATH or set OUTBOX_DATABASE";
    let path = match (database.as_deref(), &command) {
        (Some(url), _) => db::parse_database_url(url)?,
        (None, Command::Health { .. }) => return Ok(unhealthy(json, NO_DATABASE.into())),
        (None, _) => return Err(CliError::usage(NO_DATABASE)),
    };
    let open = || db::open(&path, &table);
    match command {
        Command::Stats => stats(&open().await?, json).await,
        Command::List(args) => list(&open().await?, &args, json).await,
        Command::Show { id } => show(&open().await?, id, json).await,
        Command::Retry(args) => retry(&open().await?, &args, json).await,
        Command::Discard {
            id,
            operator,
            dry_run,
        } => discard(&open().await?, id, &operator.name()?, dry_run, json).await,
        Command::Purge { older_than } => purge(&open().await?, older_than, json).await,
        Command::Health { backlog_alert } => Ok(health(&path, &table, backlog_alert, json).await),
    }
}

fn to_json(value: &Value) -> String {
    let mut s = serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string());
    s.push('\n');
    s
}

async fn stats(store: &SqliteStore, json: bool) -> Result<Output, CliError> {
    let stats = store.stats().await?;
    let now = Timestamp::now();
    let age = stats.oldest_pending_created_at.map(|t| now.since(t));
    if json {
        return Ok(Output::ok(to_json(&json!({
            "table": store.table(),
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
        store.table(),
        stats.pending,
        stats.poisoned,
        stats.processed,
    )))
}

async fn list(store: &SqliteStore, args: &ListArgs, json: bool) -> Result<Output, CliError> {
    let mut query = ListQuery::new().limit(args.limit as usize);
    if let Some(state) = args.state {
        query = query.state(MessageState::from(state));
    }
    if let Some(message_type) = &args.message_type {
        query = query.message_type(message_type.clone());
    }
    let messages = store.list(&query).await?;
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
async fn get(store: &SqliteStore, id: MessageId) -> Result<Message, CliError> {
    store.get(id).await?.ok_or_else(|| {
        CliError::failed(format!(
            "not found: no message with id {id} in outbox table `{}`",
            store.table()
        ))
    })
}

async fn show(store: &SqliteStore, id: MessageId, json: bool) -> Result<Output, CliError> {
    let message = get(store, id).await?;
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

fn not_poisoned(m: &Message) -> CliError {
    CliError::failed(format!(
        "conflict: message {} is {}, not poisoned; only poisoned messages can be retried",
        m.id, m.state
    ))
}

async fn retry(store: &SqliteStore, args: &RetryArgs, json: bool) -> Result<Output, CliError> {
    let by = args.operator.name()?;
    let targets: Vec<Message> = match args.id {
        Some(id) => {
            let m = get(store, id).await?;
            if m.state != MessageState::Poisoned {
                return Err(not_poisoned(&m));
            }
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

async fn discard(
    store: &SqliteStore,
    id: MessageId,
    by: &str,
    dry_run: bool,
    json: bool,
) -> Result<Output, CliError> {
    let m = get(store, id).await?;
    if m.state == MessageState::Processed {
        return Err(CliError::failed(format!(
            "conflict: message {id} is processed already; nothing to discard"
        )));
    }
    if !dry_run {
        store.discard(id, by, Timestamp::now()).await?;
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

async fn purge(store: &SqliteStore, older_than: Duration, json: bool) -> Result<Output, CliError> {
    let before = Timestamp::now().sub(older_than);
    // Batches that rest between them, so the application's writers get in.
    let purged = outbox_api::backend::purge_in_batches(
        PURGE_BATCH,
        || false,
        |limit| store.purge_processed(before, limit),
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

/// The `unhealthy` report: exit 2, the reason on stdout and stderr.
fn unhealthy(json: bool, reason: String) -> Output {
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

async fn health(path: &std::path::Path, table: &str, alert: Duration, json: bool) -> Output {
    let stats = match db::open(path, table).await {
        // The backlog only: a probe must not count the processed history.
        Ok(store) => store.backlog().await.map_err(CliError::from),
        Err(e) => Err(e),
    };
    let stats = match stats {
        Ok(stats) => stats,
        Err(e) => return unhealthy(json, e.message),
    };
    let age = stats
        .oldest_pending_created_at
        .map(|t| Timestamp::now().since(t));
    let mut reasons = Vec::new();
    if stats.poisoned > 0 {
        reasons.push(format!(
            "{} poisoned message(s) wait for an operator (see `outbox list --state poisoned`)",
            stats.poisoned
        ));
    }
    if let Some(age) = age.filter(|a| *a > alert) {
        reasons.push(format!(
            "the oldest pending message is {} old (alert after {})",
            format_age(age),
            format_age(alert)
        ));
    }
    let (status, code) = if reasons.is_empty() {
        ("healthy", 0)
    } else {
        ("degraded", 1)
    };
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
