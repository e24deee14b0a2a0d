//! In-process delivery of domain messages.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use async_trait::async_trait;

use crate::message::{Message, MessageId, OutboxMessage, Timestamp};

/// What a handler returns on failure.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Runs the handlers registered for a domain message.
///
/// # Contract
/// * `Ok(())` means every handler for the message's type succeeded; the
///   relay then marks the message processed.
/// * `Err` counts as a failed attempt (so do a panic and a timeout, which the
///   relay catches). A message type with no handler is an `Err` that names
///   the type.
/// * An `Err` that is (or has in its source chain) a
///   [`TemporarilyUnavailable`](crate::TemporarilyUnavailable) does **not**
///   count: the relay retries the message later with backoff, attempts
///   unchanged, and reports the type's handler as unavailable in health.
/// * The same message may be dispatched more than once (at-least-once: a
///   crash between handling and marking, or a retry after a partial failure
///   when several handlers are registered), so handlers should be idempotent
///   or deduplicate with an inbox.
#[async_trait]
pub trait Dispatcher: Send + Sync + fmt::Debug + 'static {
    /// Runs the handlers for `message`.
    async fn dispatch(&self, message: &Message) -> Result<(), HandlerError>;
}

/// What a handler knows about the message besides its payload.
#[derive(Debug, Clone)]
pub struct MessageContext {
    /// The message id (use it as the inbox key).
    pub id: MessageId,
    /// The message type.
    pub message_type: String,
    /// The ordering key.
    pub key: Option<String>,
    /// Counted failures before this delivery.
    pub attempts: u32,
    /// Headers.
    pub headers: BTreeMap<String, String>,
    /// W3C traceparent of the enqueuing span.
    pub trace_parent: Option<String>,
    /// When it was enqueued.
    pub created_at: Timestamp,
}

impl MessageContext {
    /// The context of `message`.
    pub fn of(message: &Message) -> Self {
        MessageContext {
            id: message.id,
            message_type: message.message_type.clone(),
            key: message.key.clone(),
            attempts: message.attempts,
            headers: message.headers.clone(),
            trace_parent: message.trace_parent.clone(),
            created_at: message.created_at,
        }
    }
}

type BoxFuture = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send + 'static>>;
type ErasedHandler = Arc<dyn Fn(&Message) -> BoxFuture + Send + Sync>;

/// A handler of typed messages: any `Fn(T, MessageContext) -> impl Future<Output = Result<(), E>>`.
pub trait Handler<T>: Send + Sync + 'static {
    /// Handles one decoded message.
    fn call(&self, message: T, context: MessageContext) -> BoxFuture;
}

impl<T, F, Fut, E> Handler<T> for F
where
    F: Fn(T, MessageContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: Into<HandlerError>,
{
    fn call(&self, message: T, context: MessageContext) -> BoxFuture {
        let fut = self(message, context);
        Box::pin(async move { fut.await.map_err(Into::into) })
    }
}

/// The typed handler registry: the normal way to build a [`Dispatcher`].
///
/// ```
/// # use outbox_api::{Handlers, OutboxMessage, MessageContext};
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct OrderPlaced { order_id: u64 }
/// impl OutboxMessage for OrderPlaced { const MESSAGE_TYPE: &'static str = "OrderPlaced"; }
///
/// let handlers = Handlers::new().on::<OrderPlaced>(|event: OrderPlaced, _ctx: MessageContext| async move {
///     println!("order {} placed", event.order_id);
///     Ok::<_, std::io::Error>(())
/// });
/// assert!(handlers.handles("OrderPlaced"));
/// ```
///
/// Several handlers may be registered for one type; they run in
/// registration order and the message succeeds only if all of them do.
#[derive(Clone, Default)]
pub struct Handlers {
    by_type: HashMap<String, Vec<ErasedHandler>>,
}

impl Handlers {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `handler` for messages of type `T` (JSON-decoded; a payload
    /// that does not decode is a counted failure naming the type).
    pub fn on<T: OutboxMessage>(self, handler: impl Handler<T>) -> Self {
        let handler = Arc::new(handler);
        self.on_message(T::MESSAGE_TYPE, move |message: &Message| {
            let decoded = message.json::<T>();
            let context = MessageContext::of(message);
            let handler = Arc::clone(&handler);
            async move {
                let value = decoded.map_err(|e| -> HandlerError { Box::new(e) })?;
                handler.call(value, context).await
            }
        })
    }

    /// Registers a handler of raw messages for `message_type`.
    pub fn on_message<F, Fut, E>(mut self, message_type: impl Into<String>, handler: F) -> Self
    where
        F: Fn(&Message) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<HandlerError>,
    {
        let erased: ErasedHandler = Arc::new(move |m: &Message| -> BoxFuture {
            let fut = handler(m);
            Box::pin(async move { fut.await.map_err(Into::into) })
        });
        self.by_type
            .entry(message_type.into())
            .or_default()
            .push(erased);
        self
    }

    /// Whether a handler is registered for `message_type`.
    pub fn handles(&self, message_type: &str) -> bool {
        self.by_type.contains_key(message_type)
    }
}

impl fmt::Debug for Handlers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut types: Vec<_> = self
            .by_type
            .iter()
            .map(|(t, h)| (t.as_str(), h.len()))
            .collect();
        types.sort();
        f.debug_struct("Handlers").field("types", &types).finish()
    }
}

/// The error for a message type nobody handles.
#[derive(Debug)]
pub struct NoHandler(pub String);

impl fmt::Display for NoHandler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "no handler registered for message type `{}`", self.0)
    }
}

impl std::error::Error for NoHandler {}

#[async_trait]
impl Dispatcher for Handlers {
    async fn dispatch(&self, message: &Message) -> Result<(), HandlerError> {
        let Some(handlers) = self.by_type.get(&message.message_type) else {
            return Err(Box::new(NoHandler(message.message_type.clone())));
        };
        for handler in handlers {
            handler(message).await?;
        }
        Ok(())
    }
}

/// An error and its sources as one line (`outer: cause: root`), leaving out
/// a source whose text the line already contains.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

/// The message of a caught panic's payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}
