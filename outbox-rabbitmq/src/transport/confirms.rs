//! The one observer of a confirm channel's publishes.
//!
//! lapin hands a returned (unroutable) message to whichever confirm it
//! completes next, which may be another message's — with concurrent sends,
//! another call's. So no caller awaits its own confirms: every publish is
//! handed to the channel's [`Confirms`] task, which awaits them all, matches
//! returned messages to their publish by message id and only then tells each
//! caller what became of its message.
//!
//! A returned message is attached to a confirm completed no later than its
//! own. The task therefore settles a message only after it has taken in every
//! publish already handed over and polled every confirm that is ready, and
//! while no publish is between "frames queued in lapin" and "handed over".
//! Once a publish is handed over, a cancelled `send` no longer affects it.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::FutureExt;
use futures_util::stream::{FuturesUnordered, StreamExt};
use lapin::{Confirmation, PublisherConfirm};
use tokio::sync::{Notify, oneshot, watch};

use super::classify::Returned;

/// A `basic.publish` in progress, owning what it publishes.
pub(super) type Publishing = Pin<Box<dyn Future<Output = lapin::Result<PublisherConfirm>> + Send>>;

/// What became of one publish.
#[derive(Debug)]
pub(super) enum Settled {
    /// The broker confirmed it and did not return it.
    Ack,
    /// The broker returned it as unroutable.
    Returned(Returned),
    /// The broker refused it (nack).
    Nack,
    /// The publish or its confirm failed.
    Failed(lapin::Error),
    /// The connection was given up while it was in flight.
    Dropped,
}

type Waiting = Pin<Box<dyn Future<Output = (u64, lapin::Result<Confirmation>)> + Send>>;

/// Shared between the publishers and the observing task.
pub(super) struct Confirms {
    book: Mutex<Book>,
    wake: Notify,
}

#[derive(Default)]
struct Book {
    /// Publishes whose frames may be queued but that are not handed over yet.
    publishing: usize,
    incoming: Vec<Tracked>,
    /// The channel was replaced: end once everything is settled.
    retired: bool,
}

struct Tracked {
    message_id: String,
    waiting: Pin<Box<dyn Future<Output = lapin::Result<Confirmation>> + Send>>,
    reply: oneshot::Sender<Settled>,
}

impl Confirms {
    /// Starts the observer of a new confirm channel. It gives up everything
    /// in flight (as [`Settled::Dropped`]) when `connection_dropped` closes.
    pub(super) fn start(connection_dropped: watch::Receiver<()>) -> Arc<Confirms> {
        let confirms = Arc::new(Confirms {
            book: Mutex::new(Book::default()),
            wake: Notify::new(),
        });
        tokio::spawn(Arc::clone(&confirms).observe(connection_dropped));
        confirms
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts `publish` (its frames are queued in lapin, in call order, before
    /// this returns) and hands it over. Does not wait: the answer comes on the
    /// returned receiver. `Err` when lapin refused the publish at once (e.g.
    /// the channel is closed); then nothing was sent.
    pub(super) fn publish(
        &self,
        message_id: String,
        mut publish: Publishing,
    ) -> Result<oneshot::Receiver<Settled>, lapin::Error> {
        self.book().publishing += 1;
        let first = publish
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()));
        let waiting: Pin<Box<dyn Future<Output = _> + Send>> = match first {
            Poll::Ready(Err(e)) => {
                self.book().publishing -= 1;
                self.wake.notify_one();
                return Err(e);
            }
            Poll::Ready(Ok(confirm)) => Box::pin(confirm),
            Poll::Pending => Box::pin(async move { publish.await?.await }),
        };
        let (reply, answer) = oneshot::channel();
        {
            let mut book = self.book();
            book.publishing -= 1;
            book.incoming.push(Tracked {
                message_id,
                waiting,
                reply,
            });
        }
        self.wake.notify_one();
        Ok(answer)
    }

    /// The channel is no longer used for new publishes.
    pub(super) fn retire(&self) {
        self.book().retired = true;
        self.wake.notify_one();
    }

    async fn observe(self: Arc<Self>, mut connection_dropped: watch::Receiver<()>) {
        let mut running: FuturesUnordered<Waiting> = FuturesUnordered::new();
        let mut owners: HashMap<u64, (String, oneshot::Sender<Settled>)> = HashMap::new();
        let mut ready: Vec<(u64, lapin::Result<Confirmation>)> = Vec::new();
        // By message id; a list in case one message is in flight twice.
        let mut returned: HashMap<String, Vec<Returned>> = HashMap::new();
        let mut next: u64 = 0;
        loop {
            let incoming = std::mem::take(&mut self.book().incoming);
            for tracked in incoming {
                let n = next;
                next += 1;
                owners.insert(n, (tracked.message_id, tracked.reply));
                running.push(Box::pin(tracked.waiting.map(move |r| (n, r))));
            }
            for done in drain_ready(&mut running) {
                note_return(&done.1, &mut returned);
                ready.push(done);
            }
            let (quiet, retired) = {
                let book = self.book();
                (
                    book.publishing == 0 && book.incoming.is_empty(),
                    book.retired,
                )
            };
            if quiet {
                for (n, result) in ready.drain(..) {
                    let Some((message_id, reply)) = owners.remove(&n) else {
                        continue;
                    };
                    let mut own_return = || {
                        let list = returned.get_mut(&message_id)?;
                        let r = list.pop();
                        if list.is_empty() {
                            returned.remove(&message_id);
                        }
                        r
                    };
                    let settled = match result {
                        Ok(Confirmation::Ack(_)) => {
                            own_return().map_or(Settled::Ack, Settled::Returned)
                        }
                        Ok(Confirmation::Nack(_)) => {
                            own_return().map_or(Settled::Nack, Settled::Returned)
                        }
                        Ok(Confirmation::NotRequested) => Settled::Failed(lapin::Error::from(
                            lapin::ErrorKind::InvalidChannelState(
                                lapin::ChannelState::Connected,
                                "the channel is not in confirm mode",
                            ),
                        )),
                        Err(e) => Settled::Failed(e),
                    };
                    // The caller may have gone (a cancelled send).
                    let _ = reply.send(settled);
                }
                if owners.is_empty() {
                    for (id, _) in returned.drain() {
                        tracing::warn!(message_id = %id, "RabbitMQ returned a message no publish is waiting for");
                    }
                    if retired {
                        return;
                    }
                }
            }
            tokio::select! {
                biased;
                _ = connection_dropped.changed() => {
                    for (_, (_, reply)) in owners.drain() {
                        let _ = reply.send(Settled::Dropped);
                    }
                    let incoming = std::mem::take(&mut self.book().incoming);
                    for tracked in incoming {
                        let _ = tracked.reply.send(Settled::Dropped);
                    }
                    return;
                }
                _ = self.wake.notified() => {}
                Some(done) = running.next(), if !running.is_empty() => {
                    note_return(&done.1, &mut returned);
                    ready.push(done);
                }
            }
        }
    }
}

/// Everything in `running` that is ready now. Unlike polling until the
/// first `Pending`, this goes on past `FuturesUnordered`'s cooperative
/// yields (a `Pending` after waking itself).
fn drain_ready(running: &mut FuturesUnordered<Waiting>) -> Vec<(u64, lapin::Result<Confirmation>)> {
    let mut done = Vec::new();
    loop {
        let woken = Arc::new(Woken::default());
        let waker = Waker::from(Arc::clone(&woken));
        match running.poll_next_unpin(&mut Context::from_waker(&waker)) {
            Poll::Ready(Some(d)) => done.push(d),
            Poll::Ready(None) => return done,
            Poll::Pending if woken.0.load(Ordering::SeqCst) => {}
            Poll::Pending => return done,
        }
    }
}

/// A waker that only remembers it was woken.
#[derive(Default)]
struct Woken(AtomicBool);

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Keeps a returned message, whichever confirm carried it.
fn note_return(
    result: &lapin::Result<Confirmation>,
    returned: &mut HashMap<String, Vec<Returned>>,
) {
    if let Ok(Confirmation::Ack(Some(r)) | Confirmation::Nack(Some(r))) = result {
        let r = Returned::from_lapin(r);
        returned.entry(r.message_id.clone()).or_default().push(r);
    }
}
