//! Durations as operators type them (`30s`, `15m`, `12h`, `7d`) and ages as
//! they are shown (`5m 12s`).

use std::time::Duration;

/// Parses `<whole number><unit>` with unit `s`, `m`, `h` or `d`, e.g. `0s`,
/// `30m`, `12h`, `7d`. The error names what was wrong.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    const EXAMPLE: &str = "write a whole number and a unit s, m, h or d, e.g. 30m, 12h, 7d";
    let s = text.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    if number.is_empty() {
        return Err(format!(
            "`{}` is not a duration: {EXAMPLE}",
            text.escape_debug()
        ));
    }
    if unit.is_empty() {
        return Err(format!("`{s}` has no unit: {EXAMPLE}"));
    }
    let seconds_per: u64 = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        other => {
            return Err(format!(
                "`{}` has an unknown unit `{}`: {EXAMPLE}",
                text.escape_debug(),
                other.escape_debug()
            ));
        }
    };
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(seconds_per))
        .map(Duration::from_secs)
        .ok_or_else(|| format!("`{s}` is too long a duration"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_unit() {
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("30m"), Ok(Duration::from_secs(1_800)));
        assert_eq!(parse_duration("12h"), Ok(Duration::from_secs(43_200)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(604_800)));
    }

    #[test]
    fn rejects_malformed_durations_naming_them() {
        for bad in [
            "",
            "7",
            "d",
            "7w",
            "-1d",
            "1.5h",
            "7 d x",
            "99999999999999999999d",
        ] {
            let err = parse_duration(bad).unwrap_err();
            assert!(err.contains('`'), "{bad}: {err}");
        }
    }
}
