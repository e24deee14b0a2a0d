#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod config;
mod topology;
mod transport;

pub use config::{MAX_SHORT_STRING, RabbitConfig, URL_ENV};
pub use topology::{ExchangeType, Topology};
pub use transport::{KEY_HEADER, RabbitTransport, TRACEPARENT_HEADER};

/// The AMQP client this crate is built on, for code that needs its types
/// (e.g. [`Topology::declare_on`] takes a `lapin::Channel`).
pub use lapin;
