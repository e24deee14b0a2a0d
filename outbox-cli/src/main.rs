//! `outbox`: the operator's command line for outbox-rs tables.
//!
//! It inspects an outbox table of an existing SQLite, PostgreSQL or
//! MySQL/MariaDB database
//! and does what a human does with one: count, list and show messages,
//! retry or discard poisoned ones, purge delivered ones, and answer a
//! health probe.
//!
//! ```text
//! outbox --database sqlite:app.db [--table outbox] [--json] <command>
//! outbox --database postgres://user@host/db [--schema public] [--table outbox] [--json] <command>
//! outbox --database mysql://user@host/db [--table outbox] [--json] <command>
//!   stats                                  counts and the oldest pending age
//!   list [--state S] [--type T] [--limit N]
//!   show ID
//!   retry ID | --all-poisoned [--dry-run] [--by NAME]
//!   discard ID [--dry-run] [--by NAME]
//!   purge --older-than 7d
//!   health [--backlog-alert 5m]
//!   serve [--listen 127.0.0.1:8089] [--token T]   the web console (outbox-console)
//!   serve --matching GLOB [--refresh 30s]  PostgreSQL: the console over many schemas' outboxes
//!   outboxes [--matching GLOB] [--not-healthy] [--backlog-alert 5m]
//!                                          every schema's outbox with its health
//! ```
//!
//! It never creates or migrates anything: a missing file, a file that is
//! not SQLite, a PostgreSQL schema or table that does not exist, or a table
//! that is not an outbox is an error. Opening is the only code that differs
//! by backend ([`db`]); the commands ([`commands`]) work over an
//! `OperatorStore`. A password in the database URL is never printed.
//!
//! # Exit codes
//! * `0` — success.
//! * `1` — the command failed: the database is missing, unreachable,
//!   unreadable or has no such schema or outbox table, the message does not
//!   exist, or it is in a state the action does not apply to.
//! * `2` — usage error: unknown option or subcommand, malformed id, unknown
//!   state, bad duration, a `--database` that is not `sqlite:PATH`,
//!   `postgres://…` or `mysql://…`, an invalid schema or table name.
//! * `health` has its own: `0` healthy, `1` degraded, `2` unhealthy (the
//!   outbox cannot be read — or the probe itself is misconfigured).
//!
//! Every failure prints one line starting with `error:` on stderr.
#![forbid(unsafe_code)]

mod args;
mod commands;
mod db;
mod duration;
mod glob;
mod outboxes;
mod render;

use std::io::Write as _;
use std::process::ExitCode;

use clap::Parser as _;
use outbox_api::ErrorKind;

use crate::args::{Cli, Command};

/// Exit code of a usage error (and of `health` when unhealthy).
pub const EXIT_USAGE: u8 = 2;
/// Exit code of a failed command.
pub const EXIT_FAILED: u8 = 1;

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
pub struct Output {
    /// What goes to stdout.
    pub stdout: String,
    /// A failure line for stderr (without the `error: ` prefix).
    pub error: Option<String>,
    /// The exit code.
    pub code: u8,
}

impl Output {
    /// Success, printing `stdout`.
    pub fn ok(stdout: String) -> Self {
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
        schema,
        table,
        json,
        command,
    } = cli;
    const NO_DATABASE: &str = "no database given: pass --database sqlite:PATH, \
         --database postgres://USER@HOST/DB or --database mysql://USER@HOST/DB, or set OUTBOX_DATABASE";
    let target = match &database {
        Some(url) => db::Target::parse(&url.0, schema.as_deref(), &table),
        None => Err(CliError::usage(NO_DATABASE)),
    };
    match command {
        // A probe that cannot even tell what to read is unhealthy.
        Command::Health { alert } => Ok(match target {
            Ok(target) => commands::health(&target, alert.backlog_alert, json).await,
            Err(e) => commands::unhealthy(json, e.message),
        }),
        Command::Stats => with_outbox(&target?, async |o| commands::stats(o, json).await).await,
        Command::List(args) => {
            with_outbox(&target?, async |o| commands::list(o, &args, json).await).await
        }
        Command::Show { id } => {
            with_outbox(&target?, async |o| commands::show(o, id, json).await).await
        }
        Command::Retry(args) => {
            with_outbox(&target?, async |o| commands::retry(o, &args, json).await).await
        }
        Command::Discard {
            id,
            operator,
            dry_run,
        } => {
            let by = operator.name()?;
            with_outbox(&target?, async |o| {
                commands::discard(o, id, &by, dry_run, json).await
            })
            .await
        }
        Command::Serve(args) => {
            // Refused before the database is even opened.
            commands::check_serve_args(&args)?;
            let Some(matching) = &args.matching else {
                args.log_format.install();
                return with_outbox(&target?, async |o| commands::serve(o, &args).await).await;
            };
            if schema.is_some() {
                return Err(CliError::usage(
                    "serve: give --matching GLOB (many schemas) or --schema NAME (one), not both \
                     (unset --schema / OUTBOX_SCHEMA)",
                ));
            }
            let target = target?;
            let one = match target {
                db::Target::Sqlite { .. } => Some("a SQLite"),
                db::Target::MySql { .. } => Some("a MySQL/MariaDB"),
                db::Target::Postgres { .. } => None,
            };
            if let Some(what) = one {
                return Err(CliError::usage(format!(
                    "serve --matching applies to PostgreSQL only (it picks schemas); {what} \
                     database has one outbox per --table"
                )));
            }
            args.log_format.install();
            let found = db::open_all(&target, Some(matching)).await?;
            let output = commands::serve_many(&found, matching, &table, &args).await;
            found.close().await;
            output
        }
        Command::Outboxes(args) => {
            if let Some(schema) = &schema {
                return Err(CliError::usage(format!(
                    "outboxes lists the outbox of every schema, so --schema `{}` does not \
                     apply: pick schemas with --matching GLOB (unset --schema / OUTBOX_SCHEMA)",
                    schema.escape_debug()
                )));
            }
            outboxes::outboxes(&target?, &args, json).await
        }
        Command::Purge { older_than } => {
            with_outbox(&target?, async |o| {
                commands::purge(o, older_than, json).await
            })
            .await
        }
    }
}

/// Opens the outbox, runs `command` on it, closes it.
async fn with_outbox(
    target: &db::Target,
    command: impl AsyncFnOnce(&db::Outbox) -> Result<Output, CliError>,
) -> Result<Output, CliError> {
    let outbox = db::open(target).await?;
    let output = command(&outbox).await;
    outbox.close().await;
    output
}
