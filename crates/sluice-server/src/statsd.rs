//! StatsD, as envoyproxy/ratelimit sends it (`telemetry.statsd`; their `USE_STATSD`,
//! `STATSD_HOST`, `STATSD_PORT`, `STATS_FLUSH_INTERVAL`, `EXTRA_TAGS`, `USE_DOG_STATSD`):
//! every flush interval, each `rate_limit:` rule's hits since the last flush, as
//! counters under their stat names, `ratelimit.service.rate_limit.DOMAIN.KEY.total_hits`
//! (and `over_limit`, `near_limit`, `within_limit`, `shadow_mode`). The counts are the
//! ones the debug listener's `/stats` shows ([`sluice::rules::Rules::stats`]), kept in
//! process; `/metrics` counts the same decisions.
//!
//! Two line formats: Lyft's (their gostats: tags folded into the name as
//! `NAME.__KEY=VALUE`, `NAME:N|c`), sent over TCP by default as theirs is; and
//! DogStatsD's (`NAME:N|c|#KEY:VALUE`), over UDP as Datadog's agent takes it. A counter
//! that did not move is not sent. A server that does not answer costs a line in the log
//! at most every 10 s; what could not be sent is dropped (StatsD counters are deltas:
//! a later flush does not resend them), and the next flush tries again.

use crate::app::AppState;
use crate::config::{Format, Mogrifier, Protocol, StatsdConfig};
use crate::logs::Sometimes;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::io::AsyncWriteExt;

/// The largest UDP datagram sent: what fits a path of 1,500 bytes with its headers.
const DATAGRAM: usize = 1_432;

/// Sends the stats every `flush_interval` until the process ends.
pub fn start(config: StatsdConfig, state: Arc<AppState>) {
    tokio::spawn(async move {
        let mogrifiers = compiled(&config.mogrifiers);
        let mut sender = Sender { config, mogrifiers, last: HashMap::new(), tcp: None, log: Sometimes::default() };
        let mut tick = tokio::time::interval(sender.config.flush_interval.to_std());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let mut stats = state.engine.load().limiter.rules().stats();
            stats.extend(state.service_stats.counters());
            let mut lines = sender.lines(&stats);
            let timer = "ratelimit_server.ShouldRateLimit.response_time";
            let times = state.service_stats.take_times();
            lines.extend(times.iter().map(|ms| sender.line(timer, &format!("{ms:.3}"), "ms")));
            if let Err(e) = sender.send(&lines).await {
                if sender.log.due() {
                    tracing::warn!(address = %sender.config.address, error = %e, "cannot send stats to StatsD (logged at most every 10 s); they are dropped");
                }
            }
        }
    });
}

struct Sender {
    config: StatsdConfig,
    mogrifiers: Vec<(regex_lite::Regex, Mogrifier)>,
    /// What each stat was at the last flush.
    last: HashMap<String, u64>,
    tcp: Option<tokio::net::TcpStream>,
    log: Sometimes,
}

impl Sender {
    /// The lines for what moved since the last flush. A count below the last one seen is
    /// a new counter (a reload compiled the rules again): all of it is new.
    fn lines(&mut self, stats: &[(String, u64)]) -> Vec<String> {
        let mut out = Vec::new();
        for (name, now) in stats {
            let before = self.last.insert(name.clone(), *now).unwrap_or(0);
            let delta = if *now >= before { now - before } else { *now };
            if delta > 0 {
                out.push(self.line(name, &delta.to_string(), "c"));
            }
        }
        out
    }

    async fn send(&mut self, lines: &[String]) -> std::io::Result<()> {
        if lines.is_empty() {
            return Ok(());
        }
        match self.config.protocol {
            Protocol::Udp => {
                let socket = tokio::net::UdpSocket::bind(("0.0.0.0", 0)).await?;
                socket.connect(&self.config.address).await?;
                for datagram in datagrams(lines) {
                    socket.send(datagram.as_bytes()).await?;
                }
                Ok(())
            }
            Protocol::Tcp => {
                let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
                if self.tcp.is_none() {
                    self.tcp = Some(tokio::net::TcpStream::connect(&self.config.address).await?);
                }
                let sent = self.tcp.as_mut().expect("connected above").write_all(text.as_bytes()).await;
                if sent.is_err() {
                    // the connection went away: the next flush opens another
                    self.tcp = None;
                }
                sent
            }
        }
    }
}

impl Sender {
    /// One stat's line in the config's format: `value` of `kind` (`c` a counter's delta,
    /// `ms` a timer's sample). DogStatsD's: the name mogrified, its tags after the config's.
    /// The name is [`sanitized`] first: parts of it are descriptor values clients send.
    fn line(&self, name: &str, value: &str, kind: &str) -> String {
        let name = &sanitized(name);
        let config = &self.config;
        match config.format {
            Format::Lyft => {
                let tags: String = config.tags.iter().map(|(k, v)| format!(".__{k}={v}")).collect();
                format!("{name}{tags}:{value}|{kind}")
            }
            Format::Dogstatsd => {
                let (name, extra) = mogrify(&self.mogrifiers, name);
                let tags: Vec<String> = config.tags.iter().map(|(k, v)| format!("{k}:{v}")).chain(extra).collect();
                match tags.is_empty() {
                    true => format!("{name}:{value}|{kind}"),
                    false => format!("{name}:{value}|{kind}|#{}", tags.join(",")),
                }
            }
        }
    }
}

/// The mogrifiers with their patterns compiled (each checked at load: `checks::telemetry`).
/// `name` with what StatsD and DogStatsD read as syntax replaced by `_`: `:` (the value
/// follows), `|` (the type, the sample rate, the tags), `@` (a sample rate), `#` (tags),
/// whitespace and control characters (a line ends). A `detailed_metric` rule's names
/// hold descriptor values as clients send them: `a:999|c` must not add a counter.
fn sanitized(name: &str) -> std::borrow::Cow<'_, str> {
    let syntax = |c: char| matches!(c, ':' | '|' | '@' | '#') || c.is_whitespace() || c.is_control();
    match name.contains(syntax) {
        true => name.replace(syntax, "_").into(),
        false => name.into(),
    }
}

fn compiled(mogrifiers: &[Mogrifier]) -> Vec<(regex_lite::Regex, Mogrifier)> {
    mogrifiers.iter().filter_map(|m| Some((regex_lite::Regex::new(&m.pattern).ok()?, m.clone()))).collect()
}

/// `name` rewritten by the first mogrifier whose pattern matches it, with its tags (as
/// their godogstats does); unchanged, without tags, when none does.
fn mogrify(mogrifiers: &[(regex_lite::Regex, Mogrifier)], name: &str) -> (String, Vec<String>) {
    for (pattern, m) in mogrifiers {
        let Some(found) = pattern.captures(name) else { continue };
        let groups: Vec<&str> = (0..found.len()).map(|i| found.get(i).map_or("", |g| g.as_str())).collect();
        let tags = m.tags.iter().map(|(k, v)| format!("{k}:{}", placed(v, &groups))).collect();
        return (placed(&m.name, &groups), tags);
    }
    (name.to_string(), Vec::new())
}

/// `pattern` with each `$N` replaced by group N of the match (left as written past the
/// last group).
fn placed(pattern: &str, groups: &[&str]) -> String {
    let mut out = String::new();
    let mut rest = pattern;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let digits: String = rest[at + 1..].chars().take_while(char::is_ascii_digit).collect();
        match digits.parse::<usize>().ok().and_then(|i| groups.get(i)) {
            Some(g) => out.push_str(g),
            None => out.push_str(&rest[at..at + 1 + digits.len()]),
        }
        rest = &rest[at + 1 + digits.len()..];
    }
    out + rest
}

/// `lines` packed into datagrams of at most [`DATAGRAM`] bytes, a line never split.
fn datagrams(lines: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for l in lines {
        match out.last_mut() {
            Some(d) if d.len() + 1 + l.len() <= DATAGRAM => {
                d.push('\n');
                d.push_str(l);
            }
            _ => out.push(l.clone()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(format: Format, tags: &[(&str, &str)]) -> StatsdConfig {
        StatsdConfig {
            address: "127.0.0.1:8125".into(),
            protocol: Protocol::Tcp,
            format,
            flush_interval: sluice::config::Duration(10_000),
            tags: tags.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            mogrifiers: Vec::new(),
        }
    }

    #[test]
    fn lines_are_deltas_in_either_format() {
        let name = "ratelimit.service.rate_limit.d.user.total_hits".to_string();
        let mut s = Sender {
            config: config(Format::Lyft, &[("env", "prod")]),
            mogrifiers: Vec::new(),
            last: HashMap::new(),
            tcp: None,
            log: Default::default(),
        };
        assert_eq!(s.lines(&[(name.clone(), 3)]), ["ratelimit.service.rate_limit.d.user.total_hits.__env=prod:3|c"]);
        assert!(s.lines(&[(name.clone(), 3)]).is_empty(), "nothing moved, nothing sent");
        assert_eq!(s.lines(&[(name.clone(), 5)]), ["ratelimit.service.rate_limit.d.user.total_hits.__env=prod:2|c"]);
        assert_eq!(s.lines(&[(name.clone(), 1)]).len(), 1, "a counter compiled again counts from 0");
        s.config = config(Format::Dogstatsd, &[("env", "prod"), ("az", "b")]);
        assert_eq!(s.line(&name, "4", "c"), "ratelimit.service.rate_limit.d.user.total_hits:4|c|#az:b,env:prod");
        // their mogrifiers: the first that matches names it and adds its tags
        let m = |pattern: &str, name: &str, tags: &[(&str, &str)]| Mogrifier {
            pattern: pattern.into(),
            name: name.into(),
            tags: tags.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        };
        s.mogrifiers = compiled(&[
            m(
                r"^ratelimit\.service\.rate_limit\.([^.]+)\.(.+)\.(\w+)$",
                "ratelimit.service.rate_limit.$3",
                &[("domain", "$1"), ("descriptor", "$2")],
            ),
            m(r"^ratelimit", "never.reached", &[]),
        ]);
        assert_eq!(
            s.line(&name, "4", "c"),
            "ratelimit.service.rate_limit.total_hits:4|c|#az:b,env:prod,descriptor:user,domain:d"
        );
        assert_eq!(s.line("other.stat", "1", "c"), "other.stat:1|c|#az:b,env:prod", "no match: as it was");
        assert_eq!(placed("$1-$9-$", &["all", "one"]), "one-$9-$");
    }

    #[test]
    fn datagrams_hold_whole_lines() {
        let lines: Vec<String> =
            (0..100).map(|i| format!("ratelimit.service.rate_limit.d.k{i:03}.total_hits:1|c")).collect();
        let grams = datagrams(&lines);
        assert!(grams.len() > 1 && grams.iter().all(|g| g.len() <= DATAGRAM));
        assert_eq!(grams.join("\n").lines().count(), 100);
    }
}
