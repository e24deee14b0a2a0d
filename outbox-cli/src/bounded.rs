//! Running many futures a few at a time, without a task each: how
//! `outbox outboxes` reads many schemas' outboxes — not one by one, and not
//! all at once.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

/// Runs `futures`, at most `limit` at a time (at least one), started in
/// their order, and gives their outputs in that order. They run inside the
/// caller's task: nothing is spawned, so they may borrow.
pub(crate) async fn bounded<F: Future>(limit: usize, futures: Vec<F>) -> Vec<F::Output> {
    let limit = limit.max(1);
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    let mut waiting = futures.into_iter().enumerate();
    let mut running: Vec<(usize, Pin<Box<F>>)> = Vec::with_capacity(limit);
    std::future::poll_fn(|cx| {
        loop {
            while running.len() < limit {
                match waiting.next() {
                    Some((i, f)) => running.push((i, Box::pin(f))),
                    None => break,
                }
            }
            if running.is_empty() {
                return Poll::Ready(());
            }
            let before = running.len();
            running.retain_mut(|(i, f)| match f.as_mut().poll(cx) {
                Poll::Ready(output) => {
                    outputs[*i] = Some(output);
                    false
                }
                Poll::Pending => true,
            });
            // Nothing finished: every running future will wake the task.
            if running.len() == before {
                return Poll::Pending;
            }
        }
    })
    .await;
    outputs
        .into_iter()
        .map(|o| o.expect("every future ran to its end"))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// At most `limit` run at once, and the outputs keep the order even
    /// when later futures finish first.
    #[tokio::test]
    async fn a_few_at_a_time_in_order() {
        for limit in [0, 1, 3, 20] {
            let now = Cell::new(0usize);
            let most = Cell::new(0usize);
            let futures: Vec<_> = (0..10usize)
                .map(|i| {
                    let (now, most) = (&now, &most);
                    async move {
                        now.set(now.get() + 1);
                        most.set(most.get().max(now.get()));
                        // The first ones take longest.
                        for _ in 0..(10 - i) {
                            tokio::task::yield_now().await;
                        }
                        now.set(now.get() - 1);
                        i * 2
                    }
                })
                .collect();
            let out = bounded(limit, futures).await;
            assert_eq!(out, (0..10).map(|i| i * 2).collect::<Vec<_>>());
            assert_eq!(most.get(), limit.clamp(1, 10), "limit {limit}");
        }
        assert!(
            bounded::<std::future::Ready<()>>(4, Vec::new())
                .await
                .is_empty()
        );
    }
}
