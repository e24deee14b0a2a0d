//! Operator actions: retry and discard, of one message or of every
//! poisoned message of a type — each a confirmation page (GET) and the
//! action itself (POST, CSRF-checked).

use super::*;

/// The action named in a URL (`retry`, `discard`); its precondition,
/// refusal and audit note are `OperatorAction`'s, as in the stores.
fn parse_action(st: &State, s: &str) -> Result<OperatorAction, Response> {
    match s {
        "retry" => Ok(OperatorAction::Retry),
        "discard" => Ok(OperatorAction::Discard),
        _ => Err(error_page(
            st,
            StatusCode::NOT_FOUND,
            "Not found",
            "The actions are retry and discard.",
        )),
    }
}

/// Why `action` does not apply to `m`, if it does not.
fn refused(action: OperatorAction, m: &Message) -> Option<String> {
    action
        .check(m.id, m.state)
        .err()
        .map(|e| e.message().to_owned())
}

/// What the action does, for the confirmation pages.
fn consequence(action: OperatorAction) -> &'static str {
    match action {
        OperatorAction::Retry => {
            "Its attempts go back to 0 and the relay delivers it again at once; the audit note \
             in its last error says who retried it and when."
        }
        OperatorAction::Discard => {
            "It is marked processed without being delivered — it is never sent — and the \
             later messages of its key may go on. Retention purges it later."
        }
    }
}

/// `GET {prefix}/{outbox}/messages/{id}/{action}`: the confirmation page.
pub(crate) async fn confirm_one(
    S(st): S<Arc<State>>,
    p: Result<Path<(String, String, String)>, PathRejection>,
) -> Page {
    let (name, id, action) = path(&st, p)?;
    let o = &st.outbox(&name)?;
    let action = parse_action(&st, &action)?;
    let id = parse_id(&st, &id)?;
    let m = fetch(&st, o, id).await?;
    if let Some(why) = refused(action, &m) {
        return Err(error_page(
            &st,
            StatusCode::CONFLICT,
            "Not possible now",
            &why,
        ));
    }
    let url = st.message_url(&o.name, m.id);
    let verb = action.name();
    let body = html! {
        h1 { "Confirm: " (verb) " message " code { (m.id) } "?" }
        table { tbody {
            tr { th { "outbox" } td { (o.name) } }
            tr { th { "type" } td { code { (m.message_type) } } }
            tr { th { "key" } td { @if let Some(k) = &m.key { code { (k) } } @else { span.note { "none" } } } }
            tr { th { "state" } td { (m.state) } }
            tr { th { "attempts" } td { (m.attempts) } }
            tr { th { "last error" } td { @if let Some(e) = &m.last_error { (view::short(e, 300)) } } }
        } }
        p { (consequence(action)) }
        form.actions method="post" action={ (url) "/" (verb) } {
            input type="hidden" name="csrf" value=(st.keys.csrf(verb, &o.name, &m.id.to_string()));
            button type="submit" class=(if action == OperatorAction::Discard { "danger" } else { "primary" }) {
                "Yes, " (verb) " it"
            }
            " " a href=(url) { "Cancel" }
        }
    };
    Ok(respond(
        StatusCode::OK,
        page(&st, &format!("Confirm {verb}"), body),
    ))
}

/// `POST {prefix}/{outbox}/messages/{id}/{action}`: does it.
pub(crate) async fn act_one(
    S(st): S<Arc<State>>,
    p: Result<Path<(String, String, String)>, PathRejection>,
    ext: Extensions,
    body: Bytes,
) -> Page {
    let (name, id_text, action) = path(&st, p)?;
    let o = &st.outbox(&name)?;
    let action = parse_action(&st, &action)?;
    let id = parse_id(&st, &id_text)?;
    let f = form(&body);
    let csrf = param(&f, "csrf").unwrap_or("");
    if !st
        .keys
        .csrf_ok(csrf, action.name(), &o.name, &id.to_string())
    {
        return Err(csrf_refused(&st));
    }
    let by = operator(&ext);
    action
        .apply(o.store.as_ref(), id, &by, Timestamp::now())
        .await
        .map_err(|e| st.store_error(&format!("{} message {id}", action.name()), &e))?;
    tracing::info!(outbox = %o.name, %id, by = %by, "outbox console: message {}", action.done());
    Ok(Redirect::to(&format!(
        "{}?done={}",
        st.message_url(&o.name, id),
        action.done()
    ))
    .into_response())
}

/// The ids of the poisoned messages of `ty`, oldest first, at most `BULK_MAX`.
async fn poisoned_of_type(
    st: &State,
    o: &Outbox,
    ty: &str,
) -> Result<(Vec<MessageId>, bool), Response> {
    const BATCH: usize = 500;
    let mut ids = Vec::new();
    let mut seen = HashSet::new();
    let mut offset = 0;
    loop {
        let q = ListQuery::new()
            .state(MessageState::Poisoned)
            .message_type(ty)
            .limit(BATCH)
            .offset(offset);
        let batch = o
            .store
            .list(&q)
            .await
            .map_err(|e| st.store_error("listing poisoned messages", &e))?;
        let n = batch.len();
        for m in batch {
            if seen.insert(m.id) {
                if ids.len() == BULK_MAX {
                    return Ok((ids, true));
                }
                ids.push(m.id);
            }
        }
        if n < BATCH {
            return Ok((ids, false));
        }
        offset += BATCH;
    }
}

fn bulk_type(st: &State, ps: &[(String, String)]) -> Result<String, Response> {
    parse_type(st, param(ps, "type"))?.ok_or_else(|| {
        st.bad_request(
            "Say which message type: ?type=OrderPlaced (a bulk action applies to one type).",
        )
    })
}

/// `GET {prefix}/{outbox}/poisoned/{action}?type=T`: the confirmation page
/// of a bulk action.
pub(crate) async fn confirm_bulk(
    S(st): S<Arc<State>>,
    p: Result<Path<(String, String)>, PathRejection>,
    RawQuery(q): RawQuery,
) -> Page {
    let (name, action) = path(&st, p)?;
    let o = &st.outbox(&name)?;
    let action = parse_action(&st, &action)?;
    let ty = bulk_type(&st, &params(q.as_deref()))?;
    let (ids, more) = poisoned_of_type(&st, o, &ty).await?;
    let verb = action.name();
    let list = st.list_url(&o.name, "poisoned", Some(&ty), 1);
    let body = html! {
        @if ids.is_empty() {
            h1 { "No poisoned " code { (ty) } " messages" }
            p { "There is nothing to " (verb) " in outbox " (o.name) ". " a href=(list) { "Back to the list" } }
        } @else {
            h1 { "Confirm: " (verb) " all " (ids.len()) @if more { "+" } " poisoned " code { (ty) } " messages?" }
            @if more { p.error { "There are more than " (BULK_MAX) "; this action takes the oldest " (BULK_MAX) ". Run it again for the rest." } }
            p { "Each of them: " (consequence(action)) }
            p.note { "The action applies to the messages of this type that are poisoned when you confirm." }
            form.actions method="post" action={ (st.prefix) "/" (o.name) "/poisoned/" (verb) } {
                input type="hidden" name="type" value=(ty);
                input type="hidden" name="csrf" value=(st.keys.csrf(&format!("bulk-{verb}"), &o.name, &ty));
                button type="submit" class=(if action == OperatorAction::Discard { "danger" } else { "primary" }) {
                    "Yes, " (verb) " them all"
                }
                " " a href=(list) { "Cancel" }
            }
        }
    };
    Ok(respond(
        StatusCode::OK,
        page(&st, &format!("Confirm {verb} all"), body),
    ))
}

/// `POST {prefix}/{outbox}/poisoned/{action}`: does it, message by message.
pub(crate) async fn act_bulk(
    S(st): S<Arc<State>>,
    p: Result<Path<(String, String)>, PathRejection>,
    ext: Extensions,
    body: Bytes,
) -> Page {
    let (name, action) = path(&st, p)?;
    let o = &st.outbox(&name)?;
    let action = parse_action(&st, &action)?;
    let f = form(&body);
    let ty = bulk_type(&st, &f)?;
    let csrf = param(&f, "csrf").unwrap_or("");
    if !st
        .keys
        .csrf_ok(csrf, &format!("bulk-{}", action.name()), &o.name, &ty)
    {
        return Err(csrf_refused(&st));
    }
    let (ids, _) = poisoned_of_type(&st, o, &ty).await?;
    let by = operator(&ext);
    let (mut done, mut skipped) = (0u64, 0u64);
    for id in ids {
        match action
            .apply(o.store.as_ref(), id, &by, Timestamp::now())
            .await
        {
            Ok(()) => done += 1,
            // Changed since it was listed: another operator, or (discard)
            // retried and delivered meanwhile.
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::Conflict) => skipped += 1,
            Err(e) => {
                return Err(st.store_error(
                    &format!(
                        "{} poisoned {ty} messages stopped after {done} (the rest are untouched)",
                        action.name()
                    ),
                    &e,
                ));
            }
        }
    }
    tracing::info!(outbox = %o.name, message_type = %ty, count = done, skipped, by = %by,
        "outbox console: poisoned messages {}", action.done());
    let mut q = form_urlencoded::Serializer::new(String::new());
    q.append_pair("state", "poisoned")
        .append_pair("type", &ty)
        .append_pair("done", action.done())
        .append_pair("count", &done.to_string())
        .append_pair("skipped", &skipped.to_string());
    Ok(Redirect::to(&format!("{}/{}/messages?{}", st.prefix, o.name, q.finish())).into_response())
}
