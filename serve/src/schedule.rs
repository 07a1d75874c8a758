//! Cron schedules for the server's maintenance jobs (`serve.rematerialize_cron`,
//! `serve.gc_cron`), in UTC.
//!
//! Five fields (`minute hour day-of-month month day-of-week`) or six with seconds first.
//! Each field is `*`, a number, a range `a-b`, a step `*/n` or `a-b/n`, or a comma list of
//! those. Day of week is 0-7 (0 and 7 are Sunday). As in cron, when both day fields are
//! restricted a time matches if either does.

use chrono::{DateTime, Datelike, Duration, Timelike, Utc};

/// A parsed schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cron {
    seconds: u64,
    minutes: u64,
    hours: u64,
    days: u64,
    months: u64,
    weekdays: u64,
    /// Whether each day field was restricted (not `*`).
    days_restricted: bool,
    weekdays_restricted: bool,
}

fn field(text: &str, lo: u32, hi: u32, what: &str) -> Result<(u64, bool), String> {
    let mut bits = 0u64;
    for part in text.split(',') {
        let (range, step) = match part.split_once('/') {
            Some((r, s)) => (
                r,
                s.parse::<u32>()
                    .ok()
                    .filter(|s| *s > 0)
                    .ok_or_else(|| format!("{what}: bad step in {part:?}"))?,
            ),
            None => (part, 1),
        };
        let num = |s: &str| {
            s.parse::<u32>()
                .ok()
                .filter(|n| (lo..=hi).contains(n))
                .ok_or_else(|| format!("{what}: {s:?} is not in {lo}-{hi}"))
        };
        let (a, b) = if range == "*" {
            (lo, hi)
        } else if let Some((a, b)) = range.split_once('-') {
            let (a, b) = (num(a)?, num(b)?);
            if a > b {
                return Err(format!("{what}: empty range {range:?}"));
            }
            (a, b)
        } else {
            let a = num(range)?;
            (a, if part.contains('/') { hi } else { a })
        };
        for v in (a..=b).step_by(step as usize) {
            bits |= 1 << v;
        }
    }
    Ok((bits, text != "*"))
}

impl std::str::FromStr for Cron {
    type Err = String;
    fn from_str(s: &str) -> Result<Cron, String> {
        let f: Vec<&str> = s.split_whitespace().collect();
        let f: Vec<&str> = match f.len() {
            5 => std::iter::once("0").chain(f).collect(),
            6 => f,
            n => return Err(format!("{s:?}: {n} fields (expected 5, or 6 with seconds)")),
        };
        let (seconds, _) = field(f[0], 0, 59, "second")?;
        let (minutes, _) = field(f[1], 0, 59, "minute")?;
        let (hours, _) = field(f[2], 0, 23, "hour")?;
        let (days, days_restricted) = field(f[3], 1, 31, "day of month")?;
        let (months, _) = field(f[4], 1, 12, "month")?;
        let (mut weekdays, weekdays_restricted) = field(f[5], 0, 7, "day of week")?;
        if weekdays & (1 << 7) != 0 {
            weekdays |= 1;
        }
        Ok(Cron {
            seconds,
            minutes,
            hours,
            days,
            months,
            weekdays,
            days_restricted,
            weekdays_restricted,
        })
    }
}

impl Cron {
    fn day_matches(&self, t: &DateTime<Utc>) -> bool {
        let dom = self.days & (1 << t.day()) != 0;
        let dow = self.weekdays & (1 << t.weekday().num_days_from_sunday()) != 0;
        if self.days_restricted && self.weekdays_restricted {
            dom || dow
        } else {
            dom && dow
        }
    }

    /// The first matching time strictly after `after` (whole seconds), within five years.
    pub fn next_after(&self, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let start = after.with_nanosecond(0)? + Duration::seconds(1);
        let mut minute = start.with_second(0)?;
        let limit = start + Duration::days(5 * 366);
        while minute < limit {
            let ok = self.months & (1 << minute.month()) != 0
                && self.day_matches(&minute)
                && self.hours & (1 << minute.hour()) != 0
                && self.minutes & (1 << minute.minute()) != 0;
            if ok {
                let from = if minute < start { start.second() } else { 0 };
                if let Some(s) = (from..60).find(|s| self.seconds & (1 << s) != 0) {
                    return minute.with_second(s);
                }
            }
            minute += Duration::minutes(1);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn at(y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(y, mo, d, h, mi, s).unwrap()
    }

    #[test]
    fn next_times_follow_the_fields() {
        let c: Cron = "30 3 * * *".parse().unwrap();
        assert_eq!(
            c.next_after(at(2026, 11, 22, 10, 0, 0)),
            Some(at(2026, 11, 23, 3, 30, 0))
        );
        let c: Cron = "*/15 * * * *".parse().unwrap();
        assert_eq!(
            c.next_after(at(2026, 11, 22, 10, 0, 0)),
            Some(at(2026, 11, 22, 10, 15, 0))
        );
        let c: Cron = "*/2 * * * * *".parse().unwrap();
        assert_eq!(
            c.next_after(at(2026, 11, 22, 10, 0, 59)),
            Some(at(2026, 11, 22, 10, 1, 0))
        );
        // Sundays at midnight (7 is Sunday too); 2026-11-22 is a Sunday.
        let c: Cron = "0 0 * * 7".parse().unwrap();
        assert_eq!(
            c.next_after(at(2026, 11, 22, 0, 0, 0)),
            Some(at(2026, 11, 29, 0, 0, 0))
        );
        // Both day fields restricted: either matches (the 1st, or any Monday).
        let c: Cron = "0 12 1 * 1".parse().unwrap();
        assert_eq!(
            c.next_after(at(2026, 11, 22, 13, 0, 0)),
            Some(at(2026, 11, 23, 12, 0, 0))
        );
        let c: Cron = "0 0 29 2 *".parse().unwrap();
        assert_eq!(
            c.next_after(at(2026, 3, 1, 0, 0, 0)),
            Some(at(2028, 2, 29, 0, 0, 0))
        );
        let c: Cron = "0 0 31 2 *".parse().unwrap();
        assert_eq!(c.next_after(at(2026, 3, 1, 0, 0, 0)), None);
    }

    #[test]
    fn bad_schedules_say_which_field() {
        for (s, what) in [
            ("61 * * * *", "minute"),
            ("* 24 * * *", "hour"),
            ("* * 0 * *", "day of month"),
            ("* * * 13 *", "month"),
            ("* * * * 8", "day of week"),
            ("*/0 * * * *", "step"),
            ("5-1 * * * *", "range"),
            ("* * *", "fields"),
        ] {
            let e = s.parse::<Cron>().unwrap_err();
            assert!(e.contains(what), "{s}: {e}");
        }
    }
}
