//! envoyproxy/ratelimit's `RateLimitConfig` (go-control-plane's
//! `ratelimit/config/ratelimit/v3/rls_conf.proto`), declared by hand with its field
//! numbers (no crate carries it), and its reading as a domain of rules: the same model
//! their config files give, so a pushed domain and a file's compile alike.

use envoy_types::pb::google::protobuf::{Struct, Value as PbValue, value::Kind};
use serde_json::{Value, json};
use sluice::config::DomainConfig;

/// The resource type this client subscribes to.
pub const TYPE_URL: &str = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// One domain's rules.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimitConfig {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub domain: String,
    #[prost(message, repeated, tag = "3")]
    pub descriptors: Vec<RateLimitDescriptor>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimitDescriptor {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
    #[prost(message, optional, tag = "3")]
    pub rate_limit: Option<RateLimitPolicy>,
    #[prost(message, repeated, tag = "4")]
    pub descriptors: Vec<RateLimitDescriptor>,
    #[prost(bool, tag = "5")]
    pub shadow_mode: bool,
    #[prost(bool, tag = "6")]
    pub detailed_metric: bool,
    #[prost(bool, tag = "7")]
    pub quota_mode: bool,
    #[prost(message, optional, tag = "8")]
    pub metadata: Option<Struct>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimitPolicy {
    /// `RateLimitUnit`: UNKNOWN 0, SECOND 1, MINUTE 2, HOUR 3, DAY 4, MONTH 5, YEAR 6,
    /// WEEK 7.
    #[prost(int32, tag = "1")]
    pub unit: i32,
    #[prost(uint32, tag = "2")]
    pub requests_per_unit: u32,
    #[prost(bool, tag = "3")]
    pub unlimited: bool,
    #[prost(string, tag = "4")]
    pub name: String,
    #[prost(message, repeated, tag = "5")]
    pub replaces: Vec<RateLimitReplace>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimitReplace {
    #[prost(string, tag = "1")]
    pub name: String,
}

impl RateLimitConfig {
    /// The domain this resource describes, read as their loader reads it (an empty
    /// string is an absent field), or what is wrong with it.
    pub fn domain(&self) -> Result<DomainConfig, String> {
        let descriptors = self.descriptors.iter().map(descriptor).collect::<Result<Vec<_>, _>>()?;
        let domain = json!({"domain": self.domain, "descriptors": descriptors});
        serde_json::from_value(domain).map_err(|e| e.to_string())
    }
}

/// A descriptor in the shape of their YAML.
fn descriptor(d: &RateLimitDescriptor) -> Result<Value, String> {
    let mut v = json!({"key": d.key, "shadow_mode": d.shadow_mode, "quota_mode": d.quota_mode,
        "detailed_metric": d.detailed_metric});
    if !d.value.is_empty() {
        v["value"] = json!(d.value);
    }
    if let Some(p) = &d.rate_limit {
        v["rate_limit"] = policy(p).map_err(|e| format!("descriptor `{}`: {e}", d.key))?;
    }
    if !d.descriptors.is_empty() {
        v["descriptors"] = Value::Array(d.descriptors.iter().map(descriptor).collect::<Result<_, _>>()?);
    }
    if let Some(m) = &d.metadata {
        v["metadata"] = structure(m);
    }
    Ok(v)
}

fn policy(p: &RateLimitPolicy) -> Result<Value, String> {
    let unit = match p.unit {
        0 => None,
        1 => Some("second"),
        2 => Some("minute"),
        3 => Some("hour"),
        4 => Some("day"),
        5 => Some("month"),
        6 => Some("year"),
        7 => Some("week"),
        n => return Err(format!("rate_limit unit {n} is not a RateLimitUnit")),
    };
    if unit.is_none() && !p.unlimited {
        return Err("rate_limit has no unit (UNKNOWN): set SECOND, MINUTE, HOUR, DAY, WEEK, MONTH or YEAR".into());
    }
    let mut v = json!({"unlimited": p.unlimited});
    if let Some(unit) = unit {
        v["unit"] = json!(unit);
        v["requests_per_unit"] = json!(p.requests_per_unit);
    }
    if !p.name.is_empty() {
        v["name"] = json!(p.name);
    }
    if !p.replaces.is_empty() {
        v["replaces"] = p.replaces.iter().map(|r| json!({"name": r.name})).collect();
    }
    Ok(v)
}

/// A protobuf `Struct` as JSON.
fn structure(s: &Struct) -> Value {
    Value::Object(s.fields.iter().map(|(k, v)| (k.clone(), value(v))).collect())
}

fn value(v: &PbValue) -> Value {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::NumberValue(n)) => json!(n),
        Some(Kind::StringValue(s)) => json!(s),
        Some(Kind::BoolValue(b)) => json!(b),
        Some(Kind::StructValue(s)) => structure(s),
        Some(Kind::ListValue(l)) => Value::Array(l.values.iter().map(value).collect()),
    }
}

/// A resource's bytes as a `RateLimitConfig`, or why not in a line: prost's error names
/// every level it was in (a push 1,000 descriptors deep gave a NACK of 3.3 KB repeating
/// `RateLimitDescriptor.descriptors`), so the levels are counted instead.
pub fn decode(bytes: &[u8]) -> Result<RateLimitConfig, String> {
    use prost::Message;
    RateLimitConfig::decode(bytes).map_err(|e| {
        let text = e.to_string();
        let levels = text.matches("RateLimitDescriptor.descriptors").count();
        let reason = text.rsplit(": ").next().unwrap_or(&text);
        match levels {
            0 => text,
            n => format!("descriptors nested {n} levels deep: {reason} (at most 100 levels decode)"),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A push nested past protobuf's recursion limit is refused in a line, not a path
    /// of every level.
    #[test]
    fn a_push_too_deep_is_refused_in_a_line() {
        use prost::Message;
        let mut d = limited("last", "", 1, 1);
        for level in 0..1_000 {
            d = RateLimitDescriptor { key: format!("level{level}"), descriptors: vec![d], ..Default::default() };
        }
        let c = RateLimitConfig { name: "deep".into(), domain: "d".into(), descriptors: vec![d] };
        let e = decode(&c.encode_to_vec()).unwrap_err();
        assert!(e.len() < 200 && e.contains("nested") && e.contains("recursion limit"), "{} bytes: {e}", e.len());
    }

    fn limited(key: &str, value: &str, unit: i32, n: u32) -> RateLimitDescriptor {
        let rate_limit = Some(RateLimitPolicy { unit, requests_per_unit: n, ..Default::default() });
        RateLimitDescriptor { key: key.into(), value: value.into(), rate_limit, ..Default::default() }
    }

    /// Every field their loader reads becomes the model's: nested descriptors, values,
    /// units, names, replaces, shadow mode, detailed metrics and metadata.
    #[test]
    fn a_resource_reads_as_their_yaml_does() {
        let mut outer = limited("generic_key", "eg", 2, 10);
        let mut inner = limited("user", "", 1, 3);
        inner.shadow_mode = true;
        inner.detailed_metric = true;
        let p = inner.rate_limit.as_mut().unwrap();
        p.name = "per-user".into();
        p.replaces = vec![RateLimitReplace { name: "other".into() }];
        outer.descriptors.push(inner);
        let mut unlimited = RateLimitDescriptor { key: "vip".into(), ..Default::default() };
        unlimited.rate_limit = Some(RateLimitPolicy { unlimited: true, ..Default::default() });
        let meta = PbValue { kind: Some(Kind::StringValue("team-a".into())) };
        unlimited.metadata = Some(Struct { fields: [("owner".to_string(), meta)].into() });
        let c = RateLimitConfig { name: "r".into(), domain: "d".into(), descriptors: vec![outer, unlimited] };
        let d = c.domain().unwrap();
        assert_eq!(d.domain.0, "d");
        let (o, u) = (&d.descriptors[0], &d.descriptors[1]);
        assert_eq!((o.key.as_str(), o.value.as_deref()), ("generic_key", Some("eg")));
        let rl = o.rate_limit.as_ref().unwrap();
        assert_eq!((rl.unit, rl.requests_per_unit), (Some(sluice::config::Unit::Minute), Some(10)));
        let i = &o.descriptors[0];
        assert!(i.value.is_none() && i.shadow_mode && i.detailed_metric);
        let rl = i.rate_limit.as_ref().unwrap();
        assert_eq!(rl.name.as_ref().unwrap().0, "per-user");
        assert_eq!(rl.replaces[0].name.0, "other");
        assert!(u.rate_limit.as_ref().unwrap().unlimited && u.rate_limit.as_ref().unwrap().unit.is_none());
        assert_eq!(u.metadata.as_ref().unwrap()["owner"], "team-a");
    }

    #[test]
    fn what_cannot_be_read_says_where() {
        let c = RateLimitConfig { name: "r".into(), domain: "d".into(), descriptors: vec![limited("k", "", 0, 5)] };
        assert!(c.domain().unwrap_err().contains("descriptor `k`: rate_limit has no unit"));
    }

    /// `quota_mode` is read (it was NACKed), each rule's own.
    #[test]
    fn quota_mode_is_read() {
        let mut q = limited("q", "", 1, 5);
        q.quota_mode = true;
        q.descriptors.push(limited("inner", "", 1, 5));
        let c = RateLimitConfig { name: "r".into(), domain: "d".into(), descriptors: vec![q] };
        let d = c.domain().unwrap();
        assert!(d.descriptors[0].quota_mode && !d.descriptors[0].descriptors[0].quota_mode);
    }
}
