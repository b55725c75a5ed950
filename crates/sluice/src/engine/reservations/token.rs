//! A reservation as its commit needs it ([`Reserved`]), and its compact binary form: what
//! a client carries in its token, sealed against forgery by the server.

use crate::algo::{Limit, Op};
use crate::tag::Tag;

/// A reservation as its commit needs it, resolved when it was admitted: its number, the
/// request's domain, and each window it holds (client tag, state, limit) with the
/// descriptors whose actuals it takes. The commit settles exactly these windows, on
/// any instance, whatever the rules or overrides have become since, and names no
/// descriptor value (tags and states are keyed digests). [`Reserved::to_bytes`] is
/// bounded: a reservation holds at most [`MAX_RESERVED_WINDOWS`] windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    pub(super) id: u64,
    pub(super) domain: String,
    pub(super) descriptors: u16,
    pub(super) groups: Vec<(Tag, Vec<HeldWindow>)>,
}

/// One window a reservation holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct HeldWindow {
    pub(super) key: u64,
    pub(super) limit: Limit,
    /// A digest of the policy's name, for its counters at the commit.
    pub(super) policy: u64,
    /// The descriptors (by index) whose actuals it takes: more than one when a request
    /// names one window twice (their holds are summed into one, and so are their actuals).
    pub(super) of: Vec<u16>,
    /// A global limit's window: its units came from the region's pool, and the store
    /// holds the reservation on the window's ledger (`ledger`).
    pub(super) global: bool,
}

impl HeldWindow {
    /// The window's op at `cost`.
    pub(super) fn op(&self, cost: u64) -> Op {
        Op { key: self.key, limit: self.limit, cost, lease: None, shadow: false }
    }
}

/// The most windows one reservation may hold (a request whose descriptors reach more is
/// refused, saying so): what keeps a reservation's id short whatever was reserved.
pub const MAX_RESERVED_WINDOWS: usize = 64;

/// The most descriptors one reservation may name (however high
/// `limiter.request_bounds.descriptors` is set): each window counts its own in a byte.
pub const MAX_RESERVED_DESCRIPTORS: usize = 255;

/// The version byte of [`Reserved::to_bytes`].
const RESERVED_V1: u8 = 1;

impl Reserved {
    /// How many descriptors the reservation named (a commit sends one actual each, or
    /// one for all).
    pub fn descriptors(&self) -> usize {
        self.descriptors.into()
    }

    /// A compact binary form (for a token a client carries; seal it against forgery).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![RESERVED_V1];
        b.extend(self.id.to_le_bytes());
        b.extend((self.domain.len() as u16).to_le_bytes());
        b.extend(self.domain.as_bytes());
        b.extend(self.descriptors.to_le_bytes());
        b.push(self.groups.len() as u8);
        for (tag, windows) in &self.groups {
            b.extend(tag.0.to_le_bytes());
            b.push(windows.len() as u8);
            for w in windows {
                let Limit::FixedWindow { limit, window, aligned } = w.limit else { unreachable!("fixed windows only") };
                b.extend(w.key.to_le_bytes());
                b.extend(limit.to_le_bytes());
                b.extend(window.to_le_bytes());
                // bit 0: aligned; bit 1: a global limit's (a token of version 1 has no bit 1)
                b.push(u8::from(aligned) | u8::from(w.global) << 1);
                b.extend(w.policy.to_le_bytes());
                b.push(w.of.len() as u8);
                for d in &w.of {
                    b.extend(d.to_le_bytes());
                }
            }
        }
        b
    }

    /// What [`Reserved::to_bytes`] wrote, if it is that.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        let mut r = Reader(b);
        if r.u8()? != RESERVED_V1 {
            return None;
        }
        let id = r.u64()?;
        let n = r.u16()? as usize;
        let domain = String::from_utf8(r.take(n)?.to_vec()).ok()?;
        let descriptors = r.u16()?;
        let mut groups = Vec::new();
        for _ in 0..r.u8()? {
            let tag = Tag(u128::from_le_bytes(r.take(16)?.try_into().ok()?));
            let mut windows = Vec::new();
            for _ in 0..r.u8()? {
                let key = r.u64()?;
                let (limit, window, flags) = (r.u64()?, r.u64()?, r.u8()?);
                if flags > 3 {
                    return None;
                }
                let limit = Limit::FixedWindow { limit, window, aligned: flags & 1 == 1 };
                let policy = r.u64()?;
                let of = (0..r.u8()?).map(|_| r.u16()).collect::<Option<Vec<u16>>>()?;
                if of.iter().any(|&d| d >= descriptors) {
                    return None;
                }
                windows.push(HeldWindow { key, limit, policy, of, global: flags & 2 == 2 });
            }
            groups.push((tag, windows));
        }
        r.0.is_empty().then_some(Self { id, domain, descriptors, groups })
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = rest;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}
