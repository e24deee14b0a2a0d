//! One guarded handler run for every place that runs user code on a
//! message: the relay's dispatcher, the RabbitMQ consumer, applications'
//! own receivers. A handler's error, panic or timeout becomes a
//! [`HandlerOutcome`]; an error that says [`TemporarilyUnavailable`] becomes
//! an uncounted retry.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures_util::FutureExt;

use crate::dispatch::{HandlerError, error_chain, panic_message};

/// A handler's way to say "not now, and not this message's fault": its
/// downstream (a database, an HTTP service) is down for a while.
///
/// Return it (or any error whose [`source`](std::error::Error::source)
/// chain contains it) and the message is retried later with backoff,
/// **without** counting an attempt, so an outage of a handler's
/// dependency never poisons or dead-letters good messages. The relay
/// reports it in health until the type's handler succeeds again. Because it
/// is never counted, a handler that says this forever keeps its message
/// (and its key) waiting forever: the backlog-age alert of health is what
/// then tells an operator.
///
/// ```
/// # use outbox_api::TemporarilyUnavailable;
/// # use std::time::Duration;
/// let e = TemporarilyUnavailable::new("the payment service answers 503")
///     .retry_after(Duration::from_secs(10));
/// assert_eq!(e.to_string(), "temporarily unavailable: the payment service answers 503");
/// ```
#[derive(Debug)]
pub struct TemporarilyUnavailable {
    reason: String,
    retry_after: Option<Duration>,
    source: Option<HandlerError>,
}

impl TemporarilyUnavailable {
    /// Unavailable for `reason`; the caller's backoff decides when to retry.
    pub fn new(reason: impl Into<String>) -> Self {
        TemporarilyUnavailable {
            reason: reason.into(),
            retry_after: None,
            source: None,
        }
    }

    /// Unavailable because of `source` (its text becomes the reason).
    pub fn caused_by(source: impl Into<HandlerError>) -> Self {
        let source = source.into();
        TemporarilyUnavailable {
            reason: error_chain(&*source),
            retry_after: None,
            source: Some(source),
        }
    }

    /// Asks for the next try no sooner than `delay` from now.
    pub fn retry_after(mut self, delay: Duration) -> Self {
        self.retry_after = Some(delay);
        self
    }

    /// Why.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// The delay the handler asked for, if any.
    pub fn requested_delay(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The `TemporarilyUnavailable` in `error` or in its source chain.
    pub fn find<'a>(
        error: &'a (dyn std::error::Error + 'static),
    ) -> Option<&'a TemporarilyUnavailable> {
        let mut next = Some(error);
        while let Some(e) = next {
            if let Some(u) = e.downcast_ref::<TemporarilyUnavailable>() {
                return Some(u);
            }
            next = e.source();
        }
        None
    }
}

impl fmt::Display for TemporarilyUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "temporarily unavailable: {}", self.reason)
    }
}

impl std::error::Error for TemporarilyUnavailable {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// How one guarded handler run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandlerOutcome {
    /// The handler returned `Ok`.
    Succeeded,
    /// The handler returned an error, panicked or timed out: a counted
    /// failure. Holds the error text (the whole source chain).
    Failed(String),
    /// The handler said [`TemporarilyUnavailable`]: retry later, uncounted.
    Unavailable {
        /// Why (the error text).
        reason: String,
        /// The delay the handler asked for, if any.
        retry_after: Option<Duration>,
    },
}

impl HandlerOutcome {
    /// The outcome of a handler's result (no panic, no timeout).
    pub fn of(result: Result<(), HandlerError>) -> Self {
        match result {
            Ok(()) => HandlerOutcome::Succeeded,
            Err(e) => match TemporarilyUnavailable::find(&*e) {
                Some(u) => HandlerOutcome::Unavailable {
                    reason: error_chain(&*e),
                    retry_after: u.retry_after,
                },
                None => HandlerOutcome::Failed(error_chain(&*e)),
            },
        }
    }

    /// A short name for logs and spans.
    pub fn name(&self) -> &'static str {
        match self {
            HandlerOutcome::Succeeded => "delivered",
            HandlerOutcome::Failed(_) => "failed",
            HandlerOutcome::Unavailable { .. } => "unavailable",
        }
    }
}

/// Runs a handler's future with a time limit, catching a panic: the one
/// guarded run every caller of user handlers uses.
///
/// * `Ok` → [`HandlerOutcome::Succeeded`];
/// * an error → `Failed` with its whole source chain, or `Unavailable`
///   when the chain holds a [`TemporarilyUnavailable`];
/// * a panic → `Failed("handler panicked: …")`;
/// * no result within `timeout` → `Failed("handler timed out after …")`
///   (the future is dropped).
pub async fn run_guarded<F>(timeout: Duration, handler: F) -> HandlerOutcome
where
    F: Future<Output = Result<(), HandlerError>>,
{
    match tokio::time::timeout(timeout, AssertUnwindSafe(handler).catch_unwind()).await {
        Ok(Ok(result)) => HandlerOutcome::of(result),
        Ok(Err(panic)) => {
            HandlerOutcome::Failed(format!("handler panicked: {}", panic_message(&*panic)))
        }
        Err(_) => HandlerOutcome::Failed(format!("handler timed out after {timeout:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Wrapper(HandlerError);
    impl fmt::Display for Wrapper {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("calling the warehouse")
        }
    }
    impl std::error::Error for Wrapper {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&*self.0)
        }
    }

    #[tokio::test]
    async fn every_ending_has_its_outcome() {
        let t = Duration::from_secs(5);
        assert_eq!(
            run_guarded(t, async { Ok(()) }).await,
            HandlerOutcome::Succeeded
        );
        assert_eq!(
            run_guarded(t, async { Err(std::io::Error::other("boom").into()) }).await,
            HandlerOutcome::Failed("boom".into())
        );
        let panicked = run_guarded(t, async {
            if true {
                panic!("handler blew up");
            }
            Ok(())
        })
        .await;
        assert_eq!(
            panicked,
            HandlerOutcome::Failed("handler panicked: handler blew up".into())
        );
        let slow = run_guarded(Duration::from_millis(10), async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok(())
        })
        .await;
        assert!(matches!(slow, HandlerOutcome::Failed(e) if e.contains("timed out after 10ms")));
    }

    #[tokio::test]
    async fn unavailable_is_found_in_the_source_chain() {
        let t = Duration::from_secs(5);
        let direct = run_guarded(t, async {
            Err(TemporarilyUnavailable::new("503")
                .retry_after(Duration::from_secs(3))
                .into())
        })
        .await;
        assert_eq!(
            direct,
            HandlerOutcome::Unavailable {
                reason: "temporarily unavailable: 503".into(),
                retry_after: Some(Duration::from_secs(3)),
            }
        );
        let wrapped = run_guarded(t, async {
            Err(Wrapper(Box::new(TemporarilyUnavailable::caused_by(
                std::io::Error::other("connection refused"),
            )))
            .into())
        })
        .await;
        assert_eq!(
            wrapped,
            HandlerOutcome::Unavailable {
                reason: "calling the warehouse: temporarily unavailable: connection refused".into(),
                retry_after: None,
            }
        );
    }
}
