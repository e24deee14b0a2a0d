//! Name patterns as operators type them with `--matching`: `*` for any run
//! of characters, `?` for one, everything else itself (`tenant_*`,
//! `shop_??`).

/// Longest pattern accepted, in characters.
const MAX_LEN: usize = 128;

/// A checked `--matching` pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Glob {
    pattern: Vec<char>,
    text: String,
}

impl Glob {
    /// Reads a pattern (clap value parser): letters, digits, `_` and `-`,
    /// with `*` and `?`. Anything else is refused, naming it — a `[`, a
    /// `.` or a space would otherwise match nothing without a word.
    pub fn parse(text: &str) -> Result<Glob, String> {
        const WHAT: &str = "a pattern is letters, digits, `_` and `-`, with `*` for any run of \
                            characters and `?` for one, e.g. `tenant_*`";
        if text.is_empty() {
            return Err(format!("the pattern is empty: {WHAT}"));
        }
        if text.chars().count() > MAX_LEN {
            return Err(format!(
                "the pattern is longer than {MAX_LEN} characters: {WHAT}"
            ));
        }
        if let Some(bad) = text
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '*' | '?')))
        {
            return Err(format!(
                "`{}` has `{}`, which a pattern cannot hold: {WHAT}",
                text.escape_debug(),
                bad.escape_debug()
            ));
        }
        Ok(Glob {
            pattern: text.chars().collect(),
            text: text.to_owned(),
        })
    }

    /// The pattern as typed.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether the whole of `name` matches (case matters: PostgreSQL
    /// schema names are case-sensitive).
    pub fn matches(&self, name: &str) -> bool {
        let name: Vec<char> = name.chars().collect();
        let (p, n) = (&self.pattern, &name);
        let (mut pi, mut ni) = (0, 0);
        // Where the last `*` was, and the name position it stood for.
        let mut star: Option<(usize, usize)> = None;
        while ni < n.len() {
            match p.get(pi) {
                Some('*') => {
                    star = Some((pi, ni));
                    pi += 1;
                }
                Some(&c) if c == '?' || c == n[ni] => {
                    pi += 1;
                    ni += 1;
                }
                _ => match star {
                    // Let the last `*` take one more character.
                    Some((sp, sn)) => {
                        pi = sp + 1;
                        ni = sn + 1;
                        star = Some((sp, sn + 1));
                    }
                    None => return false,
                },
            }
        }
        p[pi..].iter().all(|c| *c == '*')
    }
}

impl std::fmt::Display for Glob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(pattern: &str, name: &str) -> bool {
        Glob::parse(pattern).unwrap().matches(name)
    }

    #[test]
    fn stars_and_question_marks() {
        assert!(m("tenant_*", "tenant_17"));
        assert!(m("tenant_*", "tenant_"));
        assert!(!m("tenant_*", "tenants_1"));
        assert!(!m("tenant_*", "my_tenant_1"));
        assert!(m("*_17", "tenant_17"));
        assert!(m("*", ""));
        assert!(m("*", "anything"));
        assert!(m("t?n*_1?", "tenant_17"));
        assert!(!m("t?n*_1?", "tenant_170"));
        assert!(m("a*b*c", "axxbyyc"));
        assert!(m("a*b*c", "abcbc"));
        assert!(!m("a*b*c", "axxbyy"));
        assert!(m("shop", "shop"));
        assert!(!m("shop", "Shop"));
        assert!(!m("shop", "shops"));
        assert!(!m("??", "a"));
        assert!(m("**a**", "banana"));
    }

    #[test]
    fn bad_patterns_are_named() {
        for (bad, named) in [
            ("tenant_[0-9]", "`[`"),
            ("a.b", "`.`"),
            ("a b", "` `"),
            ("x/y", "`/`"),
            ("", "empty"),
        ] {
            let e = Glob::parse(bad).unwrap_err();
            assert!(e.contains(named), "{bad:?}: {e}");
        }
        assert!(Glob::parse(&"a".repeat(MAX_LEN + 1)).is_err());
        assert_eq!(Glob::parse("ten-ant_*?").unwrap().as_str(), "ten-ant_*?");
    }
}
