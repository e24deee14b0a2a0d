//! `--orders N`: places N orders, waits until every saga ended, and
//! summarises what happened and how fast.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::time::{Duration, Instant};

use tokio::sync::Mutex;
use tracing::Instrument;
use uuid::Uuid;

use crate::fail::Fail;
use crate::ordering::{PlaceError, SagaCounts};
use crate::shop::Shop;

/// What `--orders` was asked to do.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Orders to place.
    pub orders: u64,
    /// Orders per second (`None`: as fast as they commit).
    pub rate: Option<f64>,
    /// How many orders may be being placed at once (the shop's customers
    /// at the checkout). One would be a closed loop: each order waits for
    /// the one before to commit, so the offered rate could never exceed
    /// one commit's time and any slow commit would delay every later order.
    pub placers: usize,
    /// Give up (exit non-zero) after this long.
    pub timeout: Duration,
    /// Sample how often each module's application pool is all in use.
    pub sample_pools: bool,
}

/// The outcome of a load run.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Orders placed.
    pub orders: u64,
    /// Final saga states.
    pub counts: SagaCounts,
    /// commit → OrderConfirmed handled: (samples, p50, p99, max).
    pub latency: (u64, Duration, Duration, Duration),
    /// Messages this process's relays delivered during the run.
    pub messages: u64,
    /// Which messages those are.
    pub relayed: &'static str,
    /// From the first order's placement to the last saga's end.
    pub elapsed: Duration,
    /// Which bus.
    pub bus: String,
    /// The pace orders were offered at (`None`: all at once).
    pub rate: Option<f64>,
    /// With `sample_pools`: each module and the share of samples (%) that
    /// found its application pool all in use.
    pub pools: Vec<(&'static str, f64)>,
}

fn ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1000.0;
    if ms < 10.0 {
        format!("{ms:.2} ms")
    } else {
        format!("{ms:.1} ms")
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        let (n, p50, p99, max) = self.latency;
        writeln!(f, "MiniShop: {} orders through {}", self.orders, self.bus)?;
        match self.rate {
            Some(r) => writeln!(f, "  offered        {r} orders/s")?,
            None => writeln!(
                f,
                "  offered        all at once (a burst; --rate N paces them)"
            )?,
        }
        writeln!(f, "  confirmed      {}", self.counts.confirmed)?;
        writeln!(f, "  cancelled      {}", self.counts.cancelled)?;
        writeln!(
            f,
            "  latency p50    {}   (order commit -> OrderConfirmed handled, {n} orders)",
            ms(p50)
        )?;
        writeln!(f, "  latency p99    {}   (max {})", ms(p99), ms(max))?;
        writeln!(
            f,
            "  messages       {}   ({:.0} msg/s: {})",
            self.messages,
            self.messages as f64 / secs,
            self.relayed
        )?;
        write!(
            f,
            "  elapsed        {:.3} s   ({:.0} orders/s)",
            secs,
            self.orders as f64 / secs
        )?;
        if !self.pools.is_empty() {
            let shares: Vec<String> = self
                .pools
                .iter()
                .map(|(name, share)| format!("{name} {share:.0} %"))
                .collect();
            write!(
                f,
                "\n  pools in use   {}   (share of samples, one a millisecond, with every application connection busy)",
                shares.join(", ")
            )?;
        }
        Ok(())
    }
}

/// Samples every millisecond (the timer's resolution), until dropped, whether each module's application
/// pool has every connection in use.
struct PoolSampler {
    counts: Arc<Vec<AtomicU64>>,
    names: Vec<&'static str>,
    task: AbortOnDrop<()>,
}

impl PoolSampler {
    fn start(shop: &Shop) -> Self {
        let mut modules = vec![("ordering", shop.ordering.database().clone())];
        if let Some((warehouse, _)) = &shop.warehouse {
            modules.push(("warehouse", warehouse.database().clone()));
        }
        // The samples, then each module's count of saturated ones.
        let counts: Arc<Vec<AtomicU64>> =
            Arc::new((0..=modules.len()).map(|_| AtomicU64::new(0)).collect());
        let names = modules.iter().map(|(name, _)| *name).collect();
        let task = {
            let counts = Arc::clone(&counts);
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_millis(1));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    counts[0].fetch_add(1, AtomicOrdering::Relaxed);
                    for (i, (_, db)) in modules.iter().enumerate() {
                        if db.pool_saturated() {
                            counts[i + 1].fetch_add(1, AtomicOrdering::Relaxed);
                        }
                    }
                }
            })
        };
        PoolSampler {
            counts,
            names,
            task: AbortOnDrop(task),
        }
    }

    /// Stops sampling: each module's share (%) of saturated samples.
    fn finish(self) -> Vec<(&'static str, f64)> {
        drop(self.task);
        let all = self.counts[0].load(AtomicOrdering::Relaxed).max(1) as f64;
        self.names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let busy = self.counts[i + 1].load(AtomicOrdering::Relaxed) as f64;
                (*name, busy * 100.0 / all)
            })
            .collect()
    }
}

/// The demo's order mix: mostly fruit (plenty in stock), some teapots and
/// golden tickets (few in stock) — so some orders are confirmed and some
/// cancelled.
pub fn order_for(i: u64) -> (String, &'static str, u32) {
    let sku = match i % 10 {
        0..=5 => {
            if i % 2 == 0 {
                "apple"
            } else {
                "pear"
            }
        }
        6..=8 => "teapot",
        _ => "golden-ticket",
    };
    let qty = 1 + (i % 3) as u32;
    (format!("customer-{}", i % 17), sku, qty)
}

/// One placed order's outcome, its task's failure included.
fn flatten(done: Result<Result<(), Fail>, tokio::task::JoinError>) -> Result<(), Fail> {
    done.map_err(|e| Fail(format!("placing an order failed: {e}")))?
}

/// Stops the order placer when the run ends early (error, timeout).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[derive(Debug, Default)]
struct Placed {
    count: AtomicU64,
    /// The lowest and highest order id placed (placed in parallel, they
    /// commit out of order).
    first: Mutex<Option<Uuid>>,
    last: Mutex<Option<Uuid>>,
}

impl Placed {
    async fn add(&self, id: Uuid) {
        let mut first = self.first.lock().await;
        *first = Some(first.map_or(id, |f| f.min(id)));
        let mut last = self.last.lock().await;
        *last = Some(last.map_or(id, |l| l.max(id)));
        self.count.fetch_add(1, AtomicOrdering::SeqCst);
    }
}

/// Runs the load: places the orders, prints a progress line every second
/// on stderr, and returns the summary once every saga ended — or, at the
/// timeout, an error saying what is stuck.
pub async fn run(shop: &Shop, opts: LoadOptions) -> Result<Summary, Fail> {
    let ordering = Arc::clone(&shop.ordering);
    ordering.latency.enable();
    let relayed_before = shop.relayed();
    let start = Instant::now();
    let deadline = start + opts.timeout;
    let placed = Arc::new(Placed::default());
    let sampler = opts.sample_pools.then(|| PoolSampler::start(shop));

    let placer = {
        let placed = Arc::clone(&placed);
        let ordering = Arc::clone(&ordering);
        tokio::spawn(async move {
            // Each order starts at its time (with --rate) as one of at most
            // `placers` being placed at once.
            let slots = Arc::new(tokio::sync::Semaphore::new(opts.placers.max(1)));
            let mut placing = tokio::task::JoinSet::new();
            for i in 0..opts.orders {
                if let Some(rate) = opts.rate {
                    let due = start + Duration::from_secs_f64(i as f64 / rate);
                    tokio::time::sleep_until(due.into()).await;
                }
                let slot = Arc::clone(&slots)
                    .acquire_owned()
                    .await
                    .map_err(|e| Fail(format!("the order placer: {e}")))?;
                // A failed order ends the run.
                while let Some(done) = placing.try_join_next() {
                    flatten(done)?;
                }
                let (placed, ordering) = (Arc::clone(&placed), Arc::clone(&ordering));
                placing.spawn(async move {
                    let (customer, sku, qty) = order_for(i);
                    // Each order's saga is one trace, rooted here (over
                    // HTTP, in the request's span).
                    let span = tracing::info_span!("minishop.place_order", order.index = i);
                    let id = match ordering
                        .place_order(&customer, sku, qty, true)
                        .instrument(span)
                        .await
                    {
                        Ok((id, _)) => id,
                        Err(PlaceError::Invalid(e)) => return Err(Fail(e.0)),
                        Err(PlaceError::Store(e)) => {
                            return Err(Fail(format!("placing an order: {e}")));
                        }
                    };
                    placed.add(id).await;
                    drop(slot);
                    Ok(())
                });
            }
            while let Some(done) = placing.join_next().await {
                flatten(done)?;
            }
            Ok(())
        })
    };
    let mut placer = Some(AbortOnDrop(placer));

    let mut next_progress = start + Duration::from_secs(1);
    // The `orders` table is read (a count over the run's orders, on the
    // module's one connection, which the sagas need) every `RECOUNT`, and
    // every `SETTLING` once the sagas this process saw end say the run may
    // be over. Read at each saga's end, it took that connection from the
    // sagas themselves.
    const RECOUNT: Duration = Duration::from_millis(100);
    const SETTLING: Duration = Duration::from_millis(5);
    let mut next_count = start;
    let mut counts = SagaCounts::default();
    loop {
        // Placement finished (or failed)?
        if let Some(p) = placer.as_ref() {
            if p.0.is_finished() {
                let mut p = placer.take().expect("checked above");
                match (&mut p.0).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(e),
                    Err(e) => return Err(Fail(format!("the order placer failed: {e}"))),
                }
            }
        }
        let n = placed.count.load(AtomicOrdering::SeqCst);
        let settling = placer.is_none() && ordering.progress.ended() >= opts.orders;
        if settling || Instant::now() >= next_count {
            let range = (*placed.first.lock().await, *placed.last.lock().await);
            if let (Some(first), Some(last)) = range {
                counts = ordering.saga_counts(first, last).await.map_err(Fail)?;
            }
            if placer.is_none() && counts.ended() >= opts.orders {
                break;
            }
            next_count = Instant::now() + if settling { SETTLING } else { RECOUNT };
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(stuck(shop, opts, n, counts).await);
        }
        if now >= next_progress {
            // The backlog only: counting processed rows grows with the run.
            let pending = |s: outbox::Result<outbox::Backlog>| {
                s.map(|s| s.pending.to_string())
                    .unwrap_or_else(|_| "?".into())
            };
            let mut backlog = format!(
                "ordering {}",
                pending(shop.ordering.database().store().backlog().await)
            );
            if let Some((warehouse, _)) = &shop.warehouse {
                let w = warehouse.database().store().backlog().await;
                backlog.push_str(&format!(", warehouse {}", pending(w)));
            }
            eprintln!(
                "[{:>5.1}s] placed {n}/{}, ended {} (confirmed {}, cancelled {}); outbox pending: {backlog}",
                now.duration_since(start).as_secs_f64(),
                opts.orders,
                counts.ended(),
                counts.confirmed_handled,
                counts.cancelled,
            );
            next_progress += Duration::from_secs(1);
        }
        let wait = next_count
            .min(deadline)
            .saturating_duration_since(now)
            .max(Duration::from_millis(1));
        let _ = tokio::time::timeout(wait, ordering.progress.changed()).await;
    }
    let elapsed = start.elapsed();
    let pools = sampler.map(PoolSampler::finish).unwrap_or_default();
    // The last completions may still be in flight: let the relays finish
    // their current drain so that every message of the run is counted.
    let settle = async {
        let _ = shop.ordering_relay.until_idle().await;
        if let Some((_, relay)) = &shop.warehouse {
            let _ = relay.until_idle().await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), settle).await;
    Ok(Summary {
        orders: opts.orders,
        counts,
        latency: ordering.latency.summary(),
        messages: shop.relayed() - relayed_before,
        relayed: if shop.warehouse.is_some() {
            "OrderPlaced, StockReserved/StockRejected, OrderConfirmed"
        } else {
            "OrderPlaced, OrderConfirmed; the warehouse processes relay the answers"
        },
        elapsed,
        bus: shop.bus_description.clone(),
        rate: opts.rate,
        pools,
    })
}

async fn stuck(shop: &Shop, opts: LoadOptions, placed: u64, c: SagaCounts) -> Fail {
    let mut text = format!(
        "timed out after {:?}: {} of {} sagas ended ({placed} orders placed; {} waiting for the warehouse, {} confirmed but OrderConfirmed not handled yet; {} confirmed, {} cancelled)",
        opts.timeout,
        c.ended(),
        opts.orders,
        c.pending,
        c.confirmed - c.confirmed_handled,
        c.confirmed_handled,
        c.cancelled,
    );
    for line in shop.describe().await {
        text.push_str("\n  ");
        text.push_str(&line);
    }
    Fail(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mix_has_scarce_and_plentiful_skus() {
        let skus: Vec<&str> = (0..10).map(|i| order_for(i).1).collect();
        assert!(skus.contains(&"apple") && skus.contains(&"pear"));
        assert!(skus.contains(&"teapot") && skus.contains(&"golden-ticket"));
        assert!((0..100).all(|i| (1..=3).contains(&order_for(i).2)));
    }
}
