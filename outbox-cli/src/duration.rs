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

/// Shows an age compactly with its two largest units: `850ms`, `45s`,
/// `5m 12s`, `3h 4m`, `2d 3h`.
pub fn format_age(age: Duration) -> String {
    let secs = age.as_secs();
    if secs == 0 {
        return format!("{}ms", age.as_millis());
    }
    let parts = [
        (secs / 86_400, "d"),
        (secs % 86_400 / 3_600, "h"),
        (secs % 3_600 / 60, "m"),
        (secs % 60, "s"),
    ];
    let first = parts.iter().position(|(n, _)| *n > 0).unwrap_or(3);
    let mut out = format!("{}{}", parts[first].0, parts[first].1);
    if let Some((n, unit)) = parts.get(first + 1) {
        if *n > 0 {
            out.push_str(&format!(" {n}{unit}"));
        }
    }
    out
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

    #[test]
    fn formats_ages() {
        assert_eq!(format_age(Duration::from_millis(850)), "850ms");
        assert_eq!(format_age(Duration::from_secs(45)), "45s");
        assert_eq!(format_age(Duration::from_secs(312)), "5m 12s");
        assert_eq!(format_age(Duration::from_secs(3_600)), "1h");
        assert_eq!(
            format_age(Duration::from_secs(2 * 86_400 + 3 * 3_600)),
            "2d 3h"
        );
    }
}
