//! What a broker error means for the messages in flight: whose fault it is
//! and, when the broker's words tell, which message caused it.

use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPSoftError};
use lapin::{ChannelState, ErrorKind};

/// Why a publish or its confirm failed.
#[derive(Debug)]
pub(super) enum Failure {
    /// The broker closed the confirm channel with a channel-level ("soft")
    /// error. That channel only publishes, so one of the messages still
    /// unconfirmed on it caused this; the connection is fine.
    Refused(AMQPError),
    /// The channel was already closing or closed: the message was not sent.
    ChannelClosed,
    /// The connection failed: a connection-level ("hard") error, an I/O
    /// error, a missing heartbeat.
    Connection,
}

impl Failure {
    pub(super) fn of(e: &lapin::Error) -> Failure {
        match e.kind() {
            ErrorKind::ProtocolError(amqp) => match amqp.kind() {
                AMQPErrorKind::Soft(_) => Failure::Refused(amqp.clone()),
                AMQPErrorKind::Hard(_) => Failure::Connection,
            },
            ErrorKind::InvalidChannelState(ChannelState::Closing | ChannelState::Closed, _) => {
                Failure::ChannelClosed
            }
            _ => Failure::Connection,
        }
    }
}

/// The messages a channel-level refusal points at, read from the broker's
/// words.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Culprit {
    /// Every message published to this exchange, rejected with `reason`;
    /// `missing` when the exchange does not exist.
    Exchange {
        name: String,
        reason: String,
        missing: bool,
    },
    /// Every message whose payload is larger than this many bytes.
    LargerThan(usize),
    /// The words name no message.
    Unknown,
}

impl Culprit {
    pub(super) fn of(e: &AMQPError) -> Culprit {
        let text = e.get_message().as_str();
        if let Some(max) = max_message_size(e) {
            return Culprit::LargerThan(max);
        }
        let Some(name) = exchange_named(text) else {
            return Culprit::Unknown;
        };
        let missing = *e.kind() == AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND);
        let reason = match e.kind() {
            _ if missing => format!("exchange `{name}` does not exist: {text}"),
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED) => {
                format!("access refused to exchange `{name}`: {text}")
            }
            _ => format!("RabbitMQ refused publishing to exchange `{name}`: {text}"),
        };
        Culprit::Exchange {
            name,
            reason,
            missing,
        }
    }

    /// Whether a message to `exchange` with a payload of `size` bytes is
    /// one the broker refused; the reason to reject it with.
    pub(super) fn accuses(&self, exchange: &str, size: usize) -> Option<String> {
        match self {
            Culprit::Exchange { name, reason, .. } if name == exchange => Some(reason.clone()),
            Culprit::LargerThan(max) if size > *max => Some(too_large(size, *max)),
            _ => None,
        }
    }
}

/// The reason a message found guilty on its own (it alone was in flight
/// when the broker closed the channel) is rejected with.
pub(super) fn refusal(e: &AMQPError, exchange: &str, size: usize) -> String {
    Culprit::of(e)
        .accuses(exchange, size)
        .unwrap_or_else(|| format!("RabbitMQ refused the message and closed the channel: {e}"))
}

fn too_large(size: usize, max: usize) -> String {
    format!("payload of {size} bytes is larger than the broker's max message size ({max} bytes)")
}

/// A message the broker returned as unroutable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Returned {
    pub(super) message_id: String,
    pub(super) exchange: String,
    pub(super) routing_key: String,
    pub(super) reply: String,
}

impl Returned {
    pub(super) fn from_lapin(r: &lapin::message::BasicReturnMessage) -> Returned {
        Returned {
            message_id: r
                .delivery
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.as_str().to_owned())
                .unwrap_or_default(),
            exchange: r.delivery.exchange.as_str().to_owned(),
            routing_key: r.delivery.routing_key.as_str().to_owned(),
            reply: format!("{} {}", r.reply_code, r.reply_text),
        }
    }

    pub(super) fn reason(&self) -> String {
        format!(
            "unroutable: exchange `{}` routing key `{}` ({})",
            self.exchange, self.routing_key, self.reply
        )
    }
}

/// `… exchange 'X' in vhost '/' …` → `X` (`NOT_FOUND - no exchange 'X' in
/// vhost '/'`, `ACCESS_REFUSED - access to internal exchange 'X' in vhost
/// '/' refused for user 'guest'`).
fn exchange_named(text: &str) -> Option<String> {
    let rest = &text[text.find("exchange '")? + "exchange '".len()..];
    let end = rest.rfind("' in vhost")?;
    Some(rest[..end].to_owned())
}

/// `PRECONDITION_FAILED - message size N is larger than configured max size M` → `M`.
fn max_message_size(e: &AMQPError) -> Option<usize> {
    if *e.kind() != AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) {
        return None;
    }
    let text = e.get_message().as_str();
    let rest = &text[text.find("max size ")? + "max size ".len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn soft(kind: AMQPSoftError, text: &str) -> AMQPError {
        AMQPError::new(AMQPErrorKind::Soft(kind), text.into())
    }

    #[test]
    fn names_the_missing_exchange() {
        let e = soft(
            AMQPSoftError::NOTFOUND,
            "NOT_FOUND - no exchange 'it''s-x' in vhost '/'",
        );
        let culprit = Culprit::of(&e);
        assert!(
            matches!(&culprit, Culprit::Exchange { name, reason, missing: true } if name == "it''s-x" && reason.contains("does not exist")),
            "{culprit:?}"
        );
        assert!(culprit.accuses("it''s-x", 1).is_some());
        assert!(culprit.accuses("other", 1).is_none());
    }

    #[test]
    fn names_the_refused_exchange() {
        let e = soft(
            AMQPSoftError::ACCESSREFUSED,
            "ACCESS_REFUSED - access to internal exchange 'inner' in vhost '/' refused for user 'guest'",
        );
        let why = refusal(&e, "inner", 10);
        assert!(
            why.starts_with("access refused to exchange `inner`"),
            "{why}"
        );
        // A message to another exchange is not the culprit; found alone it still is.
        assert!(Culprit::of(&e).accuses("outer", 10).is_none());
        let why = refusal(&e, "outer", 10);
        assert!(why.contains("refused the message"), "{why}");
    }

    #[test]
    fn reads_the_max_message_size() {
        let e = soft(
            AMQPSoftError::PRECONDITIONFAILED,
            "PRECONDITION_FAILED - message size 2000 is larger than configured max size 1000",
        );
        assert_eq!(Culprit::of(&e), Culprit::LargerThan(1000));
        assert!(Culprit::of(&e).accuses("x", 1000).is_none());
        let why = Culprit::of(&e).accuses("x", 2000).unwrap();
        assert!(
            why.contains("2000 bytes") && why.contains("(1000 bytes)"),
            "{why}"
        );
    }

    #[test]
    fn other_refusals_name_no_message() {
        let e = soft(AMQPSoftError::RESOURCELOCKED, "RESOURCE_LOCKED - something");
        assert_eq!(Culprit::of(&e), Culprit::Unknown);
    }
}
