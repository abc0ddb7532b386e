//! Routing keys to memnodes, shared by computenodes and embedded clients: a [`Router`] per
//! process (a fixed ring, or the cluster map's partitions, replaced as newer maps arrive)
//! and a [`SessionRouting`] per session (the map it routes by, taken when an operation
//! starts, and the epochs its memnodes report through `map_fence`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use racekv_transport::Connection;

use crate::map_fence::{MapChange, MapEpochs, MapFence};
use crate::placement::{PartitionTable, Placement};
use crate::ring::Ring;

/// How a process's sessions route keys to its memnodes (shard `i` has node id `ids[i]`).
#[derive(Debug)]
pub struct Router {
    placement: Placement,
    /// Grows when a map adds a memnode ([`Router::add_memnode`]); shard indexes never change.
    ids: parking_lot::RwLock<Vec<u64>>,
    /// Notified when a map is installed; sessions waiting for one sleep on it.
    installed: (Mutex<()>, Condvar),
    /// A session saw a memnode serve a newer map than installed: whoever follows the map
    /// reads it now rather than wait for its watch.
    wanted: AtomicBool,
    /// Until when etcd vouches for the installed map ([`Router::confirm`]).
    lease: MapLease,
}

/// How long a process may route by its map without hearing from etcd that the map is still
/// the newest: one cut off from etcd cannot learn of a failover, so it stops serving when
/// this lapses (ARCHITECTURE, "The fence"). Times are microseconds after `base`.
#[derive(Debug)]
struct MapLease {
    base: Instant,
    /// One more than the microsecond since `base` at which the map's lease lapses (0: no
    /// lease is kept: it never lapses).
    until_us: AtomicU64,
    /// The lease's length.
    lease_us: AtomicU64,
}

impl MapLease {
    fn us(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.base).as_micros()).unwrap_or(u64::MAX)
    }
}

impl Router {
    /// A fixed consistent-hashing ring over memnodes with node ids `ids`.
    pub fn ring(ids: &[u64]) -> Self {
        Self::with(Placement::Ring(Ring::new(ids)), ids)
    }

    /// Routing by map `epoch` of replication factor `replicas`, whose partition `p` lives
    /// on the memnodes with node ids `replica_sets[p]` (the primary first), over memnodes with node ids `ids`, which must
    /// be the ones the map gives them (`mapped`, in the same order; `label(i)` names memnode
    /// `i` in the error).
    pub fn map(
        epoch: u64,
        replicas: u8,
        snapshot_writes: bool,
        replica_sets: &[Vec<u64>],
        ids: &[u64],
        mapped: &[u64],
        label: impl Fn(usize) -> String,
    ) -> Result<Self, String> {
        if let Some(i) = (0..ids.len()).find(|&i| mapped.get(i) != Some(&ids[i])) {
            return Err(format!(
                "{} has node id {:#x}, not the one the cluster map gives it ({})",
                label(i),
                ids[i],
                mapped.get(i).map_or("none".into(), |id| format!("{id:#x}"))
            ));
        }
        let table = partition_table(epoch, replicas, replica_sets, ids)?.with_snapshot_writes(snapshot_writes);
        Ok(Self::with(Placement::partitions(table), ids))
    }

    fn with(placement: Placement, ids: &[u64]) -> Self {
        Self {
            placement,
            ids: parking_lot::RwLock::new(ids.to_vec()),
            installed: (Mutex::new(()), Condvar::new()),
            wanted: AtomicBool::new(false),
            lease: MapLease { base: Instant::now(), until_us: AtomicU64::new(0), lease_us: AtomicU64::new(0) },
        }
    }

    /// etcd said, answering a read sent at `sent`, that the installed map is the newest:
    /// it is vouched for until `sent + lease` (never less than before).
    pub fn confirm(&self, sent: Instant, lease: Duration) {
        assert!(!lease.is_zero(), "a map lease lasts");
        let lease_us = u64::try_from(lease.as_micros()).unwrap_or(u64::MAX);
        self.lease.lease_us.store(lease_us, Ordering::Release);
        // A read sent before this router was made (the start's) vouches for less.
        let until = match sent.checked_duration_since(self.lease.base) {
            Some(after) => after.saturating_add(lease),
            None => lease.saturating_sub(self.lease.base - sent),
        };
        // Stored one above the microsecond it lapses at, so 0 stays "none kept" and a lease
        // that lapsed before the router was made (0) still reads as lapsed at once.
        let until_us = u64::try_from(until.as_micros()).unwrap_or(u64::MAX).saturating_add(1);
        self.lease.until_us.fetch_max(until_us, Ordering::AcqRel);
    }

    /// When the map's lease has lapsed: how long ago etcd last vouched for it, and the
    /// lease. None within the lease, or where none is kept (a fixed ring, or a follower
    /// told to keep none).
    pub fn unconfirmed(&self) -> Option<(Duration, Duration)> {
        let until = self.lease.until_us.load(Ordering::Acquire);
        if until == 0 {
            return None;
        }
        let now = self.lease.us(Instant::now()).saturating_add(1);
        if now < until {
            return None;
        }
        let lease = self.lease.lease_us.load(Ordering::Acquire);
        Some((Duration::from_micros(now - until.saturating_sub(lease)), Duration::from_micros(lease)))
    }

    /// The epoch of the map routed by (None: a fixed ring).
    pub fn epoch(&self) -> Option<u64> {
        self.placement.epoch()
    }

    /// Routes by a newer map from now on. Refused (routing unchanged) on a fixed ring, for a
    /// map not newer than the current one, and for a replica this process has no
    /// connection to.
    pub fn install(
        &self,
        epoch: u64,
        replicas: u8,
        snapshot_writes: bool,
        replica_sets: &[Vec<u64>],
    ) -> Result<(), String> {
        let table =
            partition_table(epoch, replicas, replica_sets, &self.ids.read())?.with_snapshot_writes(snapshot_writes);
        self.placement.install(table)?;
        drop(self.installed.0.lock());
        self.installed.1.notify_all();
        Ok(())
    }

    /// The shard of the memnode with node id `id`, if this process has one.
    pub fn shard_of(&self, id: u64) -> Option<usize> {
        self.ids.read().iter().position(|&x| x == id)
    }

    /// Memnode `id` is this process's next shard from now on (its owner connected to it and
    /// appended it to its own memnodes first, under the same lock); its index. Refused on a
    /// fixed ring, whose memnodes never change.
    pub fn add_memnode(&self, id: u64) -> Result<usize, String> {
        if self.epoch().is_none() {
            return Err("a fixed ring's memnodes do not change".into());
        }
        let mut ids = self.ids.write();
        if let Some(at) = ids.iter().position(|&x| x == id) {
            return Ok(at);
        }
        ids.push(id);
        Ok(ids.len() - 1)
    }

    /// Whether a session asked for the map to be read again (and clears the request).
    pub fn take_wanted(&self) -> bool {
        self.wanted.swap(false, Ordering::AcqRel)
    }

    /// Waits up to `timeout` for a map of at least `epoch` (asking for it to be read);
    /// whether one is installed.
    fn await_epoch(&self, epoch: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut guard = self.installed.0.lock();
        loop {
            if self.epoch().is_some_and(|e| e >= epoch) {
                return true;
            }
            self.wanted.store(true, Ordering::Release);
            if self.installed.1.wait_until(&mut guard, deadline).timed_out() {
                return self.epoch().is_some_and(|e| e >= epoch);
            }
        }
    }

    /// A new session's routing: the current map, and (routing by a map) its epochs.
    pub fn session(&self) -> SessionRouting {
        let table = self.placement.table();
        let epochs = table.as_ref().map(|t| Arc::new(MapEpochs::new(t.epoch())));
        SessionRouting { table, epochs }
    }
}

/// Map `epoch`'s routing (replication factor `replicas`) over memnodes with node ids `ids`
/// (shard i has `ids[i]`).
fn partition_table(epoch: u64, replicas: u8, replica_sets: &[Vec<u64>], ids: &[u64]) -> Result<PartitionTable, String> {
    let shard = |id: &u64| {
        ids.iter().position(|x| x == id).ok_or_else(|| {
            format!("map epoch {epoch} has memnode {id:#x} in a replica set, and this process is not connected to it")
        })
    };
    let sets = replica_sets
        .iter()
        .map(|set| set.iter().map(shard).collect::<Result<Vec<_>, _>>())
        .collect::<Result<Vec<_>, _>>()?;
    Ok(PartitionTable::replicated(epoch, &sets, ids.len())?.with_replicas(usize::from(replicas)))
}

/// One session's routing (the `Shards` hooks of a session routing by a [`Router`]).
#[derive(Debug)]
pub struct SessionRouting {
    /// The map's partitions routed by (None: the router's fixed ring); taken anew only
    /// when an operation starts, so an operation routes all its keys by one map.
    table: Option<Arc<PartitionTable>>,
    /// That map's epoch and the newest one its memnodes reported (with `table`).
    epochs: Option<Arc<MapEpochs>>,
}

impl SessionRouting {
    /// The shard that serves `key`.
    pub fn route(&self, router: &Router, key: &[u8]) -> usize {
        match &self.table {
            Some(table) => table.shard(key),
            None => router.placement.shard(key),
        }
    }

    /// The shards of `key`'s replicas after the one that serves it (none on a ring).
    pub fn backups(&self, key: &[u8]) -> &[u16] {
        self.table.as_ref().map_or(&[], |table| table.backups(key))
    }

    /// Whether writes of `key` go through its primary's lock
    /// ([`PartitionTable::locks_writes`]; never on a ring).
    pub fn locks_writes(&self, key: &[u8]) -> bool {
        self.table.as_ref().is_some_and(|table| table.locks_writes(key))
    }

    /// Whether replicated writes go by the snapshot protocol (the map's flag; never on a ring).
    pub fn snapshot_writes(&self) -> bool {
        self.table.as_ref().is_some_and(|table| table.snapshot_writes())
    }

    /// Whether `shard` holds a partition (on a ring, every one does).
    pub fn serves(&self, shard: usize) -> bool {
        self.table.as_ref().is_none_or(|table| table.serves(shard))
    }

    /// The share of `shard`'s items that are keys to count (all on a ring; see
    /// [`PartitionTable::item_share`]).
    pub fn item_share(&self, shard: usize) -> (u64, u64) {
        self.table.as_ref().map_or((1, 1), |table| table.item_share(shard))
    }

    /// Takes the router's newest map (a no-op on a fixed ring).
    pub fn refresh(&mut self, router: &Router) {
        let (Some(table), Some(epochs)) = (&mut self.table, &self.epochs) else { return };
        if router.epoch() != Some(table.epoch()) {
            *table = router.placement.table().expect("a router of a map keeps one");
            epochs.route_by(table.epoch());
        }
    }

    /// What a memnode reported, when it served a newer map (or was fenced).
    pub fn changed(&self) -> Option<MapChange> {
        self.epochs.as_ref()?.change()
    }

    /// Waits up to `timeout` for a map of at least `epoch` and routes by it.
    pub fn await_map(&mut self, router: &Router, epoch: u64, timeout: Duration) -> bool {
        if self.epochs.is_none() || !router.await_epoch(epoch, timeout) {
            return false;
        }
        self.refresh(router);
        true
    }

    /// `conn` as this session's table clients use it: fenced when routing by a map.
    pub fn connection(&self, conn: Arc<dyn Connection>) -> Arc<dyn Connection> {
        match &self.epochs {
            Some(epochs) => Arc::new(MapFence::new(conn, Arc::clone(epochs))),
            None => conn,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_route_by_the_map_they_took_until_they_refresh() {
        let label = |i: usize| format!("memnode #{i}");
        assert!(Router::map(1, 1, false, &[vec![10], vec![20]], &[10, 20], &[10, 21], label)
            .unwrap_err()
            .contains("memnode #1 has node id 0x14, not the one the cluster map gives it (0x15)"));
        let router = Router::map(1, 2, false, &[vec![10, 20], vec![20, 10]], &[10, 20], &[10, 20], label).unwrap();
        let mut session = router.session();
        let key = b"k";
        let first = session.route(&router, key);
        let other = [20, 10][first];
        assert_eq!(session.backups(key), &[1 - first as u16][..]);
        router.install(2, 1, false, &[vec![other], vec![other]]).unwrap();
        assert_eq!(session.route(&router, key), first, "one operation, one map");
        session.refresh(&router);
        assert_eq!(session.route(&router, key), 1 - first);
        assert!(router.install(3, 2, false, &[vec![10, 30], vec![10]]).unwrap_err().contains("not connected"));
        assert!(!session.await_map(&router, 3, Duration::from_millis(20)), "no map 3 came");
        assert!(router.take_wanted(), "the wait asked for the map to be read");
        assert!(session.await_map(&router, 2, Duration::ZERO));
        let ring = Router::ring(&[10, 20]);
        let mut on_ring = ring.session();
        assert_eq!((on_ring.changed(), ring.epoch()), (None, None));
        assert!(!on_ring.await_map(&ring, 1, Duration::ZERO));
    }

    #[test]
    fn a_map_unconfirmed_for_longer_than_its_lease_is_not_routed_by() {
        let router = Router::map(1, 1, false, &[vec![10]], &[10], &[10], |i| format!("#{i}")).unwrap();
        assert_eq!(router.unconfirmed(), None, "no lease kept yet");
        let lease = Duration::from_millis(50);
        router.confirm(Instant::now(), lease);
        assert_eq!(router.unconfirmed(), None);
        std::thread::sleep(Duration::from_millis(60));
        let (since, of) = router.unconfirmed().expect("lapsed");
        assert!(since >= Duration::from_millis(60) && of == lease, "{since:?} {of:?}");
        // An older answer never shortens it, nor vouches beyond its own lease (this one
        // was sent before the router was made); a newer one renews it.
        router.confirm(Instant::now() - Duration::from_secs(1), lease);
        assert!(router.unconfirmed().is_some());
        let fresh = Router::map(1, 1, false, &[vec![10]], &[10], &[10], |i| format!("#{i}")).unwrap();
        fresh.confirm(Instant::now() - Duration::from_millis(60), lease);
        assert!(fresh.unconfirmed().is_some(), "60 ms old, of a 50 ms lease");
        router.confirm(Instant::now(), lease);
        assert_eq!(router.unconfirmed(), None);
    }
}
