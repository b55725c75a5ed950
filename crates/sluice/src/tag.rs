//! Client tags: where a client's state lives.
//!
//! All state of one client lives under one tag (invariant 5, docs/architecture.md): in Redis the tag is
//! the hash tag `{...}` of every key, so every limit of the client runs in one script on
//! one node. The tag is a keyed hash (SipHash-1-3, 128 bits, with a configured secret)
//! of domain and client identity (invariant 6): a client cannot choose where its state
//! lands, so crafted identities cannot pile onto one Redis Cluster slot or one memory
//! shard, and keys have a fixed length whatever a client sends.

use siphasher::sip::SipHasher13;
use siphasher::sip128::{Hasher128, SipHasher13 as SipHasher13x128};
use std::fmt;
use std::hash::Hasher;

/// A client's tag: 128 bits of keyed hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(pub u128);

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// Computes tags and state keys with a secret. Every server of a fleet must use the same
/// secret, or they will not find each other's state.
#[derive(Clone)]
pub struct Tagger {
    k0: u64,
    k1: u64,
}

impl fmt::Debug for Tagger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Tagger { .. }") // never print the secret
    }
}

/// Feeds length-prefixed parts, so ("ab","c") and ("a","bc") hash differently.
fn feed(h: &mut impl Hasher, parts: &[&[u8]]) {
    for p in parts {
        h.write_u64(p.len() as u64);
        h.write(p);
    }
}

impl Tagger {
    /// A tagger keyed by `secret`.
    pub fn new(secret: &str) -> Self {
        let mut h = SipHasher13x128::new_with_keys(0x736c_7569_6365_2d6b, 0x6579_2d64_6572_6976);
        feed(&mut h, &[secret.as_bytes()]);
        let k = h.finish128();
        Self { k0: k.h1, k1: k.h2 }
    }

    /// A keyed digest of `bytes`, apart from every tag (its own domain word): what an
    /// interface signs a token it hands out with, so a token is taken back only as
    /// issued (by any instance of the fleet, which shares the secret).
    pub fn seal(&self, bytes: &[u8]) -> u128 {
        let mut h = SipHasher13x128::new_with_keys(self.k0, self.k1);
        feed(&mut h, &[b"sluice-seal", bytes]);
        h.finish128().as_u128()
    }

    /// The tag of the client `key=value` in `domain`.
    pub fn tag(&self, domain: &str, key: &str, value: &str) -> Tag {
        self.tag_of(domain, &[(key, value)])
    }

    /// The tag of the client a descriptor's `entries` name together in `domain`: the
    /// same as [`Tagger::tag`] for one entry, so a one-entry client's state stays where
    /// it was.
    pub fn tag_of(&self, domain: &str, entries: &[(&str, &str)]) -> Tag {
        let mut h = SipHasher13x128::new_with_keys(self.k0, self.k1);
        feed(&mut h, &[domain.as_bytes()]);
        for (key, value) in entries {
            feed(&mut h, &[key.as_bytes(), value.as_bytes()]);
        }
        Tag(h.finish128().as_u128())
    }

    /// The key of one policy's state for one descriptor (every entry, in order, and the
    /// policy's name and algorithm), under a client's tag.
    pub fn state_key<'a>(
        &self,
        entries: impl IntoIterator<Item = (&'a str, &'a str)>,
        policy: &str,
        algorithm: &str,
    ) -> u64 {
        let mut h = SipHasher13::new_with_keys(self.k1, self.k0);
        for (k, v) in entries {
            feed(&mut h, &[k.as_bytes(), v.as_bytes()]);
        }
        feed(&mut h, &[policy.as_bytes(), algorithm.as_bytes()]);
        h.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_depend_on_secret_domain_and_identity() {
        let a = Tagger::new("one");
        let b = Tagger::new("two");
        assert_eq!(a.tag("d", "user", "x"), a.tag("d", "user", "x"));
        assert_ne!(a.tag("d", "user", "x"), b.tag("d", "user", "x"));
        assert_ne!(a.tag("d", "user", "x"), a.tag("e", "user", "x"));
        assert_ne!(a.tag("d", "user", "ab"), a.tag("d", "usera", "b"));
        assert_eq!(a.tag("d", "u", "v").to_string().len(), 32);
        // one entry: the same tag either way; more: every entry counts, in order
        assert_eq!(a.tag_of("d", &[("user", "x")]), a.tag("d", "user", "x"));
        let pair = a.tag_of("d", &[("route", "/a"), ("user", "x")]);
        assert_ne!(pair, a.tag_of("d", &[("route", "/a"), ("user", "y")]));
        assert_ne!(pair, a.tag_of("d", &[("user", "x"), ("route", "/a")]));
        assert_ne!(pair, a.tag("d", "route", "/a"));
    }
}
