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
        // A transaction's read: what GET reads, with the key's version.
        Request::ReadVersioned(key) => ("get", vec![(key, KeyAccess::Read)]),
        // EXEC of a transaction: it reads (checks) its read keys and writes its write keys;
        // `check` also asks for the commands its writes amount to.
        Request::Commit { reads, writes } => (
            "exec",
            reads
                .iter()
                .map(|(k, _)| (&k[..], KeyAccess::Read))
                .chain(writes.iter().map(|(k, _, _)| (&k[..], KeyAccess::Write)))
                .collect(),
        ),
        Request::Part { .. } | Request::FetchPart { .. } => unreachable!("`check` passes transfers through"),
    }
}

/// The commands a commit's writes amount to, queued in a MULTI: SET for a value, DEL for a
/// delete (a user may EXEC only what it could have queued).
fn commit_writes(request: &Request) -> Vec<&'static str> {
    let Request::Commit { writes, .. } = request else { return Vec::new() };
    let mut commands = Vec::new();
    if writes.iter().any(|(_, value, _)| value.is_some()) {
        commands.push("set");
    }
    if writes.iter().any(|(_, value, _)| value.is_none()) {
        commands.push("del");
    }
    commands
}

/// Whether `user` may make `request`; the error is Redis' NOPERM text. Parts of a request
/// (and fetches of a staged reply) pass: the front ends check the assembled request, and a
/// transfer reaches only its own owner's.
pub fn check(acl: &Acl, user: &str, request: &Request) -> Result<(), String> {
    if matches!(request, Request::Part { .. } | Request::FetchPart { .. }) {
        return Ok(());
    }
    let (command, keys) = as_command(request);
    acl.check(user, command, keys)?;
    for command in commit_writes(request) {
        acl.check(user, command, [])?;
    }
    Ok(())
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

    #[test]
    fn transactions_are_checked_as_exec_of_their_reads_and_writes() {
        use racekv_client::txn::Version;
        let acl = Acl::open(racekv_redis::commands::catalog());
        acl.set_user(b"ro", &[b"on", b"nopass", b"+@read", b"~*"]).unwrap();
        acl.set_user(b"cache", &[b"on", b"nopass", b"+@all", b"~cache:*"]).unwrap();
        acl.set_user(b"w", &[b"on", b"nopass", b"+@all", b"%W~*"]).unwrap();
        acl.set_user(b"nowrite", &[b"on", b"nopass", b"+@all", b"-@write", b"~*"]).unwrap();
        let v = Version::ABSENT;
        let commit = |reads: &[&str], writes: &[(&str, Option<&str>)]| Request::Commit {
            reads: reads.iter().map(|k| (k.as_bytes().to_vec(), v)).collect(),
            writes: writes
                .iter()
                .map(|(k, val)| (k.as_bytes().to_vec(), val.map(|x| x.as_bytes().to_vec()), None))
                .collect(),
        };
        let read = |k: &str| Request::ReadVersioned(k.as_bytes().to_vec());
        // A transaction's read is a GET.
        assert!(check(&acl, "ro", &read("k")).is_ok());
        assert!(check(&acl, "cache", &read("cache:1")).is_ok());
        assert!(check(&acl, "cache", &read("other")).is_err());
        assert!(check(&acl, "w", &read("k")).is_err(), "a write-only pattern does not read");
        // The commit is an EXEC: a read-only user may not run one (as MULTI/EXEC on the
        // Redis port), even with nothing to write.
        assert!(check(&acl, "ro", &commit(&["k"], &[])).unwrap_err().contains("'exec'"));
        assert!(check(&acl, "default", &commit(&["a"], &[("b", Some("1")), ("c", None)])).is_ok());
        // Every key read and written is checked, each for its access.
        assert!(check(&acl, "cache", &commit(&["cache:a"], &[("cache:b", Some("1"))])).is_ok());
        assert!(check(&acl, "cache", &commit(&["other"], &[("cache:b", Some("1"))])).is_err());
        assert!(check(&acl, "cache", &commit(&["cache:a"], &[("other", None)])).is_err());
        assert!(check(&acl, "w", &commit(&[], &[("k", Some("1"))])).is_ok());
        assert!(check(&acl, "w", &commit(&["k"], &[("k", Some("1"))])).is_err(), "a read through %W~");
        // Writes need the commands they amount to (SET, DEL), as queued in a MULTI.
        assert!(check(&acl, "nowrite", &commit(&["k"], &[])).is_ok());
        assert!(check(&acl, "nowrite", &commit(&["k"], &[("k", Some("1"))])).unwrap_err().contains("'set'"));
        assert!(check(&acl, "nowrite", &commit(&[], &[("k", None)])).unwrap_err().contains("'del'"));
    }
}
