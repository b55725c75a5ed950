//! DNS SRV records, for the memcached store's servers (`store.srv`; envoyproxy/ratelimit's
//! `MEMCACHE_SRV` and `MEMCACHE_SRV_REFRESH`): one query over UDP to a name server, the
//! answer's targets as `host:port`, by priority then weight. The hosts are resolved as
//! any server's name is, when a connection is opened.
//!
//! A query by hand (RFC 1035's message, RFC 2782's record) rather than a resolver crate:
//! one record type, asked at start and every refresh, is a page of code.

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

/// The record type SRV.
const SRV: u16 = 33;

/// The servers `name` names (`_memcache._tcp.example.com`): `target:port` of each record,
/// lowest priority first, then highest weight; asked of `nameserver` (else the first of
/// /etc/resolv.conf, on port 53).
pub fn lookup(name: &str, nameserver: Option<SocketAddr>, timeout: Duration) -> Result<Vec<String>, String> {
    let server = match nameserver {
        Some(s) => s,
        None => system_nameserver()?,
    };
    let id = u16::from_le_bytes(rand2());
    let socket = UdpSocket::bind(if server.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }).map_err(|e| e.to_string())?;
    socket.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    socket.send_to(&query(id, name)?, server).map_err(|e| format!("{server}: {e}"))?;
    let mut buf = [0u8; 4096];
    let n = socket.recv(&mut buf).map_err(|e| format!("{server} did not answer: {e}"))?;
    let mut records = answer(&buf[..n], id).map_err(|e| format!("{server}: {e}"))?;
    if records.is_empty() {
        return Err(format!("{server} has no SRV record for {name}"));
    }
    records.sort_by_key(|r| (r.0, std::cmp::Reverse(r.1)));
    Ok(records.into_iter().map(|(_, _, port, target)| format!("{target}:{port}")).collect())
}

/// The first name server of /etc/resolv.conf, port 53.
fn system_nameserver() -> Result<SocketAddr, String> {
    let conf = std::fs::read_to_string("/etc/resolv.conf").map_err(|e| format!("/etc/resolv.conf: {e}"))?;
    let ip = conf
        .lines()
        .find_map(|l| l.trim().strip_prefix("nameserver")?.trim().parse::<std::net::IpAddr>().ok())
        .ok_or("/etc/resolv.conf names no nameserver")?;
    Ok(SocketAddr::new(ip, 53))
}

fn rand2() -> [u8; 2] {
    let mut b = [0u8; 2];
    let _ = getrandom::fill(&mut b);
    b
}

/// A query for the SRV records of `name`, recursion desired.
fn query(id: u16, name: &str) -> Result<Vec<u8>, String> {
    let mut q = Vec::with_capacity(32 + name.len());
    q.extend(id.to_be_bytes());
    q.extend([0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.trim_end_matches('.').split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err(format!("`{name}` is not a DNS name"));
        }
        q.push(label.len() as u8);
        q.extend(label.as_bytes());
    }
    q.push(0);
    q.extend(SRV.to_be_bytes());
    q.extend(1u16.to_be_bytes());
    Ok(q)
}

/// The SRV records of an answer to query `id`: (priority, weight, port, target).
fn answer(msg: &[u8], id: u16) -> Result<Vec<(u16, u16, u16, String)>, String> {
    let u16_at = |i: usize| msg.get(i..i + 2).map(|b| u16::from_be_bytes([b[0], b[1]])).ok_or("a short answer");
    if u16_at(0)? != id || msg[2] & 0x80 == 0 {
        return Err("an answer to another query".into());
    }
    match msg[3] & 0x0f {
        0 => {}
        3 => return Err("no such name (NXDOMAIN)".into()),
        code => return Err(format!("the query failed (RCODE {code})")),
    }
    let (questions, answers) = (u16_at(4)?, u16_at(6)?);
    let mut at = 12;
    for _ in 0..questions {
        at = name(msg, at)?.1 + 4;
    }
    let mut records = Vec::new();
    for _ in 0..answers {
        let after = name(msg, at)?.1;
        let (kind, len) = (u16_at(after)?, u16_at(after + 8)? as usize);
        let data = after + 10;
        if kind == SRV {
            let (target, _) = name(msg, data + 6)?;
            records.push((u16_at(data)?, u16_at(data + 2)?, u16_at(data + 4)?, target));
        }
        at = data + len;
    }
    Ok(records)
}

/// The name at `at` (labels, and pointers to earlier names), and where what follows it
/// begins.
fn name(msg: &[u8], mut at: usize) -> Result<(String, usize), String> {
    let (mut labels, mut end, mut jumps) = (Vec::new(), None, 0);
    loop {
        let len = *msg.get(at).ok_or("a name runs past the answer")? as usize;
        match len {
            0 => return Ok((labels.join("."), end.unwrap_or(at + 1))),
            l if l & 0xc0 == 0xc0 => {
                let to = ((l & 0x3f) << 8) | *msg.get(at + 1).ok_or("a short pointer")? as usize;
                end.get_or_insert(at + 2);
                jumps += 1;
                if jumps > 32 {
                    return Err("a name that points in a loop".into());
                }
                at = to;
            }
            l => {
                let label = msg.get(at + 1..at + 1 + l).ok_or("a label runs past the answer")?;
                labels.push(String::from_utf8_lossy(label).into_owned());
                at += 1 + l;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// dnsmasq's answer for `_memcache._tcp.sluice.test` (priority 0, weight 5, port
    /// 11311, target `localhost`), the target's name given whole.
    const ANSWER: &str = "123485800001000100000000095f6d656d6361636865045f74637006736c7569636504746573740000210001c00c00210001000000000011000000052c2f096c6f63616c686f737400";

    fn bytes(hex: &str) -> Vec<u8> {
        (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn an_answer_reads_as_its_records() {
        let msg = bytes(ANSWER);
        assert_eq!(answer(&msg, 0x1234).unwrap(), [(0, 5, 11311, "localhost".to_string())]);
        assert!(answer(&msg, 0x4321).is_err(), "another query's answer");
        assert_eq!(&query(0x1234, "_memcache._tcp.sluice.test").unwrap()[12..], &msg[12..44], "the question, echoed");
        let mut nx = msg.clone();
        nx[3] |= 3;
        assert!(answer(&nx, 0x1234).unwrap_err().contains("NXDOMAIN"));
        let mut looped = msg.clone();
        let n = looped.len();
        looped[n - 11..n - 9].copy_from_slice(&[0xc0, (n - 11) as u8]);
        assert!(answer(&looped, 0x1234).is_err(), "a pointer to itself");
        assert!(answer(&msg[..40], 0x1234).is_err(), "cut short");
    }
}
