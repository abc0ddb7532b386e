//! Settling a replicated single-key write's intents once it outlived its lease (its writer
//! died or stalled): the rules R3 and R4 of `docs/design/replication-fast-path.md`.
//!
//! Such a write (a *snapshot* write: its intents carry a `MarkOwner::Snapshot` id, the
//! same on every replica, and no record) locks the key's primary and each backup; its lock
//! on the primary is its order among the key's writes, and publishing it there is the
//! write's linearization point. So the primary decides:
//!
//! * **An intent on the primary** is rolled forward, never back: its item is placed on
//!   every backup of the current map (a backup holding this write's intent is published, one
//!   holding another write's dead intent has that settled first), then the primary's is
//!   published. A write whose primary lock stands may have been acknowledged to no one, but
//!   equally may be about to be: rolling forward is what keeps the replicas equal either way.
//! * **An intent on a backup** stands (is published) when the primary's copy is this write's,
//!   locked or published, or is a lock over this write's copy (the lock keeps the copy it
//!   replaced, and its mark). Otherwise the write never took the primary (or its lock there
//!   was rolled back by no one: primary locks are only rolled forward), so it never was
//!   acknowledged: the backup goes back to the word it held.
//!
//! A delete leaves no block to compare, so its writer publishes it on the backups before
//! the primary: then a primary without the key never had that delete's lock overtaken while
//! a backup still holds its intent. (Other writes publish everywhere in one round; their
//! published blocks keep their marks.)
//!
//! Why one level of "a lock over this write's copy" is enough: a later write that replaced
//! this write's copy on the primary must lock every backup before it publishes, which
//! settles this write's intents there first.

use std::time::{Duration, Instant};

use racekv_hashing::layout::TxnMark;
use racekv_hashing::table::txn::TXN_LEASE_SLACK_MS;
use racekv_hashing::table::HeldCopy;
use racekv_hashing::Item;

use crate::error::ClientError;
use crate::session::{Session, Shards};

/// How long a resolver waits before looking again at another write's intent within its
/// lease, on a backup it must place a write on.
const RECHECK_INTERVAL: Duration = Duration::from_millis(5);

impl<S: Shards> Session<S> {
    /// Settles the intent `word` (marked `mark`, of write `write_id`) met on `key` at memnode
    /// `shard`, whose lease has passed (see the module's comment).
    pub(crate) fn resolve_snapshot_lock(
        &mut self,
        shard: usize,
        key: &[u8],
        word: u64,
        mark: &TxnMark,
        write_id: u64,
    ) -> Result<(), ClientError> {
        assert_eq!(mark.write_id(), Some(write_id), "a snapshot write's mark");
        let primary = self.route(key);
        if shard == primary {
            return self.roll_forward(primary, key, word, mark, write_id);
        }
        let held = self.on(primary, |c| c.held_copy(key))?;
        let stands = held.as_ref().is_some_and(|copy| holds_write(copy, write_id));
        racekv_hashing::table::txn::count_resolution(stands);
        self.on(shard, |c| c.txn_settle(key, word, mark, stands, 0))?;
        Ok(())
    }

    /// Places the write whose intent `word` holds `key` on its primary on every backup,
    /// then publishes it on the primary.
    fn roll_forward(
        &mut self,
        primary: usize,
        key: &[u8],
        word: u64,
        mark: &TxnMark,
        write_id: u64,
    ) -> Result<(), ClientError> {
        let Some(held) = self.on(primary, |c| c.held_copy(key))?.filter(|copy| copy.word == word) else {
            return Ok(()); // settled meanwhile: the operation reads the key again
        };
        let item = (!mark.tombstone).then_some(held.item);
        for backup in self.backups_of(key) {
            self.place_on_backup(backup, key, mark, write_id, item.as_ref())?;
        }
        racekv_hashing::table::txn::count_resolution(true);
        self.on(primary, |c| c.txn_settle(key, word, mark, true, 0))?;
        Ok(())
    }

    /// Makes backup `shard` hold write `write_id` (`item`, None: a delete) published.
    fn place_on_backup(
        &mut self,
        shard: usize,
        key: &[u8],
        mark: &TxnMark,
        write_id: u64,
        item: Option<&Item>,
    ) -> Result<(), ClientError> {
        let deadline = Instant::now() + self.shards().timeout();
        loop {
            let held = self.on(shard, |c| c.held_copy(key))?;
            let old_word = match &held {
                Some(copy) if copy.locked() => {
                    let other = copy.mark.expect("an intent has a mark");
                    if other.write_id() == Some(write_id) {
                        self.on(shard, |c| c.txn_settle(key, copy.word, &other, true, 0))?;
                        return Ok(());
                    }
                    // Another write's intent: settled by its own rules once its lease is
                    // over (a transaction's by its record; a snapshot write's by this
                    // primary, which holds our write, so it goes back unless it stood).
                    if racekv_hashing::clock::now_unix_ms() > other.deadline_ms.saturating_add(TXN_LEASE_SLACK_MS) {
                        self.resolve_lock(shard, key, copy.word, &other)?;
                    } else if Instant::now() >= deadline {
                        return Err(ClientError::Conflict(format!(
                            "another write held a backup's copy of a key for {:?} while a dead write was placed on it",
                            self.shards().timeout()
                        )));
                    } else {
                        std::thread::sleep(RECHECK_INTERVAL);
                    }
                    continue;
                }
                Some(copy) => copy.word,
                None if item.is_none() => return Ok(()), // a delete, and the key is absent here
                None => 0,
            };
            let placed =
                TxnMark { tombstone: item.is_none(), ..TxnMark::of_snapshot(write_id, old_word, mark.deadline_ms) };
            let (value, expires_at_ms) = match item {
                Some(item) => (Some(&item.value[..]), item.expires_at_ms),
                None => (None, None),
            };
            if let Some(lock) = self.on(shard, |c| c.txn_lock(key, value, expires_at_ms, placed))? {
                self.on(shard, |c| c.txn_settle(key, lock.word, &placed, true, lock.replaced))?;
                return Ok(());
            }
            // The copy changed since it was read: look again.
        }
    }
}

/// Whether the primary's copy `copy` says write `write_id` took the key: the copy is that
/// write's (locked or published), or a lock over that write's copy.
fn holds_write(copy: &HeldCopy, write_id: u64) -> bool {
    let of = |mark: Option<TxnMark>| mark.and_then(|m| m.write_id()) == Some(write_id);
    of(copy.mark) || (copy.locked() && of(copy.replaced_mark))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use racekv_hashing::layout::TxnMark;
    use racekv_hashing::table::txn::TXN_LEASE_SLACK_MS;
    use racekv_hashing::table::HeldCopy;
    use racekv_hashing::testing::{TestMemnode, Via};
    use racekv_hashing::{Table, TableClient, TableOptions};

    use crate::error::ClientError;
    use crate::session::{pick_mut, Session, Shards};

    const KEY: &[u8] = b"key";

    /// Three memnodes holding every key: 0 the primary, 1 and 2 its backups.
    struct Replicas {
        clients: Vec<TableClient>,
    }

    impl Shards for Replicas {
        fn route(&self, _key: &[u8]) -> usize {
            0
        }
        fn backups(&self, _key: &[u8]) -> &[u16] {
            &[1, 2]
        }
        fn count(&self) -> usize {
            3
        }
        fn label(&self, _shard: usize) -> &str {
            "test"
        }
        fn node_id(&self, shard: usize) -> u64 {
            shard as u64 + 1
        }
        fn timeout(&self) -> Duration {
            Duration::from_secs(5)
        }
        fn client(&mut self, shard: usize) -> Result<&mut TableClient, ClientError> {
            Ok(&mut self.clients[shard])
        }
        fn clients(&mut self, shards: &[usize]) -> Result<Vec<&mut TableClient>, ClientError> {
            Ok(pick_mut(&mut self.clients, shards))
        }
        fn snapshot_writes(&self) -> bool {
            true
        }
    }

    struct Cluster {
        memnodes: Vec<TestMemnode>,
        tables: Vec<Table>,
    }

    impl Cluster {
        /// Three memnodes, each holding `KEY` = "old".
        fn start() -> Self {
            Self::start_via(Via::Local)
        }

        fn start_via(via: Via) -> Self {
            let memnodes: Vec<TestMemnode> = (0..3).map(|_| TestMemnode::start(via, 16 << 20, 16)).collect();
            let options = TableOptions { grace_period: Duration::ZERO, ..TableOptions::default() };
            let tables: Vec<Table> = memnodes.iter().map(|m| m.table(options)).collect();
            let cluster = Self { memnodes, tables };
            for i in 0..3 {
                cluster.client(i).put(KEY, b"old").unwrap();
            }
            cluster
        }

        fn client(&self, i: usize) -> TableClient {
            self.tables[i].client(self.memnodes[i].connect())
        }

        fn session(&self) -> Session<Replicas> {
            Session::new(Replicas { clients: (0..3).map(|i| self.client(i)).collect() })
        }

        fn held(&self, i: usize) -> Option<HeldCopy> {
            self.client(i).held_copy(KEY).unwrap()
        }

        /// What memnode `i` holds, checked to be settled.
        fn value(&self, i: usize) -> Option<Vec<u8>> {
            let held = self.held(i);
            assert!(held.as_ref().is_none_or(|h| !h.locked()), "memnode {i} still holds an intent");
            held.map(|h| h.item.value)
        }

        /// A snapshot write's intent of `value` (None: a delete) on memnode `i`, as its writer
        /// places it, with its lease over (`live`: not yet). Returns its word and mark.
        fn lock(&self, i: usize, value: Option<&[u8]>, write_id: u64, live: bool) -> (u64, TxnMark) {
            let now = racekv_hashing::clock::now_unix_ms();
            let deadline_ms = if live { now + 60_000 } else { now - TXN_LEASE_SLACK_MS - 1 };
            let mut c = self.client(i);
            let old_word = c.held_copy(KEY).unwrap().map_or(0, |h| h.word);
            let mark = TxnMark { tombstone: value.is_none(), ..TxnMark::of_snapshot(write_id, old_word, deadline_ms) };
            let lock = c.txn_lock(KEY, value, None, mark).unwrap().expect("nothing else holds the key");
            (lock.word, mark)
        }

        /// Publishes an intent `lock` placed.
        fn publish(&self, i: usize, (word, mark): (u64, TxnMark)) {
            assert!(self.client(i).txn_settle(KEY, word, &mark, true, 0).unwrap());
        }
    }

    /// Every memnode's settled value, checked equal.
    fn replicas_agree(cluster: &Cluster) -> Option<Vec<u8>> {
        let values: Vec<Option<Vec<u8>>> = (0..3).map(|i| cluster.value(i)).collect();
        assert!(values.iter().all(|v| *v == values[0]), "replicas differ: {values:?}");
        values[0].clone()
    }

    #[test]
    fn snapshot_writes_reach_every_replica() {
        let cluster = Cluster::start();
        let mut session = cluster.session();
        session.put(KEY, b"one").unwrap();
        assert_eq!(replicas_agree(&cluster).as_deref(), Some(&b"one"[..]));
        let big = vec![9u8; 100_000]; // in an extent on each memnode
        session.put(KEY, &big).unwrap();
        assert_eq!(replicas_agree(&cluster), Some(big.clone()));
        assert_eq!(session.get(KEY).unwrap(), Some(big));
        assert!(session.delete(KEY).unwrap());
        assert_eq!(replicas_agree(&cluster), None);
        assert!(!session.delete(KEY).unwrap(), "deleting an absent key deletes nothing");
        assert!(session.put_with(KEY, b"two", racekv_hashing::PutMode::InsertOnly).unwrap());
        assert!(!session.put_with(KEY, b"three", racekv_hashing::PutMode::InsertOnly).unwrap());
        assert_eq!(replicas_agree(&cluster).as_deref(), Some(&b"two"[..]));
    }

    /// Sessions racing to increment one key (each a read, a decision and a write on every
    /// replica) lose no increment and count none twice, and leave the replicas equal: in
    /// process (blocks reused at once, so slot words recur) and over tcp (each step's
    /// batches to the three memnodes in flight together).
    #[test]
    fn racing_snapshot_increments_are_each_counted_once() {
        for via in [Via::Local, Via::Transport(racekv_transport::TransportKind::Tcp)] {
            racing_increments(via);
        }
    }

    fn racing_increments(via: Via) {
        const SESSIONS: usize = 4;
        const INCREMENTS: u64 = 150;
        let cluster = Cluster::start_via(via);
        cluster.session().put(KEY, b"0").unwrap();
        std::thread::scope(|scope| {
            for _ in 0..SESSIONS {
                let mut session = cluster.session();
                scope.spawn(move || {
                    for _ in 0..INCREMENTS {
                        session
                            .write_replicated(KEY, |item| {
                                let n: u64 = item.map_or(0, |i| String::from_utf8(i.value).unwrap().parse().unwrap());
                                let next = (n + 1).to_string().into_bytes();
                                (Some(crate::replicated::Change::Put(next.into(), None)), ())
                            })
                            .unwrap();
                    }
                });
            }
        });
        let total = (SESSIONS as u64 * INCREMENTS).to_string().into_bytes();
        assert_eq!(replicas_agree(&cluster), Some(total), "{via:?}");
    }

    /// The snapshot protocol through lost requests (the design note's model test, §3.8): a
    /// session writes and deletes `KEY` over three memnodes whose connections lose a
    /// request now and then, before or after it ran. After each write, once every
    /// replica's intents are resolved (a write that reads every replica and writes nothing,
    /// by a session whose connections lose nothing), the replicas agree on one value: the
    /// one written if the write was acknowledged, the one before or the one written if it
    /// failed. Fixed seeds (printed).
    #[test]
    fn snapshot_writes_through_lost_requests_leave_the_replicas_agreeing() {
        use racekv_hashing::testing::FaultyConnection;
        use std::sync::Arc;

        const WRITES: usize = 150;
        let cluster = Cluster::start();
        let faulty: Vec<Arc<FaultyConnection>> =
            cluster.memnodes.iter().map(|m| Arc::new(FaultyConnection::new(m.connect()))).collect();
        for (i, conn) in faulty.iter().enumerate() {
            conn.random(0x5eed + i as u64, 20);
        }
        let clients = (0..3).map(|i| cluster.tables[i].client(Arc::clone(&faulty[i]) as _)).collect();
        let mut writer = Session::new(Replicas { clients });
        let mut checker = cluster.session();
        let mut value: Option<Vec<u8>> = Some(b"old".to_vec());
        let (mut failed, mut resolved_to_new) = (0, 0);
        for step in 0..WRITES {
            let new = (step % 5 != 4).then(|| format!("v{step}").into_bytes());
            let result = match &new {
                Some(v) => writer.put(KEY, v),
                None => writer.delete(KEY).map(|_| ()),
            };
            checker.write_replicated(KEY, |_| (None, ())).unwrap();
            let now = replicas_agree(&cluster);
            match result {
                Ok(()) => assert_eq!(now, new, "step {step}: an acknowledged write"),
                Err(e) => {
                    assert!(now == value || now == new, "step {step}: failed ({e}) and left {now:?}");
                    failed += 1;
                    resolved_to_new += usize::from(now == new && now != value);
                }
            }
            value = now;
        }
        let injected: u64 = faulty.iter().map(|c| c.injected()).sum();
        eprintln!(
            "{WRITES} writes, {injected} lost requests, {failed} writes failed, {resolved_to_new} of those applied"
        );
        assert!(failed > 0, "no write met a lost request ({injected} injected)");
    }

    #[test]
    fn a_dead_writers_lock_on_the_primary_is_rolled_forward_to_every_backup() {
        let cluster = Cluster::start();
        // Locked on the primary and one backup; the other backup never reached.
        cluster.lock(0, Some(b"new"), 7, false);
        cluster.lock(1, Some(b"new"), 7, false);
        assert_eq!(cluster.session().get(KEY).unwrap().as_deref(), Some(&b"new"[..]));
        for i in 0..3 {
            assert_eq!(cluster.value(i).as_deref(), Some(&b"new"[..]), "memnode {i}");
        }
    }

    #[test]
    fn a_dead_writers_delete_is_rolled_forward_too() {
        let cluster = Cluster::start();
        cluster.lock(0, None, 8, false);
        assert_eq!(cluster.session().get(KEY).unwrap(), None);
        for i in 0..3 {
            assert_eq!(cluster.value(i), None, "memnode {i}");
        }
    }

    #[test]
    fn intents_of_a_write_that_lost_the_primary_go_back() {
        let cluster = Cluster::start();
        let intents = [cluster.lock(1, Some(b"new"), 9, false), cluster.lock(2, Some(b"new"), 9, false)];
        let mut session = cluster.session();
        for (i, (word, mark)) in intents.into_iter().enumerate() {
            session.resolve_lock(i + 1, KEY, word, &mark).unwrap();
        }
        for i in 0..3 {
            assert_eq!(cluster.value(i).as_deref(), Some(&b"old"[..]), "memnode {i}");
        }
        // Also while another write, live, holds the primary.
        let (word, mark) = cluster.lock(1, Some(b"new"), 10, false);
        cluster.lock(0, Some(b"other"), 11, true);
        session.resolve_lock(1, KEY, word, &mark).unwrap();
        assert_eq!(cluster.value(1).as_deref(), Some(&b"old"[..]));
    }

    #[test]
    fn a_backups_intent_stands_once_the_primary_took_its_write() {
        // Published on the primary (the writer died before the backups' publish).
        let cluster = Cluster::start();
        let at_primary = cluster.lock(0, Some(b"new"), 12, false);
        let (word, mark) = cluster.lock(1, Some(b"new"), 12, false);
        cluster.publish(0, at_primary);
        cluster.session().resolve_lock(1, KEY, word, &mark).unwrap();
        assert_eq!(cluster.value(1).as_deref(), Some(&b"new"[..]));

        // Published on the primary, and another write, live, locked the primary over it.
        let cluster = Cluster::start();
        let at_primary = cluster.lock(0, Some(b"new"), 13, false);
        let (word, mark) = cluster.lock(1, Some(b"new"), 13, false);
        cluster.publish(0, at_primary);
        cluster.lock(0, Some(b"later"), 14, true);
        cluster.session().resolve_lock(1, KEY, word, &mark).unwrap();
        assert_eq!(cluster.value(1).as_deref(), Some(&b"new"[..]));
    }

    #[test]
    fn a_dead_write_over_another_dead_writes_copy_is_rolled_forward_over_its_intents() {
        // Write 15 published on the primary, its intent still on backup 1; then write 16
        // locked the primary over it; both writers died.
        let cluster = Cluster::start();
        let at_primary = cluster.lock(0, Some(b"first"), 15, false);
        cluster.lock(1, Some(b"first"), 15, false);
        cluster.publish(0, at_primary);
        cluster.lock(0, Some(b"second"), 16, false);
        assert_eq!(cluster.session().get(KEY).unwrap().as_deref(), Some(&b"second"[..]));
        for i in 0..3 {
            assert_eq!(cluster.value(i).as_deref(), Some(&b"second"[..]), "memnode {i}");
        }
    }
}
