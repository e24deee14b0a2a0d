//! Receiving integration messages: one inbox handler per module, used by
//! both buses.
//!
//! A module implements [`InboxModule::handle`]: the message's effects and any
//! reply, written through the open transaction it is given. Around it, the
//! inbox transaction is always the same — `BEGIN IMMEDIATE`, record
//! `(consumer, message id)` in the inbox (a duplicate: skip), run the
//! handler, commit — and only then is the message acknowledged:
//!
//! * [`EmbeddedBus`] (the default) runs it in-process in [`receive`] and
//!   answers the sending relay `Delivered` only after the commit;
//! * with RabbitMQ, [`AmqpInbox`] hands the same handler to the library's
//!   `RabbitConsumer`, which runs the same transaction and acks after the
//!   commit.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use outbox::rabbitmq::{InboxHandler, Received};
use outbox::sqlite::sqlx::SqliteConnection;
use outbox::{HandlerError, Message, MessageId, Outcome, Transport};

use crate::db::ModuleDb;

/// A module that receives integration messages through its inbox.
#[async_trait]
pub trait InboxModule: Send + Sync + fmt::Debug + 'static {
    /// The module's database (its pool runs the inbox transaction).
    fn db(&self) -> &ModuleDb;

    /// The message types it subscribes to.
    fn subscribes(&self) -> &'static [&'static str];

    /// Applies one message inside the inbox transaction `tx`: effects and
    /// replies commit together with the inbox row, or not at all.
    async fn handle(
        &self,
        message_type: &str,
        payload: &[u8],
        tx: &mut SqliteConnection,
    ) -> Result<(), HandlerError>;
}

/// How [`receive`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Receipt {
    /// Handled and committed.
    Handled,
    /// Seen before (the inbox has it): nothing done, still acknowledged.
    Duplicate,
}

/// Why [`receive`] did not commit.
#[derive(Debug)]
pub enum ReceiveError {
    /// The handler refused the message (counts as a failed attempt).
    Handler(String),
    /// The database failed (an outage: does not count).
    Store(String),
}

/// Receives one message with the inbox, in one transaction on the
/// receiver's database; returns after the commit.
pub async fn receive(
    module: &dyn InboxModule,
    id: MessageId,
    message_type: &str,
    payload: &[u8],
) -> Result<Receipt, ReceiveError> {
    let db = module.db();
    let mut tx = db.pool.begin_with("BEGIN IMMEDIATE").await.map_err(|e| {
        ReceiveError::Store(format!("beginning the {} inbox transaction: {e}", db.name))
    })?;
    let fresh = db
        .outbox
        .try_receive(&mut *tx, db.name, id)
        .await
        .map_err(|e| ReceiveError::Store(e.to_string()))?;
    if !fresh {
        let _ = tx.rollback().await;
        return Ok(Receipt::Duplicate);
    }
    if let Err(e) = module.handle(message_type, payload, &mut tx).await {
        let _ = tx.rollback().await;
        return Err(ReceiveError::Handler(e.to_string()));
    }
    tx.commit().await.map_err(|e| {
        ReceiveError::Store(format!("committing the {} inbox transaction: {e}", db.name))
    })?;
    Ok(Receipt::Handled)
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
                Some(module) => match receive(&**module, m.id, &m.message_type, &m.payload).await {
                    Ok(_) => Outcome::Delivered,
                    Err(ReceiveError::Handler(e)) => Outcome::Rejected(e),
                    Err(ReceiveError::Store(e)) => Outcome::Unavailable(e),
                },
            };
            outcomes.push(outcome);
        }
        outcomes
    }

    async fn probe(&self) -> Result<(), String> {
        Ok(())
    }
}

/// A module's inbox handler as a `RabbitConsumer` handler: the consumer
/// runs the inbox transaction, this runs [`InboxModule::handle`] in it.
#[derive(Debug)]
pub struct AmqpInbox(pub Arc<dyn InboxModule>);

#[async_trait]
impl InboxHandler for AmqpInbox {
    async fn handle(&self, msg: &Received, tx: &mut SqliteConnection) -> Result<(), HandlerError> {
        let message_type = msg.message_type.as_deref().unwrap_or_default();
        self.0.handle(message_type, &msg.payload, tx).await
    }
}
