//! The inbox conformance suite: one async function per clause of the
//! [`Inbox`] contract, run by every store's inbox (memory, SQLite,
//! PostgreSQL) through [`inbox_conformance_tests!`](crate::inbox_conformance_tests).
//!
//! The handler's effect under test is a reply enqueued with the store's
//! outbox inside the inbox transaction, counted as the store's pending
//! messages: every store can do that, and it is what a receiver's handler
//! does in a saga.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;

use crate::{
    Error, HandlerError, Inbox, InboxOutcome, InboxWork, MessageId, MessageKind, NewMessage, Store,
    TemporarilyUnavailable, Timestamp,
};

/// A store's inbox under test, with what the suite needs to see inside it.
#[async_trait]
pub trait InboxUnderTest: Send + Sync {
    /// The inbox.
    type Inbox: Inbox;

    /// The inbox (a fresh one per test: nothing received yet).
    fn inbox(&self) -> &Self::Inbox;

    /// The store the inbox's replies are enqueued in, to count them.
    fn store(&self) -> Arc<dyn Store>;

    /// Enqueues `message` with the store's outbox on `conn`, the open inbox
    /// transaction (what a handler does to reply).
    async fn enqueue_in(
        &self,
        conn: &mut <Self::Inbox as Inbox>::Conn,
        message: NewMessage,
    ) -> Result<(), HandlerError>;

    /// An error of this store's database driver, as a handler meets it,
    /// that means "the database is unavailable or busy, try later" (for
    /// sqlx: `sqlx::Error::PoolTimedOut`).
    fn driver_unavailable_error(&self) -> HandlerError;
}

/// Expands to one `#[test]` per inbox contract clause; `$factory` is an
/// async fn (or closure) returning a fresh [`InboxUnderTest`].
#[macro_export]
macro_rules! inbox_conformance_tests {
    ($factory:expr) => {
        $crate::inbox_conformance_tests!(@each $factory;
            inbox_commits_once_and_skips_duplicates, inbox_rolls_back_failures_panics_and_timeouts,
            inbox_temporarily_unavailable_is_uncounted_with_its_delay,
            inbox_database_unavailable_is_uncounted_on_every_store,
            inbox_concurrent_receipts_commit_once, inbox_purge_respects_before_and_limit);
    };
    (@each $factory:expr; $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                $crate::testing::block_on(async {
                    let sut = ($factory)().await;
                    $crate::testing::inbox::$name(&sut).await;
                });
            }
        )*
    };
}

const LIMIT: Duration = Duration::from_secs(10);

/// How the handler under test ends, after enqueuing its reply.
#[derive(Clone, Copy)]
enum Then {
    Ok,
    Fail,
    Panic,
    Hang,
    Unavailable,
    DriverUnavailable,
    StoreUnavailable,
}

/// A handler's own error wrapping the cause, as application code writes.
#[derive(Debug)]
struct Wrapped(HandlerError);

impl fmt::Display for Wrapped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("reserving stock")
    }
}

impl std::error::Error for Wrapped {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

struct Work<'a, S> {
    sut: &'a S,
    runs: &'a AtomicU32,
    then: Then,
}

#[async_trait]
impl<S: InboxUnderTest> InboxWork<<S::Inbox as Inbox>::Conn> for Work<'_, S> {
    async fn run(&self, conn: &mut <S::Inbox as Inbox>::Conn) -> Result<(), HandlerError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let reply = NewMessage::new(MessageKind::Domain, "Reply", b"{}".to_vec());
        self.sut.enqueue_in(conn, reply).await?;
        match self.then {
            Then::Ok => Ok(()),
            Then::Fail => Err("the order is unknown".into()),
            Then::Panic => panic!("{}handler blew up", super::DELIBERATE),
            Then::Hang => {
                std::future::pending::<()>().await;
                Ok(())
            }
            Then::Unavailable => Err(TemporarilyUnavailable::new("payments answer 503")
                .retry_after(Duration::from_secs(2))
                .into()),
            Then::DriverUnavailable => Err(Wrapped(self.sut.driver_unavailable_error()).into()),
            Then::StoreUnavailable => {
                Err(Wrapped(Error::unavailable("stock service").into()).into())
            }
        }
    }
}

async fn receive<S: InboxUnderTest>(
    sut: &S,
    consumer: &str,
    id: MessageId,
    timeout: Duration,
    then: Then,
    runs: &AtomicU32,
) -> InboxOutcome {
    let work = Work { sut, runs, then };
    sut.inbox().receive_once(consumer, id, timeout, &work).await
}

async fn replies<S: InboxUnderTest>(sut: &S) -> u64 {
    sut.store().stats().await.expect("stats").pending
}

/// A message is received once: its handler's reply commits with the inbox
/// entry; received again, it is a duplicate and the handler does not run;
/// another consumer receives it on its own.
pub async fn inbox_commits_once_and_skips_duplicates<S: InboxUnderTest>(sut: &S) {
    let id = MessageId::new();
    let runs = AtomicU32::new(0);
    let first = receive(sut, "billing", id, LIMIT, Then::Ok, &runs).await;
    assert_eq!(first, InboxOutcome::Committed);
    assert_eq!(replies(sut).await, 1);

    let again = receive(sut, "billing", id, LIMIT, Then::Ok, &runs).await;
    assert_eq!(again, InboxOutcome::Duplicate);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "a duplicate never runs the handler"
    );
    assert_eq!(replies(sut).await, 1);

    let other = receive(sut, "shipping", id, LIMIT, Then::Ok, &runs).await;
    assert_eq!(
        other,
        InboxOutcome::Committed,
        "another consumer is not a duplicate"
    );
    assert_eq!(replies(sut).await, 2);
}

/// A handler error, panic or timeout rolls everything back (no reply, no
/// inbox entry), so the next delivery runs the handler again.
pub async fn inbox_rolls_back_failures_panics_and_timeouts<S: InboxUnderTest>(sut: &S) {
    super::quiet_deliberate_panics();
    let id = MessageId::new();
    let runs = AtomicU32::new(0);
    let failed = receive(sut, "billing", id, LIMIT, Then::Fail, &runs).await;
    assert_eq!(
        failed,
        InboxOutcome::HandlerFailed("the order is unknown".into())
    );
    let panicked = receive(sut, "billing", id, LIMIT, Then::Panic, &runs).await;
    assert!(
        matches!(&panicked, InboxOutcome::HandlerFailed(e) if e.contains("panicked")),
        "{panicked:?}"
    );
    let slow = receive(
        sut,
        "billing",
        id,
        Duration::from_millis(50),
        Then::Hang,
        &runs,
    )
    .await;
    assert!(
        matches!(&slow, InboxOutcome::HandlerFailed(e) if e.contains("timed out")),
        "{slow:?}"
    );
    assert_eq!(replies(sut).await, 0, "nothing of a failed handler remains");

    let retried = receive(sut, "billing", id, LIMIT, Then::Ok, &runs).await;
    assert_eq!(
        retried,
        InboxOutcome::Committed,
        "the retry ran the handler"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    assert_eq!(replies(sut).await, 1);
}

/// A handler that says `TemporarilyUnavailable` is rolled back and retried
/// uncounted, with the delay it asked for.
pub async fn inbox_temporarily_unavailable_is_uncounted_with_its_delay<S: InboxUnderTest>(sut: &S) {
    let runs = AtomicU32::new(0);
    let outcome = receive(
        sut,
        "billing",
        MessageId::new(),
        LIMIT,
        Then::Unavailable,
        &runs,
    )
    .await;
    assert_eq!(
        outcome,
        InboxOutcome::HandlerUnavailable {
            reason: "temporarily unavailable: payments answer 503".into(),
            retry_after: Some(Duration::from_secs(2)),
        }
    );
    assert_eq!(replies(sut).await, 0);
}

/// A handler error caused by the database being unavailable or busy — the
/// store's driver error, or an `outbox_api::Error` of kind `Unavailable`,
/// anywhere in the source chain — is an uncounted retry on every store,
/// never a counted failure that could dead-letter a good message.
pub async fn inbox_database_unavailable_is_uncounted_on_every_store<S: InboxUnderTest>(sut: &S) {
    let runs = AtomicU32::new(0);
    for then in [Then::DriverUnavailable, Then::StoreUnavailable] {
        let outcome = receive(sut, "billing", MessageId::new(), LIMIT, then, &runs).await;
        assert!(
            matches!(
                &outcome,
                InboxOutcome::HandlerUnavailable { reason, retry_after: None }
                    if reason.starts_with("temporarily unavailable: reserving stock")
            ),
            "{outcome:?}"
        );
    }
    assert_eq!(replies(sut).await, 0);
}

/// Two receipts of one message at once: one commits, the other is a
/// duplicate, and one reply remains.
pub async fn inbox_concurrent_receipts_commit_once<S: InboxUnderTest>(sut: &S) {
    let id = MessageId::new();
    let runs = AtomicU32::new(0);
    let (a, b) = tokio::join!(
        receive(sut, "billing", id, LIMIT, Then::Ok, &runs),
        receive(sut, "billing", id, LIMIT, Then::Ok, &runs),
    );
    let mut outcomes = [a.name(), b.name()];
    outcomes.sort();
    assert_eq!(outcomes, ["committed", "duplicate"]);
    assert_eq!(replies(sut).await, 1);
}

/// The purge deletes at most `limit` entries received before `before`, none
/// received later; a purged message received again runs its handler.
pub async fn inbox_purge_respects_before_and_limit<S: InboxUnderTest>(sut: &S) {
    let runs = AtomicU32::new(0);
    let ids: Vec<MessageId> = (0..5).map(|_| MessageId::new()).collect();
    for id in &ids {
        assert_eq!(
            receive(sut, "billing", *id, LIMIT, Then::Ok, &runs).await,
            InboxOutcome::Committed
        );
    }
    let inbox = sut.inbox();
    let earlier = Timestamp::from_millis(Timestamp::now().as_millis() - 3_600_000);
    let later = Timestamp::from_millis(Timestamp::now().as_millis() + 3_600_000);
    assert_eq!(inbox.purge(earlier, 10).await.expect("purge"), 0);
    assert_eq!(inbox.purge(later, 0).await.expect("purge"), 0);
    assert_eq!(inbox.purge(later, 2).await.expect("purge"), 2);
    assert_eq!(inbox.purge(later, 10).await.expect("purge"), 3);
    assert_eq!(inbox.purge(later, 10).await.expect("purge"), 0);
    let again = receive(sut, "billing", ids[0], LIMIT, Then::Ok, &runs).await;
    assert_eq!(again, InboxOutcome::Committed, "a purged entry is gone");
}
