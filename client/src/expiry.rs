//! Keys that expire: the library's vocabulary for expiry changes and what a key's expiry
//! is, the same in every mode (they travel in `op.rs` requests).
//!
//! Times are absolute Unix milliseconds (`racekv_hashing::clock`): a key written by one
//! process expires at the same moment for every other, up to the clock skew between hosts.

use racekv_hashing::ExpiryUpdate;

/// When an expiry change applies: Redis' `EXPIRE` options. NX: the key has no expiry; XX:
/// it has one; GT: the new time is later than the current one (no expiry counts as
/// infinitely late, so GT never applies to a key without one); LT: earlier (always, for a
/// key without one). XX combines with GT or LT; NX with nothing; GT not with LT.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExpireCondition {
    /// Only if the key has no expiry.
    pub nx: bool,
    /// Only if the key has an expiry.
    pub xx: bool,
    /// Only if the new time is later than the current one.
    pub gt: bool,
    /// Only if the new time is earlier than the current one (or there is none).
    pub lt: bool,
}

impl ExpireCondition {
    /// No condition.
    pub const ALWAYS: Self = Self { nx: false, xx: false, gt: false, lt: false };
    /// Only a key without an expiry.
    pub const NX: Self = Self { nx: true, ..Self::ALWAYS };
    /// Only a key with an expiry.
    pub const XX: Self = Self { xx: true, ..Self::ALWAYS };
    /// Only to a later time.
    pub const GT: Self = Self { gt: true, ..Self::ALWAYS };
    /// Only to an earlier time.
    pub const LT: Self = Self { lt: true, ..Self::ALWAYS };

    /// Whether Redis accepts this combination.
    pub fn is_valid(&self) -> bool {
        !(self.nx && (self.xx || self.gt || self.lt)) && !(self.gt && self.lt)
    }

    /// Whether a key whose expiry is `current` (None: none) may get `new_at_ms`.
    pub fn allows(&self, current: Option<u64>, new_at_ms: u64) -> bool {
        (!self.nx || current.is_none())
            && (!self.xx || current.is_some())
            && (!self.gt || current.is_some_and(|c| new_at_ms > c))
            && (!self.lt || current.is_none_or(|c| new_at_ms < c))
    }

    /// The bits this condition travels as (bit 0 NX, 1 XX, 2 GT, 3 LT).
    pub fn bits(&self) -> u8 {
        u8::from(self.nx) | u8::from(self.xx) << 1 | u8::from(self.gt) << 2 | u8::from(self.lt) << 3
    }

    /// The condition `bits` stands for (None: unknown bits or an invalid combination).
    pub fn from_bits(bits: u8) -> Option<Self> {
        let c = Self { nx: bits & 1 != 0, xx: bits & 2 != 0, gt: bits & 4 != 0, lt: bits & 8 != 0 };
        (bits < 16 && c.is_valid()).then_some(c)
    }
}

/// A change of a key's expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpiryChange {
    /// Expire at `at_ms` when `condition` holds; a time not after now removes the key at
    /// once (as Redis' EXPIRE with a time in the past).
    At {
        /// The new expiry, in Unix milliseconds.
        at_ms: u64,
        /// When the change applies.
        condition: ExpireCondition,
    },
    /// Remove the key's expiry (Redis' PERSIST); applies only to a key that has one.
    Persist,
}

impl ExpiryChange {
    /// What the change does to a key whose expiry is `current`, judged at `now_ms`.
    pub fn decide(&self, current: Option<u64>, now_ms: u64) -> ExpiryUpdate {
        match *self {
            ExpiryChange::At { at_ms, condition } if condition.allows(current, at_ms) => {
                if at_ms <= now_ms {
                    ExpiryUpdate::Delete
                } else {
                    ExpiryUpdate::Set(Some(at_ms))
                }
            }
            ExpiryChange::At { .. } => ExpiryUpdate::Unchanged,
            ExpiryChange::Persist if current.is_some() => ExpiryUpdate::Set(None),
            ExpiryChange::Persist => ExpiryUpdate::Unchanged,
        }
    }
}

/// What a key's expiry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ttl {
    /// The key does not exist (or has expired): Redis' TTL -2.
    Missing,
    /// The key exists and never expires: Redis' TTL -1.
    Persistent,
    /// The key expires after this absolute Unix time in milliseconds.
    ExpiresAt(u64),
}

impl Ttl {
    /// The key's expiry as [`Ttl`], from what a read returned.
    pub fn of(item: Option<&racekv_hashing::Item>) -> Self {
        match item {
            None => Ttl::Missing,
            Some(item) => item.expires_at_ms.map_or(Ttl::Persistent, Ttl::ExpiresAt),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_follow_redis() {
        let c = |bits| ExpireCondition::from_bits(bits);
        // NX alone, GT xor LT, XX with either.
        assert!(c(1).is_some() && c(3).is_none() && c(5).is_none() && c(9).is_none());
        assert!(c(4).is_some() && c(8).is_some() && c(12).is_none());
        assert!(c(6).is_some() && c(10).is_some() && c(2).is_some() && c(0).is_some());
        assert!(c(16).is_none() && c(0xFF).is_none());
        for bits in 0..16 {
            if let Some(cond) = c(bits) {
                assert_eq!(cond.bits(), bits);
            }
        }
        let (none, at_10) = (None, Some(10));
        assert!(ExpireCondition::NX.allows(none, 5) && !ExpireCondition::NX.allows(at_10, 5));
        assert!(!ExpireCondition::XX.allows(none, 5) && ExpireCondition::XX.allows(at_10, 5));
        assert!(!ExpireCondition::GT.allows(none, 5), "no expiry is infinitely late");
        assert!(ExpireCondition::GT.allows(at_10, 11) && !ExpireCondition::GT.allows(at_10, 10));
        assert!(ExpireCondition::LT.allows(none, 5) && ExpireCondition::LT.allows(at_10, 9));
        assert!(!ExpireCondition::LT.allows(at_10, 10));
        let xx_lt = ExpireCondition { xx: true, lt: true, ..ExpireCondition::ALWAYS };
        assert!(!xx_lt.allows(none, 5) && xx_lt.allows(at_10, 9));
    }

    #[test]
    fn changes_decide_as_redis_does() {
        let at = |at_ms| ExpiryChange::At { at_ms, condition: ExpireCondition::ALWAYS };
        assert_eq!(at(100).decide(None, 50), ExpiryUpdate::Set(Some(100)));
        assert_eq!(at(50).decide(None, 50), ExpiryUpdate::Delete, "a time not after now removes the key");
        let gt = ExpiryChange::At { at_ms: 100, condition: ExpireCondition::GT };
        assert_eq!(gt.decide(Some(200), 50), ExpiryUpdate::Unchanged);
        assert_eq!(ExpiryChange::Persist.decide(Some(200), 50), ExpiryUpdate::Set(None));
        assert_eq!(ExpiryChange::Persist.decide(None, 50), ExpiryUpdate::Unchanged);
    }
}
