//! The expiry operations of the client library, exercised the same way in every mode (the
//! client's embedded tests and the computenode's attached and remote ones include this
//! file by path).

use std::time::Duration;

use racekv_client::{now_unix_ms, Client, ExpireCondition, Expiry, ExpiryChange, Item, PutOptions, PutOutcome, Ttl};

/// The expiry operations, as an application sees them in every mode.
pub fn exercise_expiry(client: &Client) {
    let later = now_unix_ms() + 3_600_000;
    let expiring = |expiry| PutOptions { expiry, ..PutOptions::default() };
    assert_eq!(client.put_opts(b"x1", b"v", expiring(Expiry::At(later))).unwrap().outcome, PutOutcome::Inserted);
    assert_eq!(client.ttl(b"x1").unwrap(), Ttl::ExpiresAt(later));
    assert_eq!(client.get_item(b"x1").unwrap(), Some(Item { value: b"v".to_vec(), expires_at_ms: Some(later) }));
    let keep_and_return = PutOptions { expiry: Expiry::Keep, return_old: true, ..PutOptions::default() };
    assert_eq!(client.put_opts(b"x1", b"w", keep_and_return).unwrap().old.as_deref(), Some(&b"v"[..]));
    assert_eq!(client.ttl(b"x1").unwrap(), Ttl::ExpiresAt(later));
    assert!(client.persist(b"x1").unwrap());
    assert!(!client.persist(b"x1").unwrap());
    assert_eq!(client.ttl(b"x1").unwrap(), Ttl::Persistent);
    assert_eq!(client.ttl(b"nope").unwrap(), Ttl::Missing);
    let at = |at_ms, condition| ExpiryChange::At { at_ms, condition };
    assert!(client.expire(b"x1", at(later, ExpireCondition::NX)).unwrap());
    assert!(!client.expire(b"x1", at(later + 1, ExpireCondition::NX)).unwrap());
    assert!(client.expire(b"x1", at(later + 1, ExpireCondition::GT)).unwrap());
    assert_eq!(client.ttl(b"x1").unwrap(), Ttl::ExpiresAt(later + 1));
    assert!(client.expire_in(b"x1", Duration::from_secs(60)).unwrap());
    assert!(!client.expire(b"nope", at(later, ExpireCondition::ALWAYS)).unwrap());
    assert!(client.expire(b"x1", at(1, ExpireCondition::ALWAYS)).unwrap(), "a past time removes the key");
    assert_eq!(client.get(b"x1").unwrap(), None);
    client.put_ex(b"x2", b"v", Duration::from_secs(60)).unwrap();
    assert!(matches!(client.ttl(b"x2").unwrap(), Ttl::ExpiresAt(t) if t > now_unix_ms()));
    client.put_opts(b"x3", b"v", expiring(Expiry::At(1))).unwrap();
    assert_eq!(client.get(b"x3").unwrap(), None, "an expired key is absent");
    assert_eq!(client.multi_get(&[b"x2", b"x3"]).unwrap(), vec![Some(b"v".to_vec()), None]);
    client.put_opts(b"x3", b"v", expiring(Expiry::At(1))).unwrap();
    assert!(client.insert(b"x3", b"fresh").unwrap(), "an expired key counts as absent");
    client.put_opts(b"x4", b"1", expiring(Expiry::At(later))).unwrap();
    assert!(client.compare_and_swap(b"x4", Some(b"1"), Some(b"2")).unwrap());
    assert_eq!(client.ttl(b"x4").unwrap(), Ttl::ExpiresAt(later), "compare-and-swap keeps the expiry");
    for key in [&b"x2"[..], b"x3", b"x4"] {
        assert!(client.delete(key).unwrap());
    }
}
