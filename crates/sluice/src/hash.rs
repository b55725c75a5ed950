//! Every small hash Sluice computes, in one place, with what each is for.
//!
//! None of these has to resist an attacker: each input is already a keyed SipHash (a
//! client [`Tag`](crate::tag::Tag) or a state key, see `tag.rs` and invariant 6), so a
//! client cannot steer the outputs. Each function only spreads or folds bits for one
//! purpose. Their outputs decide where state lives (which memory shard, Redis bucket,
//! shard or migration side), so **changing any of them moves clients**: a moved client
//! starts afresh. Change one only with a migration plan.

/// 2^64 divided by the golden ratio, odd: multiplying by it is a bijection of u64 that
/// carries each low bit into many high ones (Fibonacci hashing).
pub(crate) const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// A 128-bit odd constant for the same purpose on tags.
const GOLDEN_128: u128 = 0x2545_f491_4f6c_dd1d_9e37_79b9_7f4a_7c15;

/// A state key spread over 64 bits (a bijection). Used by the memory store's table slot
/// and in Redis and Memcached field names.
pub(crate) fn spread(key: u64) -> u64 {
    key.wrapping_mul(GOLDEN)
}

/// A tag spread over 128 bits (a bijection), before its bits are taken apart: the high
/// half chooses a Redis bucket, the low half (with a state key, [`state_name`]) names a
/// state inside it.
pub(crate) fn spread_tag(tag: u128) -> u128 {
    tag.wrapping_mul(GOLDEN_128)
}

/// The name of state `key` of a client inside its Redis bucket, from the half of the
/// spread tag that did not choose the bucket: the pair packed into 128 bits and spread
/// (a bijection); the name is its top bits.
#[cfg(feature = "redis")]
pub(crate) fn state_name(client: u64, key: u64) -> u128 {
    spread_tag(u128::from(client) << 64 | u128::from(spread(key)))
}

/// A tag folded to 64 bits.
pub(crate) fn fold(tag: u128) -> u64 {
    tag as u64 ^ (tag >> 64) as u64
}

/// The rendezvous score of a tag on shard `shard` (client-side sharding): splitmix64's
/// finalizer over the folded tag plus the shard's multiple of [`GOLDEN`]. The shard with
/// the highest score holds the client, so adding a shard moves only the clients whose
/// new highest score is the new shard.
#[cfg(feature = "redis")]
pub(crate) fn rendezvous(tag: u128, shard: u64) -> u64 {
    let mut z = fold(tag).wrapping_add(shard.wrapping_mul(GOLDEN));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A tag's place in a migration, 0 to 99: a client is on the new store when this is
/// below the percentage, so raising the percentage only moves clients forward. Half of
/// MurmurHash3's finalizer over the folded tag and a constant of its own, so it is
/// independent of the other placements.
pub(crate) fn percentile(tag: u128) -> u64 {
    let mut z = fold(tag) ^ 0x6d69_6772_6174_6521;
    z = (z ^ (z >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    z ^= z >> 33;
    z % 100
}
