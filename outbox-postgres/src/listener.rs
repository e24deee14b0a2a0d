//! [`PgWorkListener`]: wakes a relay on in-process commits at once, on
//! other processes' commits through `LISTEN` (a connection of its own, or
//! one shared with other outboxes of the database), and polls when it
//! cannot listen.

use std::time::Duration;

use async_trait::async_trait;
use outbox_api::WorkListener;
use outbox_api::backend::{Wakeup, WakeupListener};
use sqlx::postgres::PgConnectOptions;

use crate::shared_listener::{PgSharedListener, Subscription};

/// How a store's relays learn about commits made by other processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum WakeUp {
    /// `LISTEN` on the table's channel (one connection per listening
    /// relay, or one for all the stores built with the same
    /// [`PgSharedListener`]), polling only while that connection is down.
    /// The default.
    #[default]
    ListenNotify,
    /// Never `LISTEN`: poll every `poll_interval`. For connections through
    /// PgBouncer in transaction mode, where `LISTEN` does not work.
    /// Commits in this process still wake its relays at once.
    PollOnly,
}

/// A [`WorkListener`] for a PostgreSQL outbox, returned by
/// [`PgStore::listen`](outbox_api::Store::listen).
///
/// It reports a change:
/// * at once, when an enqueue through a [`PgOutbox`](crate::PgOutbox) of
///   this process has committed, or an operator action or a release made
///   messages claimable;
/// * when a notification arrives on the table's channel (sent after commit
///   by the announcing process, debounced);
/// * whenever its `LISTEN` connection is (re)established — notifications
///   sent while it was down are lost, so the relay claims once to catch up;
/// * every `poll_interval` while it cannot listen, and always with
///   [`WakeUp::PollOnly`].
///
/// The `LISTEN` connection lives in a task of its own, so `wait` is
/// cancel-safe; dropping the listener gives up its channel (and ends the
/// connection when it was its own).
pub struct PgWorkListener {
    local: WakeupListener,
    remote: Option<Subscription>,
    poll: Duration,
}

impl std::fmt::Debug for PgWorkListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgWorkListener")
            .field("listening", &self.is_listening())
            .field("poll", &self.poll)
            .finish_non_exhaustive()
    }
}

impl PgWorkListener {
    /// A listener on `channel` through `shared`, or through a connection of
    /// its own to the database of `options` when `shared` is `None`;
    /// notifications carrying `token` (its store's announcer's) are
    /// skipped, since `local` has woken it for each already.
    pub(crate) fn new(
        local: &Wakeup,
        mode: WakeUp,
        options: &PgConnectOptions,
        shared: Option<&PgSharedListener>,
        channel: &str,
        token: &str,
        poll: Duration,
    ) -> Self {
        let remote = match mode {
            WakeUp::PollOnly => None,
            WakeUp::ListenNotify => {
                let own;
                let through = match shared {
                    Some(shared) => shared,
                    None => {
                        own = PgSharedListener::with_options(options);
                        &own
                    }
                };
                let subscription = through.subscribe(channel, token);
                if subscription.is_none() {
                    tracing::warn!("outbox listener created outside a tokio runtime; it polls");
                }
                subscription
            }
        };
        PgWorkListener {
            local: local.listener(),
            remote,
            poll,
        }
    }

    /// Whether its `LISTEN` connection is up.
    pub fn is_listening(&self) -> bool {
        self.remote.as_ref().is_some_and(Subscription::is_listening)
    }

    /// Takes a change reported and not yet seen.
    fn take_change(&mut self) -> bool {
        let local = self.local.take_change();
        let remote = match &mut self.remote {
            Some(s) if s.changes.has_changed().unwrap_or(false) => {
                s.changes.borrow_and_update();
                true
            }
            _ => false,
        };
        local || remote
    }
}

#[async_trait]
impl WorkListener for PgWorkListener {
    async fn wait(&mut self, timeout: Duration) -> bool {
        if self.take_change() {
            return true;
        }
        if let Some(s) = &self.remote {
            s.keep_running();
        }
        let polling = !self.is_listening();
        let (nap, on_nap) = if polling && self.poll < timeout {
            (self.poll, true)
        } else {
            (timeout, false)
        };
        let Self { local, remote, .. } = self;
        let remote = async {
            match remote {
                Some(s) => {
                    if s.changes.changed().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                    s.changes.borrow_and_update();
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = local.changed() => true,
            _ = remote => true,
            _ = tokio::time::sleep(nap) => on_nap,
        }
    }
}
