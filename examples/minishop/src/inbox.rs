//! Receiving integration messages: one inbox handler per module, used by
//! both buses.
//!
//! A module implements [`InboxModule::handle`]: the message's effects and any
//! reply, written through the open transaction it is given (SQLite,
//! PostgreSQL or MySQL alike, see [`crate::db`]). Around it, the inbox transaction is
//! always the same ([`ModuleDb::receive_once`](crate::db::ModuleDb::receive_once):
//! on SQLite `outbox-sqlite`'s `SqliteOutbox::receive_once`) — begin,
//! record `(consumer, message id)` in the inbox (a duplicate: skip), run
//! the handler guarded (error, panic, timeout: roll back), commit — and
//! only then is the message acknowledged:
//!
//! * [`EmbeddedBus`] (the default) runs it in-process in [`receive`] and
//!   answers the sending relay `Delivered` only after the commit;
//! * with RabbitMQ or NATS, [`ModuleInbox`] hands the same handler to the
//!   library's `RabbitConsumer` or `NatsConsumer` (its SQLite, PostgreSQL or
//!   MySQL inbox), which runs the same transaction and acks after the commit.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox::mysql::MySqlOutbox;
use outbox::mysql::sqlx::MySqlConnection;
use outbox::postgres::PgOutbox;
use outbox::postgres::sqlx::PgConnection;
use outbox::receive::{InboxHandler, Received};
use outbox::sqlite::sqlx::SqliteConnection;
use outbox::sqlite::{InboxOutcome, SqliteOutbox};
use outbox::{HandlerError, Message, MessageId, Outcome, Transport};
use tracing::Instrument;

use crate::db::{Conn, ModuleDb};

/// A module that receives integration messages through its inbox.
#[async_trait]
pub trait InboxModule: Send + Sync + fmt::Debug + 'static {
    /// The module's database (it runs the inbox transaction).
    fn db(&self) -> &ModuleDb;

    /// The message types it subscribes to.
    fn subscribes(&self) -> &'static [&'static str];

    /// Applies one message inside the inbox transaction `tx`: effects and
    /// replies commit together with the inbox row, or not at all.
    async fn handle(
        &self,
        message_type: &str,
        payload: &[u8],
        tx: &mut Conn<'_>,
    ) -> Result<(), HandlerError>;
}

/// Longest an inbox handler may run before it counts as failed, on the
/// embedded bus (shorter than the relay's own 30 s limit on a send, so the
/// handler's guard ends a stuck handler first). The RabbitMQ consumers use
/// the library's default.
pub const HANDLER_TIMEOUT: Duration = Duration::from_secs(10);

/// Receives one message with the inbox, in one transaction on the
/// receiver's database (a duplicate skips the handler; a handler error,
/// panic or timeout rolls back); returns after the commit.
pub async fn receive(
    module: &dyn InboxModule,
    id: MessageId,
    message_type: &str,
    payload: &[u8],
) -> InboxOutcome {
    module
        .db()
        .receive_once(id, HANDLER_TIMEOUT, async |tx| {
            module.handle(message_type, payload, tx).await
        })
        .await
}

/// The in-process message bus: a [`Transport`] that delivers each
/// integration message straight into the inbox of the module subscribed to
/// its type ([`receive`]) and reports `Delivered` once that commit is done.
#[derive(Clone)]
pub struct EmbeddedBus {
    routes: Arc<HashMap<&'static str, Arc<dyn InboxModule>>>,
}

impl fmt::Debug for EmbeddedBus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut routes: Vec<_> = self.routes.iter().map(|(t, m)| (*t, m.db().name)).collect();
        routes.sort();
        f.debug_struct("EmbeddedBus")
            .field("routes", &routes)
            .finish()
    }
}

impl EmbeddedBus {
    /// A bus delivering to `modules` (each gets the types it subscribes to).
    pub fn new(modules: &[Arc<dyn InboxModule>]) -> Self {
        let mut routes = HashMap::new();
        for m in modules {
            for t in m.subscribes() {
                routes.insert(*t, Arc::clone(m));
            }
        }
        EmbeddedBus {
            routes: Arc::new(routes),
        }
    }
}

/// The span a module receives `m` in: a child of the span that enqueued it
/// (its `trace_parent`), as a broker consumer's `outbox.receive` span is,
/// so that the receiving module's replies carry the same trace.
fn receive_span(m: &Message) -> tracing::Span {
    let span = tracing::info_span!(
        "outbox.receive",
        message.id = %m.id,
        message.type = %m.message_type,
        message.key = m.key.as_deref(),
        trace_parent = m.trace_parent.as_deref(),
        consumer = "embedded bus",
    );
    outbox::trace::continue_trace(&span, m.trace_parent.as_deref());
    span
}

#[async_trait]
impl Transport for EmbeddedBus {
    async fn send(&self, batch: &[Message]) -> Vec<Outcome> {
        let mut outcomes = Vec::with_capacity(batch.len());
        for m in batch {
            let outcome = match self.routes.get(m.message_type.as_str()) {
                None => Outcome::Rejected(format!(
                    "no module subscribes to message type `{}`",
                    m.message_type
                )),
                Some(module) => match receive(&**module, m.id, &m.message_type, &m.payload)
                    .instrument(receive_span(m))
                    .await
                {
                    InboxOutcome::Committed | InboxOutcome::Duplicate => Outcome::Delivered,
                    InboxOutcome::HandlerFailed(e) => Outcome::Rejected(e),
                    // Not the message's fault: sent again later, uncounted.
                    InboxOutcome::HandlerUnavailable { reason, .. } => Outcome::Unavailable(reason),
                    InboxOutcome::StoreFailed(e) => Outcome::Unavailable(e),
                },
            };
            outcomes.push(outcome);
        }
        outcomes
    }

    async fn probe(&self) -> outbox::Result<()> {
        Ok(())
    }
}

/// A module's inbox handler as a broker consumer's handler (RabbitMQ's or
/// NATS's): the consumer
/// runs the inbox transaction (SQLite, PostgreSQL or MySQL, by the outbox `O`),
/// this runs [`InboxModule::handle`] in it, with the module's outbox for
/// its replies.
#[derive(Debug)]
pub struct ModuleInbox<O> {
    /// The receiving module.
    pub module: Arc<dyn InboxModule>,
    /// Its outbox (`SqliteOutbox`, `PgOutbox` or `MySqlOutbox`).
    pub outbox: O,
}

impl<O> ModuleInbox<O> {
    async fn run(&self, msg: &Received, tx: &mut Conn<'_>) -> Result<(), HandlerError> {
        let message_type = msg.message_type.as_deref().unwrap_or_default();
        self.module.handle(message_type, &msg.payload, tx).await
    }
}

#[async_trait]
impl InboxHandler<SqliteConnection> for ModuleInbox<SqliteOutbox> {
    async fn handle(&self, msg: &Received, tx: &mut SqliteConnection) -> Result<(), HandlerError> {
        self.run(msg, &mut Conn::Sqlite(tx, &self.outbox)).await
    }
}

#[async_trait]
impl InboxHandler<PgConnection> for ModuleInbox<PgOutbox> {
    async fn handle(&self, msg: &Received, tx: &mut PgConnection) -> Result<(), HandlerError> {
        self.run(msg, &mut Conn::Postgres(tx, &self.outbox)).await
    }
}

#[async_trait]
impl InboxHandler<MySqlConnection> for ModuleInbox<MySqlOutbox> {
    async fn handle(&self, msg: &Received, tx: &mut MySqlConnection) -> Result<(), HandlerError> {
        self.run(msg, &mut Conn::MySql(tx, &self.outbox)).await
    }
}

/// A module's inbox and its handler, on the module's database: what a
/// broker consumer (RabbitMQ's or NATS's) is spawned with.
pub enum ModuleReceiver {
    /// On SQLite.
    Sqlite(outbox::sqlite::SqliteInbox, ModuleInbox<SqliteOutbox>),
    /// On PostgreSQL.
    Postgres(outbox::postgres::PgInbox, ModuleInbox<PgOutbox>),
    /// On MySQL or MariaDB.
    MySql(outbox::mysql::MySqlInbox, ModuleInbox<MySqlOutbox>),
}

impl ModuleReceiver {
    /// `module`'s inbox and handler.
    pub fn of(module: Arc<dyn InboxModule>) -> Result<ModuleReceiver, crate::fail::Fail> {
        let db = module.db().clone();
        match (db.sqlite(), db.postgres(), db.mysql()) {
            (Some((outbox, pool)), _, _) => Ok(ModuleReceiver::Sqlite(
                outbox::sqlite::SqliteInbox::new(outbox.clone(), pool.clone()),
                ModuleInbox {
                    module,
                    outbox: outbox.clone(),
                },
            )),
            (None, Some((outbox, pool)), _) => Ok(ModuleReceiver::Postgres(
                outbox::postgres::PgInbox::new(outbox.clone(), pool.clone()),
                ModuleInbox {
                    module,
                    outbox: outbox.clone(),
                },
            )),
            (None, None, Some((outbox, pool))) => Ok(ModuleReceiver::MySql(
                outbox::mysql::MySqlInbox::new(outbox.clone(), pool.clone()),
                ModuleInbox {
                    module,
                    outbox: outbox.clone(),
                },
            )),
            (None, None, None) => Err(crate::fail::Fail(format!(
                "the {} database is neither SQLite, PostgreSQL nor MySQL",
                db.name
            ))),
        }
    }
}
