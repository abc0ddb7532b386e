//! ACL command categories (`@read`, `@write`, ...), as Redis 7 names them: a bit set per
//! command, so a user's `+@cat` / `-@cat` rule picks commands without a lookup table.

/// A set of categories, one bit each (see [`NAMES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Categories(u32);

/// Every category, in Redis' `ACL CAT` order; bit `i` of [`Categories`] is `NAMES[i]`.
pub const NAMES: [&str; 21] = [
    "keyspace",
    "read",
    "write",
    "set",
    "sortedset",
    "list",
    "hash",
    "string",
    "bitmap",
    "hyperloglog",
    "geo",
    "stream",
    "pubsub",
    "admin",
    "fast",
    "slow",
    "blocking",
    "dangerous",
    "connection",
    "transaction",
    "scripting",
];

const fn bit(name: &str) -> u32 {
    let mut i = 0;
    while i < NAMES.len() {
        if const_eq(NAMES[i], name) {
            return 1 << i;
        }
        i += 1;
    }
    panic!("not a category name")
}

const fn const_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

impl Categories {
    /// `@keyspace`: works on keys as such (DEL, EXPIRE, SCAN, ...).
    pub const KEYSPACE: Self = Self(bit("keyspace"));
    /// `@read`: reads keys' values.
    pub const READ: Self = Self(bit("read"));
    /// `@write`: writes keys.
    pub const WRITE: Self = Self(bit("write"));
    /// `@string`: string commands.
    pub const STRING: Self = Self(bit("string"));
    /// `@admin`: administration (CONFIG, ACL changes, ...).
    pub const ADMIN: Self = Self(bit("admin"));
    /// `@fast`: constant-time commands.
    pub const FAST: Self = Self(bit("fast"));
    /// `@slow`: every command that is not `@fast`.
    pub const SLOW: Self = Self(bit("slow"));
    /// `@dangerous`: commands that can harm the server or other clients.
    pub const DANGEROUS: Self = Self(bit("dangerous"));
    /// `@connection`: about the connection itself (AUTH, PING, CLIENT, ...).
    pub const CONNECTION: Self = Self(bit("connection"));
    /// `@transaction`: MULTI, EXEC, DISCARD, WATCH.
    pub const TRANSACTION: Self = Self(bit("transaction"));
    /// No category.
    pub const NONE: Self = Self(0);

    /// The union of `self` and `other`.
    pub const fn and(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// Whether `self` includes every category of `other` (and `other` is not empty).
    pub const fn contains(self, other: Self) -> bool {
        other.0 != 0 && self.0 & other.0 == other.0
    }

    /// The category named `name` (case-insensitive, without the `@`), if it exists.
    pub fn by_name(name: &[u8]) -> Option<Self> {
        NAMES.iter().position(|n| n.as_bytes().eq_ignore_ascii_case(name)).map(|i| Self(1 << i))
    }

    /// The names of the categories in the set, in [`NAMES`] order.
    pub fn names(self) -> impl Iterator<Item = &'static str> {
        NAMES.iter().enumerate().filter(move |(i, _)| self.0 & (1 << i) != 0).map(|(_, n)| *n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sets_combine() {
        for name in NAMES {
            let c = Categories::by_name(name.as_bytes()).unwrap();
            assert_eq!(c.names().collect::<Vec<_>>(), [name]);
        }
        assert_eq!(Categories::by_name(b"READ"), Some(Categories::READ));
        assert_eq!(Categories::by_name(b"nope"), None);
        let rw = Categories::READ.and(Categories::STRING).and(Categories::FAST);
        assert!(rw.contains(Categories::STRING));
        assert!(!rw.contains(Categories::WRITE));
        assert!(!rw.contains(Categories::NONE));
        assert_eq!(rw.names().collect::<Vec<_>>(), ["read", "string", "fast"]);
    }
}
