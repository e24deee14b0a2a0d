//! What a publishable NATS subject is.

/// The longest subject this crate publishes to (the server's own limit is
/// its `max_control_line`, 4 KiB by default, shared with headers' sizes).
pub const MAX_SUBJECT_LEN: usize = 1024;

/// Checks that `subject` can be published to: tokens separated by `.`,
/// none empty, no whitespace or control characters, no wildcard (`*`,
/// `>`) token. `Err` says what is wrong.
pub fn check(subject: &str) -> Result<(), String> {
    let shown: String = subject.chars().take(60).collect();
    if subject.is_empty() {
        return Err("the subject is empty".to_owned());
    }
    if subject.len() > MAX_SUBJECT_LEN {
        return Err(format!(
            "subject `{shown}…` is {} bytes long; at most {MAX_SUBJECT_LEN}",
            subject.len()
        ));
    }
    if let Some(c) = subject
        .chars()
        .find(|c| c.is_whitespace() || c.is_control())
    {
        return Err(format!(
            "subject `{shown}` holds {c:?}; NATS subjects have no whitespace or control characters"
        ));
    }
    for token in subject.split('.') {
        if token.is_empty() {
            return Err(format!(
                "subject `{shown}` has an empty token (a leading, trailing or doubled `.`)"
            ));
        }
        if token == "*" || token == ">" {
            return Err(format!(
                "subject `{shown}` holds the wildcard `{token}`; a message is published to a literal subject"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check;

    #[test]
    fn literal_subjects_pass_others_are_explained() {
        check("orders.OrderPlaced").unwrap();
        check("a").unwrap();
        check("a.b-c_d.e*f").unwrap();
        for (bad, says) in [
            ("", "empty"),
            ("a..b", "empty token"),
            (".a", "empty token"),
            ("a.", "empty token"),
            ("a b", "whitespace"),
            ("a.*", "wildcard"),
            ("a.>", "wildcard"),
            ("a\nb", "whitespace"),
        ] {
            let why = check(bad).unwrap_err();
            assert!(why.contains(says), "{bad:?}: {why}");
        }
        assert!(check(&"x".repeat(2000)).unwrap_err().contains("2000 bytes"));
    }
}
