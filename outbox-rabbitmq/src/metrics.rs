//! The names and labels of the metrics `RabbitConsumer` records, through the [`metrics`](https://docs.rs/metrics)
//! facade: install a recorder (e.g. `metrics-exporter-prometheus`) before
//! spawning consumers; without one, recording is a no-op. The relay's own
//! metrics are in `outbox::metrics`.
//!
//! Every metric carries [`SYSTEM`] = `rabbitmq`, [`DESTINATION`] (the queue
//! consumed) and [`CONSUMER_GROUP`] (the consumer's name, its inbox key):
//! values the application configures, so a finite set. There is no
//! message-type label here: the AMQP `type` comes from whoever published,
//! so its values are not bounded by the consumer's code.

/// Label (OpenTelemetry): `rabbitmq`.
pub const SYSTEM: &str = "messaging.system";
/// Label (OpenTelemetry): the queue the consumer reads.
pub const DESTINATION: &str = "messaging.destination.name";
/// Label (OpenTelemetry): the consumer's name (`consumer_name`, its inbox key).
pub const CONSUMER_GROUP: &str = "messaging.consumer.group.name";
/// Label (OpenTelemetry): `receive` on [`RECEIVED`], `process` on [`PROCESS_DURATION`].
pub const OPERATION_NAME: &str = "messaging.operation.name";
/// Label of [`DEAD_LETTERED`]: `handler_failed` (the last attempt failed)
/// or `invalid` (the delivery could not be decoded: no message id, …).
pub const DEAD_LETTER_REASON: &str = "outbox.dead_letter.reason";

/// Counter (OpenTelemetry): deliveries received from the broker — every
/// one, duplicates and undecodable ones included; retries in place are
/// not received again.
pub const RECEIVED: &str = "messaging.client.consumed.messages";
/// Counter: deliveries handled — effects and inbox row committed, then acknowledged.
pub const HANDLED: &str = "outbox.consumer.handled";
/// Counter: deliveries found in the inbox (already handled): skipped and acknowledged.
pub const DUPLICATES: &str = "outbox.consumer.duplicates";
/// Counter: deliveries rejected to the dead-letter exchange, by
/// [`DEAD_LETTER_REASON`].
pub const DEAD_LETTERED: &str = "outbox.consumer.dead_lettered";
/// Histogram (seconds, OpenTelemetry): one try of a delivery — the
/// handler and its inbox transaction — whatever the outcome.
pub const PROCESS_DURATION: &str = "messaging.process.duration";

/// Describes the consumer's metrics (help text and unit) to the installed
/// recorder. Recording works without it.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_histogram};
    describe_counter!(
        RECEIVED,
        Unit::Count,
        "Deliveries received from the broker by a RabbitConsumer"
    );
    describe_counter!(
        HANDLED,
        Unit::Count,
        "Deliveries handled: effects and inbox row committed, then acknowledged"
    );
    describe_counter!(
        DUPLICATES,
        Unit::Count,
        "Deliveries already in the inbox: skipped and acknowledged"
    );
    describe_counter!(
        DEAD_LETTERED,
        Unit::Count,
        "Deliveries rejected to the dead-letter exchange"
    );
    describe_histogram!(
        PROCESS_DURATION,
        Unit::Seconds,
        "Duration of one try of a delivery (handler and inbox transaction)"
    );
}

/// A consumer's handles, registered when it starts.
#[derive(Debug)]
pub(crate) struct ConsumerMeter {
    pub(crate) received: metrics::Counter,
    pub(crate) handled: metrics::Counter,
    pub(crate) duplicates: metrics::Counter,
    pub(crate) dead_lettered: metrics::Counter,
    pub(crate) invalid: metrics::Counter,
    pub(crate) process: metrics::Histogram,
}

impl ConsumerMeter {
    pub(crate) fn new(queue: &str, consumer: &str) -> Self {
        let base = [
            (SYSTEM, "rabbitmq".to_owned()),
            (DESTINATION, queue.to_owned()),
            (CONSUMER_GROUP, consumer.to_owned()),
        ];
        let with = |k: &'static str, v: &'static str| {
            let mut l = base.to_vec();
            l.push((k, v.to_owned()));
            l
        };
        ConsumerMeter {
            received: metrics::counter!(RECEIVED, &with(OPERATION_NAME, "receive")),
            handled: metrics::counter!(HANDLED, &base),
            duplicates: metrics::counter!(DUPLICATES, &base),
            dead_lettered: metrics::counter!(
                DEAD_LETTERED,
                &with(DEAD_LETTER_REASON, "handler_failed")
            ),
            invalid: metrics::counter!(DEAD_LETTERED, &with(DEAD_LETTER_REASON, "invalid")),
            process: metrics::histogram!(PROCESS_DURATION, &with(OPERATION_NAME, "process")),
        }
    }
}
