//! The epoch check of requests routed by a cluster map (issue 17). One-sided operations
//! never reach a memnode's CPU, so it cannot refuse them; instead each memnode keeps the
//! newest map epoch it serves by in a word of its region (`sb::MAP_EPOCH`), and a
//! [`MapFence`] appends a READ of that word to every batch. Ops of a batch execute in
//! order on every transport (a NIC's queue pair, the tcp server, shared memory), so a word
//! no newer than the routed epoch proves the batch's other ops ran while the memnode still
//! served that map. A newer word is recorded ([`MapEpochs::changed`]); the session that
//! routed the operation then waits for that map, and routes again and repeats the operation
//! when the key's memnode changed (its result there stands when it did not). The operation
//! itself is not cut short: a batch that ran is never reported as failed. Whoever takes a
//! partition off a memnode raises its word first; a memnode whose etcd lease may have
//! lapsed (so a failover it cannot see may have taken its partitions) sets the word's fence
//! bit, and then no result it returns stands by any map ([`MapChange::fenced`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use racekv_hashing::format::MapWord;
use racekv_hashing::layout::sb;
use racekv_transport::{Batch, Connection, Started, TransportError, TransportKind, MAX_BATCH_OPS};

/// A session's map epochs, shared by its fenced connections: the one it routes by, and the
/// newest any memnode reported since.
#[derive(Debug, Default)]
pub struct MapEpochs {
    routed: AtomicU64,
    seen: AtomicU64,
    /// A memnode reported itself fenced since the session last routed.
    fenced: AtomicBool,
}

/// What a session learned of newer maps ([`MapEpochs::change`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapChange {
    /// The epoch the session routed by.
    pub routed: u64,
    /// The map to wait for.
    pub current: u64,
    /// A memnode reached was fenced: what it returned stands by no map, so the operation
    /// runs again (or fails) whatever the new map says.
    pub fenced: bool,
}

impl MapEpochs {
    /// Epochs of a session routing by map `routed`.
    pub fn new(routed: u64) -> Self {
        Self { routed: AtomicU64::new(routed), seen: AtomicU64::new(routed), fenced: AtomicBool::new(false) }
    }

    /// The epoch routed by.
    pub fn routed(&self) -> u64 {
        self.routed.load(Ordering::Acquire)
    }

    /// Routes by map `epoch` from now on (forgets reports no newer than it).
    pub fn route_by(&self, epoch: u64) {
        self.routed.store(epoch, Ordering::Release);
        self.seen.fetch_max(epoch, Ordering::AcqRel);
        self.fenced.store(false, Ordering::Release);
    }

    /// The newest epoch a memnode reported, when newer than the one routed by.
    pub fn changed(&self) -> Option<u64> {
        let seen = self.seen.load(Ordering::Acquire);
        (seen > self.routed()).then_some(seen)
    }

    /// What a memnode reported since the session routed, when it must wait for a newer map.
    pub fn change(&self) -> Option<MapChange> {
        let current = self.changed()?;
        Some(MapChange { routed: self.routed(), current, fenced: self.fenced.load(Ordering::Acquire) })
    }

    /// Records a memnode's map epoch word: a fenced memnode (its lease may have lapsed, so a
    /// map it has not seen may have failed it over) makes the session wait for a map newer
    /// than any it routed by.
    fn report(&self, stored: u64) {
        let word = MapWord::decode(stored);
        if word.fenced {
            self.fenced.store(true, Ordering::Release);
            self.seen.fetch_max(word.epoch.max(self.routed()) + 1, Ordering::AcqRel);
        } else {
            self.seen.fetch_max(word.epoch, Ordering::AcqRel);
        }
    }
}

/// A connection that reads the memnode's map epoch after every batch (see the module's
/// comment).
pub struct MapFence {
    inner: Arc<dyn Connection>,
    epochs: Arc<MapEpochs>,
}

impl MapFence {
    /// Fences `inner`'s batches, reporting to `epochs`.
    pub fn new(inner: Arc<dyn Connection>, epochs: Arc<MapEpochs>) -> Self {
        Self { inner, epochs }
    }
}

fn word(bytes: &[u8]) -> u64 {
    u64::from_le_bytes(bytes.try_into().expect("an 8-byte READ"))
}

impl MapFence {
    /// Appends the fence READ to `batch` and returns the batch's length before it; None
    /// when there is no room for it, or nothing to fence.
    fn fence(batch: &mut Batch) -> Option<usize> {
        if batch.is_empty() || batch.len() >= MAX_BATCH_OPS {
            return None;
        }
        let len = batch.len();
        batch.read(sb::MAP_EPOCH, 8);
        Some(len)
    }

    /// Reports the epoch the fence READ at `len` returned and takes it off `batch` again;
    /// `result` is the batch's.
    fn unfence(&self, batch: &mut Batch, len: usize, result: Result<(), TransportError>) -> Result<(), TransportError> {
        let read = batch.read_at(len).expect("the fence READ is where it was appended");
        if let Ok(bytes) = batch.read_result(read) {
            self.epochs.report(word(bytes));
        }
        batch.truncate(len);
        match result {
            // Only the READ failed (it cannot, on a formatted region): the caller's ops ran.
            Err(TransportError::Op { index, .. }) if index == len => {
                Err(TransportError::Protocol("the map epoch word could not be read".into()))
            }
            result => result,
        }
    }

    /// A batch with no room for the fence READ (or nothing to fence), then the READ in a
    /// batch of its own, after this one completed, so still ordered after every op of it.
    fn execute_then_fence(&self, batch: &mut Batch) -> Result<(), TransportError> {
        self.inner.execute(batch)?;
        let mut fence = Batch::new();
        let read = fence.read(sb::MAP_EPOCH, 8);
        self.inner.execute(&mut fence)?;
        self.epochs.report(word(fence.read_result(read).expect("an executed READ has its bytes")));
        Ok(())
    }
}

impl Connection for MapFence {
    fn execute(&self, batch: &mut Batch) -> Result<(), TransportError> {
        match Self::fence(batch) {
            None => self.execute_then_fence(batch),
            Some(len) => {
                let result = self.inner.execute(batch);
                self.unfence(batch, len, result)
            }
        }
    }

    fn start(&self, batch: &mut Batch) -> Started {
        let Some(len) = Self::fence(batch) else { return Started::done(self.execute_then_fence(batch)) };
        let inner = self.inner.start(batch);
        Started::forwarded(Arc::clone(&self.inner), inner, len as u64)
    }

    fn finish(&self, started: Started, batch: &mut Batch) -> Result<(), TransportError> {
        match started.into_forwarded() {
            Ok(sent) => {
                let result = sent.conn.finish(sent.inner, batch);
                self.unfence(batch, sent.note as usize, result)
            }
            Err(result) => result,
        }
    }

    fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, TransportError> {
        // RPCs allocate and describe space; they place no key, so the map does not fence them.
        self.inner.call(method, request)
    }

    fn region_len(&self) -> u64 {
        self.inner.region_len()
    }

    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }

    fn instance(&self) -> u64 {
        self.inner.instance()
    }

    fn is_healthy(&self) -> bool {
        self.inner.is_healthy()
    }

    fn check_healthy(&self) -> bool {
        self.inner.check_healthy()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use racekv_hashing::format::{fence_map_epoch, raise_map_epoch, read_map_epoch, read_map_word, unfence_map_epoch};
    use racekv_hashing::testing::{TestMemnode, Via};

    #[test]
    fn batches_report_a_memnode_serving_a_newer_map() {
        let m = TestMemnode::start(Via::Local, 4 << 20, 4);
        let epochs = Arc::new(MapEpochs::new(3));
        let fenced = MapFence::new(m.connect(), Arc::clone(&epochs));
        let mut b = Batch::new();
        let node_id = b.read(sb::NODE_ID, 8);
        fenced.execute(&mut b).unwrap();
        assert_eq!(b.len(), 1, "the fence READ is gone from the caller's batch");
        assert_ne!(word(b.read_result(node_id).unwrap()), 0);
        assert_eq!(epochs.changed(), None, "the memnode serves no map (0)");

        assert_eq!(raise_map_epoch(&*m.connect(), 5).unwrap(), 5);
        assert_eq!(raise_map_epoch(&*m.connect(), 4).unwrap(), 5, "never lowered");
        b.clear();
        let w = b.write(sb::MAP_EPOCH + 8 * 64, &[7; 8]); // a superblock word no one uses
        fenced.execute(&mut b).unwrap();
        assert!(b.result(w).is_ok());
        assert_eq!(epochs.changed(), Some(5));
        epochs.route_by(5);
        assert_eq!(epochs.changed(), None);

        // A full batch gets the READ in a batch of its own, after it.
        raise_map_epoch(&*m.connect(), 6).unwrap();
        b.clear();
        for _ in 0..MAX_BATCH_OPS {
            b.read(sb::NODE_ID, 8);
        }
        fenced.execute(&mut b).unwrap();
        assert_eq!((b.len(), epochs.changed()), (MAX_BATCH_OPS, Some(6)));
        assert_eq!(read_map_epoch(&*m.connect()).unwrap(), 6);
    }

    /// Batches sent together on several fenced connections (`racekv_transport::overlap`, as
    /// a replicated write's steps go) each come back with their own results and without the
    /// fence READ, and each memnode's epoch is reported: over tcp (the READ travels with the
    /// batch and is checked when it is finished), in process (finished as it starts), and a
    /// full batch (its READ in a batch of its own).
    #[test]
    fn batches_sent_together_on_fenced_connections_each_report_their_memnodes_map() {
        let memnodes = [
            TestMemnode::start(Via::Transport(racekv_transport::TransportKind::Tcp), 4 << 20, 4),
            TestMemnode::start(Via::Transport(racekv_transport::TransportKind::Tcp), 4 << 20, 4),
            TestMemnode::start(Via::Local, 4 << 20, 4),
        ];
        let epochs = Arc::new(MapEpochs::new(3));
        let fenced: Vec<MapFence> = memnodes.iter().map(|m| MapFence::new(m.connect(), Arc::clone(&epochs))).collect();
        for (round, m) in memnodes.iter().enumerate() {
            let epoch = 4 + round as u64;
            assert_eq!(raise_map_epoch(&*m.connect(), epoch).unwrap(), epoch);
            let mut batches: Vec<Batch> = (0..fenced.len()).map(|_| Batch::new()).collect();
            let mut reads = Vec::new();
            for (i, b) in batches.iter_mut().enumerate() {
                b.write(sb::MAP_EPOCH + 8 * 64, &[i as u8 + 1; 8]);
                reads.push(b.read(sb::MAP_EPOCH + 8 * 64, 8));
                if i == round {
                    while b.len() < MAX_BATCH_OPS {
                        b.read(sb::NODE_ID, 8);
                    }
                }
            }
            let lens: Vec<usize> = batches.iter().map(Batch::len).collect();
            let mut work: Vec<(&dyn Connection, &mut Batch)> =
                fenced.iter().map(|f| f as &dyn Connection).zip(batches.iter_mut()).collect();
            for result in racekv_transport::execute_all(&mut work) {
                result.unwrap();
            }
            for (i, b) in batches.iter().enumerate() {
                assert_eq!(b.len(), lens[i], "memnode {i}: the fence READ is gone from the caller's batch");
                assert_eq!(b.read_result(reads[i]).unwrap(), &[i as u8 + 1; 8], "memnode {i}: its own bytes");
            }
            assert_eq!(epochs.changed(), Some(epoch), "round {round}: memnode {round}'s newer map reported");
            epochs.route_by(epoch);
        }
    }

    #[test]
    fn a_fenced_memnode_stands_by_no_map_until_it_clears_its_fence() {
        let m = TestMemnode::start(Via::Local, 4 << 20, 4);
        let epochs = Arc::new(MapEpochs::new(7));
        let fenced = MapFence::new(m.connect(), Arc::clone(&epochs));
        let conn = m.connect();
        raise_map_epoch(&*conn, 5).unwrap();
        let word = fence_map_epoch(&*conn).unwrap();
        assert_eq!(word, MapWord { epoch: 5, fenced: true });
        assert_eq!(fence_map_epoch(&*conn).unwrap(), word, "fencing twice changes nothing");
        assert_eq!(raise_map_epoch(&*conn, 6).unwrap(), 6, "a raise keeps the fence");
        assert_eq!(MapWord::decode(read_map_word(&*conn).unwrap()), MapWord { epoch: 6, fenced: true });
        assert_eq!(read_map_epoch(&*conn).unwrap(), 6);

        let mut b = Batch::new();
        b.read(sb::NODE_ID, 8);
        fenced.execute(&mut b).unwrap();
        let change = MapChange { routed: 7, current: 8, fenced: true };
        assert_eq!(epochs.change(), Some(change), "newer than any map routed by, its epoch (6) older");
        epochs.route_by(8);
        assert_eq!(epochs.change(), None, "routing again forgets the fence");
        fenced.execute(&mut b).unwrap();
        assert_eq!(epochs.change(), Some(MapChange { routed: 8, current: 9, fenced: true }));

        // Registered again, the memnode clears the fence by the map it read (never lowering).
        assert_eq!(unfence_map_epoch(&*conn, 9).unwrap(), MapWord { epoch: 9, fenced: false });
        assert_eq!(unfence_map_epoch(&*conn, 4).unwrap(), MapWord { epoch: 9, fenced: false });
        epochs.route_by(9);
        fenced.execute(&mut b).unwrap();
        assert_eq!(epochs.change(), None);
        // Concurrent raisers and fencers never lose each other's updates.
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let conn = m.connect();
                s.spawn(move || {
                    for i in 0..200 {
                        raise_map_epoch(&*conn, 10 + i * 4 + t).unwrap();
                        if i % 50 == 0 {
                            fence_map_epoch(&*conn).unwrap();
                        }
                    }
                });
            }
        });
        assert_eq!(MapWord::decode(read_map_word(&*conn).unwrap()), MapWord { epoch: 10 + 199 * 4 + 3, fenced: true });
    }
}
