//! Writing messages inside the application's transaction.

use async_trait::async_trait;

use crate::error::Result;
use crate::message::{MessageId, NewMessage};

/// Something a message can be enqueued into: an open application
/// transaction of some backend. Application code generic over `Enqueue`
/// can be unit-tested on the memory backend without a database.
///
/// # Contract
/// The message becomes visible to relays only when the transaction
/// commits; a rollback (or drop without commit) discards it. An invalid
/// message is refused with an `InvalidInput` error and nothing is written.
#[async_trait]
pub trait Enqueue: Send {
    /// Validates and writes `message` into the transaction; returns its id.
    async fn enqueue(&mut self, message: NewMessage) -> Result<MessageId>;
}
