//! The values of a config that can be wrong on their own, checked as they are read so
//! the parser can point at them: durations (`250ms`, `5m`), `grants:`, envoyproxy/
//! ratelimit's units, and names.

use crate::time::Millis;
use serde::{Deserialize, Deserializer, de};
use std::fmt;

/// A duration written `250ms`, `1s`, `5m`, `1h`, `1d` (or `1w`), in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Duration(pub Millis);

impl Duration {
    /// The same span as a [`std::time::Duration`].
    pub fn to_std(self) -> std::time::Duration {
        std::time::Duration::from_millis(self.0)
    }

    /// Parses `250ms`, `1s`, `5m`, `1h`, `1d`, `1w`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        let scale = match unit.trim() {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            "w" => 604_800_000,
            _ => {
                return Err(format!(
                    "invalid duration `{s}`: write a whole number and a unit, like 250ms, 1s, 5m, 1h or 1d"
                ));
            }
        };
        let n: u64 =
            num.parse().map_err(|_| format!("invalid duration `{s}`: it must start with a whole number, like 30s"))?;
        n.checked_mul(scale).map(Duration).ok_or_else(|| format!("duration `{s}` is too long"))
    }
}

/// The largest whole unit: `90s` stays `90s`, `3600000ms` is `1h`.
impl fmt::Display for Duration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let units = [(604_800_000, "w"), (86_400_000, "d"), (3_600_000, "h"), (60_000, "m"), (1_000, "s")];
        match units.iter().find(|(scale, _)| self.0 > 0 && self.0 % scale == 0) {
            Some((scale, unit)) => write!(f, "{}{unit}", self.0 / scale),
            None => write!(f, "{}ms", self.0),
        }
    }
}

impl serde::Serialize for Duration {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Duration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = Duration;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a duration like 250ms, 1s, 5m, 1h or 1d")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
                Duration::parse(v).map_err(E::custom)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Duration, E> {
                Err(E::custom(format!("invalid duration `{v}`: add a unit, like {v}s or {v}ms")))
            }
        }
        d.deserialize_any(V)
    }
}

/// `grants:` on a rule: how its limits take quota grants (see docs/configuration.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grants {
    /// The most units one grant takes (`auto`: as many as the key's rate over `refresh`,
    /// within the store's share of what is left).
    pub max: Option<u64>,
    /// How long a grant should last at the key's rate: the next is asked for when a
    /// quarter of the current one is left.
    pub refresh: Millis,
}

impl Grants {
    /// `grants: auto`.
    pub const AUTO: Grants = Grants { max: None, refresh: 100 };
}

impl<'de> Deserialize<'de> for Grants {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Tuned {
            #[serde(default)]
            max: Option<u64>,
            #[serde(default)]
            refresh: Option<Duration>,
        }
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = Grants;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("`auto`, or a map with `max` (units) and `refresh` (a duration like 100ms)")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Grants, E> {
                match v {
                    "auto" => Ok(Grants::AUTO),
                    _ => Err(E::custom(format!("grants: `{v}` is not `auto` or a map of `max` and `refresh`"))),
                }
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Grants, A::Error> {
                let t = Tuned::deserialize(de::value::MapAccessDeserializer::new(map))?;
                let refresh = t.refresh.map_or(Grants::AUTO.refresh, |r| r.0);
                if t.max == Some(0) || refresh == 0 {
                    return Err(de::Error::custom("grants: `max` and `refresh` must be above 0"));
                }
                Ok(Grants { max: t.max, refresh })
            }
        }
        d.deserialize_any(V)
    }
}

/// envoyproxy/ratelimit's units. Month and year are 30 and 365 days, as they compute them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

impl Unit {
    const NAMES: [(&'static str, Unit); 7] = [
        ("second", Unit::Second),
        ("minute", Unit::Minute),
        ("hour", Unit::Hour),
        ("day", Unit::Day),
        ("week", Unit::Week),
        ("month", Unit::Month),
        ("year", Unit::Year),
    ];

    /// Parses a unit name in any case (`minute`, `MINUTE`).
    pub fn parse(s: &str) -> Result<Self, String> {
        Self::NAMES
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(s))
            .map(|&(_, u)| u)
            .ok_or_else(|| format!("unknown unit `{s}`: write one of second, minute, hour, day, week, month, year"))
    }

    /// The unit's length in ms.
    pub fn millis(self) -> Millis {
        1000 * match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 604_800,
            Unit::Month => 2_592_000,
            Unit::Year => 31_536_000,
        }
    }

    /// The name as Envoy's protocol spells it (`MINUTE`).
    pub fn envoy_name(self) -> &'static str {
        match self {
            Unit::Second => "SECOND",
            Unit::Minute => "MINUTE",
            Unit::Hour => "HOUR",
            Unit::Day => "DAY",
            Unit::Week => "WEEK",
            Unit::Month => "MONTH",
            Unit::Year => "YEAR",
        }
    }

    /// The unit whose length is exactly `ms`, if any.
    pub fn from_millis(ms: Millis) -> Option<Self> {
        Self::NAMES.iter().map(|&(_, u)| u).find(|u| u.millis() == ms)
    }

    /// Its name as written in a config (`minute`).
    pub fn name(self) -> &'static str {
        Self::NAMES.iter().find(|&&(_, u)| u == self).map_or("unknown", |&(n, _)| n)
    }
}

impl<'de> Deserialize<'de> for Unit {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Unit::parse(&s).map_err(de::Error::custom)
    }
}

/// A name of a domain or policy: 1 to 256 characters of `A-Z a-z 0-9 _ . - /`, so it is
/// safe in keys, metrics labels and headers. `/` because Envoy Gateway names each domain
/// after its listener, `NAMESPACE/GATEWAY/LISTENER`; 256 because those parts are
/// Kubernetes names of up to 63 characters and more.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Name(pub String);

impl Name {
    /// Checks a name.
    pub fn parse(s: &str) -> Result<Self, String> {
        let ok =
            !s.is_empty() && s.len() <= 256 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-/".contains(&b));
        if ok {
            Ok(Name(s.to_string()))
        } else {
            Err(format!("invalid name `{s}`: use 1 to 256 characters of letters, digits, `_`, `.`, `-` and `/`"))
        }
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Name {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Name::parse(&s).map_err(de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(Duration::parse("250ms"), Ok(Duration(250)));
        assert_eq!(Duration::parse("5m"), Ok(Duration(300_000)));
        assert_eq!(Duration::parse("1d"), Ok(Duration(86_400_000)));
        assert!(Duration::parse("5x").unwrap_err().contains("250ms"));
        assert!(Duration::parse("m").is_err());
    }

    #[test]
    fn units_any_case() {
        assert_eq!(Unit::parse("MINUTE"), Ok(Unit::Minute));
        assert!(Unit::parse("fortnight").unwrap_err().contains("second, minute"));
        assert_eq!(Unit::Month.millis(), 30 * 86_400_000);
    }
}
