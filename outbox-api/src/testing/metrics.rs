//! A metrics recorder for tests: it keeps what was recorded and reads it
//! back without resetting it (unlike `metrics-util`'s `DebuggingRecorder`,
//! whose snapshots zero counters and gauges), so a test can wait for a
//! gauge and still read every counter afterwards.
//!
//! Install it for one test only with [`TestRecorder::block_on`]: a
//! current-thread tokio runtime run inside `metrics::with_local_recorder`,
//! so every task of that runtime records into it and no other test does.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_util::registry::{AtomicStorage, Registry};

/// A recorder that keeps every value; see the [module](self) docs.
#[derive(Clone)]
pub struct TestRecorder {
    registry: Arc<Registry<Key, AtomicStorage>>,
}

impl std::fmt::Debug for TestRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestRecorder")
            .field("metrics", &self.keys())
            .finish()
    }
}

impl Default for TestRecorder {
    fn default() -> Self {
        Self::new()
    }
}

/// Whether `key` has exactly the labels `labels`.
fn same_labels(key: &Key, labels: &[(&str, &str)]) -> bool {
    let mut have: Vec<(&str, &str)> = key.labels().map(|l| (l.key(), l.value())).collect();
    let mut want = labels.to_vec();
    have.sort_unstable();
    want.sort_unstable();
    have == want
}

impl TestRecorder {
    /// An empty recorder.
    pub fn new() -> Self {
        TestRecorder {
            registry: Arc::new(Registry::atomic()),
        }
    }

    /// Runs `future` on a fresh current-thread runtime with this recorder
    /// installed for the calling thread only (`metrics::with_local_recorder`):
    /// every task of the runtime records here. Work on other threads
    /// (`spawn_blocking`, other runtimes) does not.
    pub fn block_on<F: Future>(&self, future: F) -> F::Output {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("building a tokio runtime for a metrics test");
        metrics::with_local_recorder(self, || rt.block_on(future))
    }

    /// Every metric recorded so far, as `kind name{labels}`, sorted (for
    /// failure messages).
    pub fn keys(&self) -> Vec<String> {
        let mut all: Vec<String> = Vec::new();
        let show = |kind: &str, k: &Key| format!("{kind} {k}");
        all.extend(
            self.registry
                .get_counter_handles()
                .keys()
                .map(|k| show("counter", k)),
        );
        all.extend(
            self.registry
                .get_gauge_handles()
                .keys()
                .map(|k| show("gauge", k)),
        );
        all.extend(
            self.registry
                .get_histogram_handles()
                .keys()
                .map(|k| show("histogram", k)),
        );
        all.sort();
        all
    }

    /// The counter `name` with exactly `labels`, if it was registered.
    pub fn try_counter(&self, name: &str, labels: &[(&str, &str)]) -> Option<u64> {
        self.registry
            .get_counter_handles()
            .into_iter()
            .find(|(k, _)| k.name() == name && same_labels(k, labels))
            .map(|(_, v)| v.load(Ordering::SeqCst))
    }

    /// The counter `name` with exactly `labels`; panics, listing what was
    /// recorded, if there is none.
    #[track_caller]
    pub fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.try_counter(name, labels)
            .unwrap_or_else(|| panic!("no counter {name} {labels:?}; recorded: {:#?}", self.keys()))
    }

    /// The gauge `name` with exactly `labels`, if it was registered.
    pub fn try_gauge(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.registry
            .get_gauge_handles()
            .into_iter()
            .find(|(k, _)| k.name() == name && same_labels(k, labels))
            .map(|(_, v)| f64::from_bits(v.load(Ordering::SeqCst)))
    }

    /// The gauge `name` with exactly `labels`; panics, listing what was
    /// recorded, if there is none.
    #[track_caller]
    pub fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.try_gauge(name, labels)
            .unwrap_or_else(|| panic!("no gauge {name} {labels:?}; recorded: {:#?}", self.keys()))
    }

    /// The values recorded in histogram `name` with exactly `labels`, in
    /// no particular order, if it was registered.
    pub fn try_histogram(&self, name: &str, labels: &[(&str, &str)]) -> Option<Vec<f64>> {
        self.registry
            .get_histogram_handles()
            .into_iter()
            .find(|(k, _)| k.name() == name && same_labels(k, labels))
            .map(|(_, v)| v.data())
    }

    /// The values of histogram `name` with exactly `labels`; panics,
    /// listing what was recorded, if there is none.
    #[track_caller]
    pub fn histogram(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        self.try_histogram(name, labels).unwrap_or_else(|| {
            panic!(
                "no histogram {name} {labels:?}; recorded: {:#?}",
                self.keys()
            )
        })
    }
}

impl Recorder for TestRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        self.registry
            .get_or_create_counter(key, |c| Counter::from_arc(c.clone()))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        self.registry
            .get_or_create_gauge(key, |g| Gauge::from_arc(g.clone()))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        self.registry
            .get_or_create_histogram(key, |h| Histogram::from_arc(h.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_values_across_reads_and_tells_labels_apart() {
        let r = TestRecorder::new();
        r.block_on(async {
            metrics::counter!("c", "a" => "1").increment(2);
            metrics::counter!("c", "a" => "2").increment(5);
            metrics::gauge!("g").set(1.5);
            metrics::histogram!("h", "x" => "y").record(0.25);
        });
        for _ in 0..2 {
            assert_eq!(r.counter("c", &[("a", "1")]), 2);
            assert_eq!(r.counter("c", &[("a", "2")]), 5);
            assert_eq!(r.gauge("g", &[]), 1.5);
            assert_eq!(r.histogram("h", &[("x", "y")]), vec![0.25]);
        }
        assert_eq!(r.try_counter("c", &[]), None);
        assert_eq!(r.try_counter("c", &[("a", "1"), ("b", "2")]), None);
        // Nothing recorded outside `block_on` lands here.
        metrics::counter!("elsewhere").increment(1);
        assert_eq!(r.try_counter("elsewhere", &[]), None);
    }
}
