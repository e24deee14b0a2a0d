//! Trace context across the outbox: the W3C `traceparent` of the span that
//! enqueued a message is stored with it, and the span that delivers it
//! continues that trace.
//!
//! With the `opentelemetry` feature and a `tracing-opentelemetry` layer
//! installed, [`current_traceparent`] reads the current span's context (and
//! [`NewMessage`](crate::NewMessage) captures it at enqueue when none was
//! set), and [`continue_trace`] makes a delivery span a child of the stored
//! context. Without the feature both do nothing.

/// The W3C `traceparent` of the current span, if it has a valid
/// OpenTelemetry context.
pub fn current_traceparent() -> Option<String> {
    imp::current()
}

/// The `traceparent` a message enqueued now stores: that of an
/// `outbox.enqueue` span opened (and closed at once) under the current
/// span for message `id`, or `None` when the current span is not traced.
/// Where a subscriber filters the enqueue span out, the current span's own
/// context is stored instead.
pub(crate) fn enqueue_traceparent(
    id: crate::MessageId,
    message_type: &str,
    key: Option<&str>,
) -> Option<String> {
    // Only when there is a trace to continue: untraced code pays nothing
    // beyond this look.
    current_traceparent()?;
    let span = tracing::info_span!(
        "outbox.enqueue",
        message.id = %id,
        message.type = message_type,
        message.key = key,
    );
    span.in_scope(current_traceparent)
}

/// The trace id (32 lowercase hex digits) inside a W3C `traceparent`
/// (`00-<trace id>-<span id>-<flags>`), if it is one.
pub fn trace_id_of(traceparent: &str) -> Option<&str> {
    crate::is_valid_traceparent(traceparent).then(|| &traceparent[3..35])
}

/// Whether `s` is a trace id as a `traceparent` holds it: 32 lowercase hex
/// digits, not all zero.
pub fn is_trace_id(s: &str) -> bool {
    s.len() == 32
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        && s.bytes().any(|b| b != b'0')
}

/// Makes `span` a child of `traceparent` (a no-op for `None`, an invalid
/// value, or without the `opentelemetry` feature).
pub fn continue_trace(span: &tracing::Span, traceparent: Option<&str>) {
    if let Some(tp) = traceparent {
        imp::continue_trace(span, tp);
    }
}

#[cfg(feature = "opentelemetry")]
mod imp {
    use opentelemetry::Context;
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    pub fn current() -> Option<String> {
        let cx = tracing::Span::current().context();
        let span = cx.span();
        let sc = span.span_context();
        sc.is_valid().then(|| {
            format!(
                "00-{}-{}-{:02x}",
                sc.trace_id(),
                sc.span_id(),
                sc.trace_flags().to_u8()
            )
        })
    }

    fn parse(tp: &str) -> Option<SpanContext> {
        if !crate::is_valid_traceparent(tp) {
            return None;
        }
        let mut parts = tp.split('-').skip(1);
        let trace_id = TraceId::from_hex(parts.next()?).ok()?;
        let span_id = SpanId::from_hex(parts.next()?).ok()?;
        let flags = u8::from_str_radix(parts.next()?, 16).ok()?;
        Some(SpanContext::new(
            trace_id,
            span_id,
            TraceFlags::new(flags),
            true,
            TraceState::default(),
        ))
    }

    pub fn continue_trace(span: &tracing::Span, tp: &str) {
        if let Some(sc) = parse(tp) {
            // Fails only if the span has no OpenTelemetry layer: nothing to continue then.
            let _ = span.set_parent(Context::new().with_remote_span_context(sc));
        }
    }
}

#[cfg(not(feature = "opentelemetry"))]
mod imp {
    pub fn current() -> Option<String> {
        None
    }

    pub fn continue_trace(_span: &tracing::Span, _tp: &str) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_ids() {
        assert_eq!(
            trace_id_of("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        assert_eq!(trace_id_of("garbage"), None);
        assert_eq!(
            trace_id_of("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"),
            None
        );
        assert!(is_trace_id("4bf92f3577b34da6a3ce929d0e0e4736"));
        assert!(
            !is_trace_id("00000000000000000000000000000000"),
            "all zero is invalid"
        );
        assert!(
            !is_trace_id("4BF92F3577B34DA6A3CE929D0E0E4736"),
            "lowercase only"
        );
        assert!(!is_trace_id("4bf92f35"));
    }
}
