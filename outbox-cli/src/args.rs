//! The command line: global options, subcommands and their arguments.

use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use outbox_api::backend::redact_url;
use outbox_api::{MessageId, MessageState};

use crate::CliError;
use crate::db;
use crate::duration::parse_duration;
use crate::glob::Glob;

/// The `--database` value. Kept as given (it is parsed once the command is
/// known, so that `health` can report a bad one as unhealthy), and shown
/// only with its password redacted — `Debug` included.
#[derive(Clone)]
pub struct DatabaseUrl(pub String);

impl std::str::FromStr for DatabaseUrl {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(DatabaseUrl(s.to_owned()))
    }
}

impl std::fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("DatabaseUrl")
            .field(&redact_url(&self.0))
            .finish()
    }
}

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "outbox",
    version,
    about = "Inspect and repair an outbox-rs outbox table",
    long_about = "Inspect and repair an outbox-rs outbox table in an existing SQLite, \
        PostgreSQL or MySQL/MariaDB database.\n\n\
        Exit codes: 0 success, 1 the command failed (missing database, schema or table, \
        unknown message, wrong state), 2 usage error. `health`: 0 healthy, 1 degraded, \
        2 unhealthy."
)]
pub struct Cli {
    /// The database: `sqlite:PATH`, `postgres://user:password@host:port/db`
    /// (also `postgresql://`) or `mysql://user:password@host:port/db` (also
    /// `mariadb://`). Never created or migrated; a password is
    /// never printed.
    #[arg(
        long,
        visible_alias = "db",
        global = true,
        env = "OUTBOX_DATABASE",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub database: Option<DatabaseUrl>,

    /// PostgreSQL only: the schema holding the outbox table [default: public].
    #[arg(
        long,
        global = true,
        env = "OUTBOX_SCHEMA",
        hide_env_values = true,
        value_name = "NAME"
    )]
    pub schema: Option<String>,

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
    pub table: String,

    /// Print machine-readable JSON on stdout instead of text.
    #[arg(long, global = true)]
    pub json: bool,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
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
        #[command(flatten)]
        alert: BacklogAlert,
    },
    /// Serve the web console for this outbox (or, with --matching, for the
    /// outboxes of many schemas) over HTTP until interrupted (Ctrl-C or
    /// SIGTERM). A non-loopback address needs a token.
    Serve(ServeArgs),
    /// List the outboxes of the database with their health: every schema's
    /// --table on PostgreSQL (one schema per tenant), the one table on SQLite.
    #[command(
        long_about = "List the outboxes of the database with their health: on PostgreSQL every \
            schema holding an outbox table named --table (one schema per tenant, say), read a \
            few at a time over one small pool; on SQLite the one table of the file.\n\n\
            Each row: the name (the schema; the table on SQLite), its status as `outbox health` \
            judges it (degraded for poison or an old backlog, unhealthy when it cannot be read), \
            pending and poisoned counts, the age of the oldest pending message and the reasons. \
            A line below counts them by status and names those that are not healthy.\n\n\
            Exit 0 once listed, whatever their health (probe one with `health`); 1 when no \
            schema holds such a table or none matches --matching."
    )]
    Outboxes(OutboxesArgs),
}

/// Arguments of `outboxes`.
#[derive(Debug, Args)]
pub struct OutboxesArgs {
    /// Only outboxes whose name (the schema; the table on SQLite) matches
    /// this pattern: `*` any run of characters, `?` one, e.g. `tenant_*`.
    #[arg(long, value_name = "GLOB", value_parser = Glob::parse)]
    pub matching: Option<Glob>,
    /// Only the outboxes that are degraded or unhealthy (the line below
    /// still counts them all).
    #[arg(long)]
    pub not_healthy: bool,
    #[command(flatten)]
    pub alert: BacklogAlert,
}

/// `--backlog-alert`, the same for `health`, `outboxes` and `serve`.
#[derive(Debug, Args)]
pub struct BacklogAlert {
    /// Degraded when the oldest pending message is older than this (units s, m, h, d).
    #[arg(
        long,
        value_parser = parse_duration,
        default_value = "5m",
        value_name = "DURATION",
        allow_hyphen_values = true
    )]
    pub backlog_alert: Duration,
}

/// The port `outbox serve` listens on by default (on 127.0.0.1).
pub const DEFAULT_CONSOLE_PORT: u16 = 8089;

/// Arguments of `serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The address to listen on; port 0 picks a free one (the address is
    /// printed). Anything but a loopback address needs a token.
    #[arg(long, value_name = "ADDR", default_value_t = std::net::SocketAddr::from(([127, 0, 0, 1], DEFAULT_CONSOLE_PORT)))]
    pub listen: std::net::SocketAddr,
    /// Require this token on every request (`Authorization: Bearer`, or the
    /// login form); at least 16 bytes, e.g. `openssl rand -hex 32`. Never
    /// printed.
    #[arg(
        long,
        env = outbox_console::TOKEN_ENV,
        hide_env_values = true,
        value_name = "TOKEN",
        value_parser = |t: &str| Ok::<_, std::convert::Infallible>(ConsoleToken(t.to_owned()))
    )]
    pub token: Option<ConsoleToken>,
    #[command(flatten)]
    pub alert: BacklogAlert,
    /// Log lines on standard error (filtered by `RUST_LOG`, default:
    /// warnings) as text or as JSON objects, one a line.
    #[arg(long, value_enum, env = "OUTBOX_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,
    /// PostgreSQL only: serve the outboxes of every schema whose name
    /// matches this pattern (`*` any run of characters, `?` one, e.g.
    /// `tenant_*`) and holds an outbox table named --table, each under the
    /// schema's name, over one shared pool. Instead of --schema; the
    /// schemas are found when the console starts, and again every
    /// --refresh while it runs.
    #[arg(long, value_name = "GLOB", value_parser = Glob::parse)]
    pub matching: Option<Glob>,
    /// With --matching: look for matching schemas again this often (units
    /// s, m, h, d; at least 1s): a tenant's new schema shows on the
    /// console, a dropped one leaves it. A failed look changes nothing.
    #[arg(
        long,
        value_parser = parse_duration,
        default_value = "30s",
        value_name = "DURATION",
        requires = "matching"
    )]
    pub refresh: Duration,
}

/// How `outbox serve` writes its log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object a line (with the span each was logged in).
    Json,
}

impl LogFormat {
    /// Installs the process's log subscriber: standard error, `RUST_LOG`
    /// (default: warnings), in this format.
    pub fn install(self) {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let logs = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr);
        // Another subscriber already installed (a test harness) keeps its own.
        let _ = match self {
            LogFormat::Text => logs.try_init(),
            LogFormat::Json => logs.json().with_current_span(true).try_init(),
        };
    }
}

impl ServeArgs {
    /// The token, if one is given and not empty (an empty
    /// `OUTBOX_CONSOLE_TOKEN` is no token, as for `Console::token_from_env`).
    pub fn token(&self) -> Option<&str> {
        self.token
            .as_ref()
            .map(|t| t.0.as_str())
            .filter(|t| !t.is_empty())
    }
}

/// The console token, never shown (`Debug` included).
#[derive(Clone)]
pub struct ConsoleToken(pub String);

impl std::fmt::Debug for ConsoleToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConsoleToken(<redacted>)")
    }
}

/// Arguments of `list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only messages in this state.
    #[arg(long, value_enum)]
    pub state: Option<StateArg>,
    /// Only messages of this type, e.g. OrderPlaced.
    #[arg(long = "type", value_name = "TYPE")]
    pub message_type: Option<String>,
    /// At most this many messages.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    pub limit: u32,
}

/// Arguments of `retry`.
#[derive(Debug, Args)]
pub struct RetryArgs {
    /// The poisoned message's id (a UUID).
    #[arg(
        value_parser = parse_id,
        required_unless_present = "all_poisoned",
        conflicts_with = "all_poisoned"
    )]
    pub id: Option<MessageId>,
    /// Retry every poisoned message.
    #[arg(long)]
    pub all_poisoned: bool,
    /// Show what would be retried; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub operator: Operator,
}

/// Who performs an action; recorded in the message's `last_error`.
#[derive(Debug, Args)]
pub struct Operator {
    /// The operator's name, recorded with the action [default: $USER, else "cli"].
    #[arg(long, value_name = "NAME")]
    pub by: Option<String>,
}

impl Operator {
    /// The name given with `--by`, else `$USER`, else `cli`.
    pub fn name(&self) -> Result<String, CliError> {
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
pub enum StateArg {
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

/// Parses a message id (clap value parser).
pub fn parse_id(text: &str) -> Result<MessageId, String> {
    text.trim()
        .parse::<MessageId>()
        .map_err(|_| format!("`{}` is not a message id (a UUID)", text.escape_debug()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_password() {
        use clap::Parser as _;
        let cli = Cli::try_parse_from([
            "outbox",
            "--database",
            "postgres://shop:s3cretpw@db.example:5432/app",
            "stats",
        ])
        .unwrap();
        let shown = format!("{cli:?}");
        assert!(!shown.contains("s3cretpw"), "{shown}");
        assert!(
            shown.contains("postgres://shop:***@db.example:5432/app"),
            "{shown}"
        );
        let cli = Cli::try_parse_from([
            "outbox",
            "--db",
            "sqlite:a.db",
            "serve",
            "--token",
            "t0ken-that-is-long-enough",
        ])
        .unwrap();
        let shown = format!("{cli:?}");
        assert!(!shown.contains("t0ken"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
    }

    #[test]
    fn cli_is_well_formed() {
        use clap::CommandFactory as _;
        Cli::command().debug_assert();
    }
}
