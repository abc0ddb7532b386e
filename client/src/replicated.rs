//! Single-key writes of a key whose partition has several replicas (a cluster map with
//! R > 1; issue 17). Each is a one-key transaction ([`Session::commit`]): the key's item
//! and version are read on its primary, the operation decides what to write from them, and
//! the commit locks the key on the primary (at the version read), then on every backup,
//! decides, and settles the backups before the primary. So a write is acknowledged only
//! once it is on every replica, concurrent writers of one key are ordered by the primary's
//! lock (the loser's commit fails and it starts over), and readers, which use the primary,
//! never see a value that some replica lacks. A write that changes nothing (SET NX of a
//! present key) is its read.
//!
//! Cost: a read and a commit (records, a lock per replica, the decision, a settle per
//! replica) instead of one upsert: see ARCHITECTURE.md, "Replication".

use std::borrow::Cow;
use std::time::Instant;

use racekv_hashing::{Expiry, ExpiryUpdate, Item, PutMode, PutOptions, PutOutcome, PutResult};

use crate::error::ClientError;
use crate::optimistic::Write;
use crate::session::{Session, Shards};

/// What a replicated write does to its key.
pub(crate) enum Change<'v> {
    /// Sets the value, expiring at the time given (None: never).
    Put(Cow<'v, [u8]>, Option<u64>),
    /// Removes the key.
    Delete,
}

impl<S: Shards> Session<S> {
    /// Whether writes of `key` are one-key transactions ([`Shards::locks_writes`]), by the
    /// newest map this side has.
    pub(crate) fn replicated(&mut self, key: &[u8]) -> bool {
        self.shards_mut().refresh_routing();
        self.shards().locks_writes(key)
    }

    /// Runs one write of `key` on all its replicas: `decide` gets the key's live item (None:
    /// absent or expired) and says what to write (None: nothing) and what to return. On a
    /// conflict it runs again with what the key holds then, until the session's timeout.
    pub(crate) fn write_replicated<'v, R>(
        &mut self,
        key: &[u8],
        mut decide: impl FnMut(Option<Item>) -> (Option<Change<'v>>, R),
    ) -> Result<R, ClientError> {
        let deadline = Instant::now() + self.shards().timeout();
        loop {
            if self.shards().snapshot_writes() {
                if let Some(result) = self.write_snapshot(key, &mut decide)? {
                    return Ok(result);
                }
                if Instant::now() >= deadline {
                    return Err(self.kept_meeting_writes());
                }
                continue;
            }
            let (item, version) = self.read_versioned(key)?;
            let live = item.filter(|_| !version.expired(racekv_hashing::clock::now_unix_ms()));
            let (change, result) = decide(live);
            let Some(change) = change else { return Ok(result) };
            let write = match &change {
                Change::Put(value, expires_at_ms) => Write { key, value: Some(value), expires_at_ms: *expires_at_ms },
                Change::Delete => Write { key, value: None, expires_at_ms: None },
            };
            if self.commit(&[(key, version)], &[write])? {
                return Ok(result);
            }
            if Instant::now() >= deadline {
                return Err(self.kept_meeting_writes());
            }
        }
    }

    fn kept_meeting_writes(&self) -> ClientError {
        ClientError::Conflict(format!(
            "a replicated write of a key kept meeting other writes of it for {:?}",
            self.shards().timeout()
        ))
    }

    /// [`Session::put_opts`] on every replica.
    pub(crate) fn put_replicated(
        &mut self,
        key: &[u8],
        value: &[u8],
        options: PutOptions,
    ) -> Result<PutResult, ClientError> {
        self.write_replicated(key, |item| {
            let applies = match options.mode {
                PutMode::Upsert => true,
                PutMode::InsertOnly => item.is_none(),
                PutMode::UpdateOnly => item.is_some(),
            };
            let outcome = match (applies, &item) {
                (false, _) => PutOutcome::NotApplied,
                (true, None) => PutOutcome::Inserted,
                (true, Some(_)) => PutOutcome::Updated,
            };
            let expires_at_ms = match options.expiry {
                Expiry::Never => None,
                Expiry::At(at) => Some(at),
                Expiry::Keep => item.as_ref().and_then(|i| i.expires_at_ms),
            };
            let old = item.filter(|_| options.return_old).map(|i| i.value);
            (applies.then_some(Change::Put(Cow::Borrowed(value), expires_at_ms)), PutResult { outcome, old })
        })
    }

    /// [`Session::delete`] on every replica.
    pub(crate) fn delete_replicated(&mut self, key: &[u8]) -> Result<bool, ClientError> {
        self.write_replicated(key, |item| (item.is_some().then_some(Change::Delete), item.is_some()))
    }

    /// [`Session::compare_and_swap`] on every replica.
    pub(crate) fn compare_and_swap_replicated(
        &mut self,
        key: &[u8],
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
    ) -> Result<bool, ClientError> {
        self.write_replicated(key, |item| {
            if item.as_ref().map(|i| &i.value[..]) != expected {
                return (None, false);
            }
            // As the table's: the expiry is kept, and absent to absent writes nothing.
            let change = match (new, &item) {
                (Some(value), _) => {
                    Some(Change::Put(Cow::Borrowed(value), item.as_ref().and_then(|i| i.expires_at_ms)))
                }
                (None, Some(_)) => Some(Change::Delete),
                (None, None) => None,
            };
            (change, true)
        })
    }

    /// [`Session::update_expiry`] on every replica.
    pub(crate) fn update_expiry_replicated(
        &mut self,
        key: &[u8],
        decide: &mut dyn FnMut(Option<u64>) -> ExpiryUpdate,
    ) -> Result<Option<(Item, bool)>, ClientError> {
        self.write_replicated(key, |item| {
            let Some(item) = item else { return (None, None) };
            let change = match decide(item.expires_at_ms) {
                ExpiryUpdate::Unchanged => return (None, Some((item, false))),
                ExpiryUpdate::Set(at) if at == item.expires_at_ms => return (None, Some((item, true))),
                ExpiryUpdate::Set(at) => Change::Put(Cow::Owned(item.value.clone()), at),
                ExpiryUpdate::Delete => Change::Delete,
            };
            (Some(change), Some((item, true)))
        })
    }
}
