//! Reading the summary a `minishop --orders N` run prints, for the test
//! files that run one.

/// The number after `label` at the start of a summary line (a trailing
/// comma dropped).
pub fn figure(stdout: &str, label: &str) -> u64 {
    stdout
        .lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix(label))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.trim_end_matches(',').parse().ok())
        .unwrap_or_else(|| panic!("no `{label}` figure in the summary:\n{stdout}"))
}
