//! What the computenode's own front ends (remote, attach) let each ACL user do: a request is
//! allowed when its user could run the Redis command it amounts to on its keys, so one ACL
//! governs the Redis port, remote clients and attached processes alike.

use racekv_client::op::Request;
use racekv_client::ExpiryChange;
use racekv_hashing::PutMode;
use racekv_redis::acl::{Acl, KeyAccess};

/// The Redis command `request` amounts to, and the keys it touches.
fn as_command(request: &Request) -> (&'static str, Vec<(&[u8], KeyAccess)>) {
    match request {
        Request::Get(key) => ("get", vec![(key, KeyAccess::Read)]),
        Request::Put { key, mode: PutMode::InsertOnly, .. } => ("setnx", vec![(key, KeyAccess::Write)]),
        Request::Put { key, .. } => ("set", vec![(key, KeyAccess::Write)]),
        Request::Delete(key) => ("del", vec![(key, KeyAccess::Write)]),
        // Reads the value it compares with.
        Request::CompareAndSwap { key, .. } => ("set", vec![(key, KeyAccess::ReadWrite)]),
        Request::MultiGet(keys) => ("mget", keys.iter().map(|k| (&k[..], KeyAccess::Read)).collect()),
        Request::MultiPut(pairs) => ("mset", pairs.iter().map(|(k, _)| (&k[..], KeyAccess::Write)).collect()),
        Request::Len => ("dbsize", vec![]),
        Request::Stats => ("info", vec![]),
        // As on the Redis port, SCAN's keys are not checked against key patterns.
        Request::Scan { .. } => ("scan", vec![]),
        Request::RandomKey => ("randomkey", vec![]),
        Request::DeleteAll => ("flushall", vec![]),
        // SET with its options; with the old value back it reads the key too (SET ... GET).
        Request::PutOpts { key, options, .. } if options.return_old => ("set", vec![(key, KeyAccess::ReadWrite)]),
        Request::PutOpts { key, .. } => ("set", vec![(key, KeyAccess::Write)]),
        // The value and its expiry: what GET reads.
        Request::GetItem(key) => ("get", vec![(key, KeyAccess::Read)]),
        Request::Expire { key, change: ExpiryChange::At { .. } } => ("pexpireat", vec![(key, KeyAccess::Write)]),
        Request::Expire { key, change: ExpiryChange::Persist } => ("persist", vec![(key, KeyAccess::Write)]),
        Request::Part { .. } | Request::FetchPart { .. } => unreachable!("`check` passes transfers through"),
    }
}

/// Whether `user` may make `request`; the error is Redis' NOPERM text. Parts of a request
/// (and fetches of a staged reply) pass: the front ends check the assembled request, and a
/// transfer reaches only its own owner's.
pub fn check(acl: &Acl, user: &str, request: &Request) -> Result<(), String> {
    if matches!(request, Request::Part { .. } | Request::FetchPart { .. }) {
        return Ok(());
    }
    let (command, keys) = as_command(request);
    acl.check(user, command, keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_checked_as_their_redis_commands() {
        let acl = Acl::open(racekv_redis::commands::catalog());
        acl.set_user(b"ro", &[b"on", b"nopass", b"+@read", b"~*"]).unwrap();
        acl.set_user(b"cache", &[b"on", b"nopass", b"+@all", b"~cache:*"]).unwrap();
        let put = |k: &str| Request::Put { key: k.into(), value: b"v".to_vec(), mode: PutMode::Upsert };
        assert!(check(&acl, "ro", &Request::Get(b"k".to_vec())).is_ok());
        assert!(check(&acl, "ro", &Request::MultiGet(vec![b"a".to_vec(), b"b".to_vec()])).is_ok());
        assert!(check(&acl, "ro", &Request::Len).is_ok());
        assert!(check(&acl, "ro", &put("k")).unwrap_err().contains("'set'"));
        assert!(check(&acl, "ro", &Request::Delete(b"k".to_vec())).is_err());
        let cas = Request::CompareAndSwap { key: b"k".to_vec(), expected: None, new: Some(b"v".to_vec()) };
        assert!(check(&acl, "ro", &cas).is_err());
        assert!(check(&acl, "cache", &put("cache:1")).is_ok());
        assert_eq!(check(&acl, "cache", &put("other")), Err("NOPERM No permissions to access a key".into()));
        let pairs = vec![(b"cache:1".to_vec(), vec![]), (b"x".to_vec(), vec![])];
        assert!(check(&acl, "cache", &Request::MultiPut(pairs)).is_err(), "one key outside the patterns");
        assert!(check(&acl, "default", &cas).is_ok());
        // The keyspace: a reader walks it and picks keys but may not empty it.
        assert!(check(&acl, "ro", &Request::Scan { cursor: 0, count: 10, max_bytes: 100 }).is_ok());
        assert!(check(&acl, "ro", &Request::RandomKey).is_ok());
        assert!(check(&acl, "ro", &Request::DeleteAll).unwrap_err().contains("'flushall'"));
        assert!(check(&acl, "cache", &Request::DeleteAll).is_ok());
        // Expiry requests, as SET, GET, PEXPIREAT and PERSIST.
        let expire = Request::Expire { key: b"k".to_vec(), change: ExpiryChange::Persist };
        assert!(check(&acl, "ro", &Request::GetItem(b"k".to_vec())).is_ok());
        assert!(check(&acl, "ro", &expire).unwrap_err().contains("'persist'"));
        acl.set_user(b"w", &[b"on", b"nopass", b"+@all", b"%W~*"]).unwrap();
        let put = |return_old| Request::PutOpts {
            key: b"k".to_vec(),
            value: b"v".to_vec(),
            options: racekv_hashing::PutOptions { return_old, ..Default::default() },
        };
        assert!(check(&acl, "w", &put(false)).is_ok());
        assert!(check(&acl, "w", &put(true)).is_err(), "returning the old value reads the key");
        assert!(check(&acl, "w", &expire).is_ok());
        assert!(check(&acl, "w", &Request::GetItem(b"k".to_vec())).is_err());
    }
}
