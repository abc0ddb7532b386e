//! Live membership (issue 17, item 4): `racekv cluster add-memnode`, `remove-memnode`,
//! `set-replicas` and `balance`, run as an embedded client of the cluster. The map changes are
//! `racekv_coord::membership`'s; the copying is the rejoin's (`rejoin.rs`, the client's
//! `catchup.rs`); the removal of stale copies is the client's `moves.rs`.

use std::collections::BTreeSet;

use anyhow::Context;
use racekv_client::Client;
use racekv_coord::etcd::Etcd;
use racekv_coord::membership::{self, Move};
use racekv_coord::ClusterMap;

use crate::rejoin::{copy_partitions, next_candidate, primary_of, rejoin, KeyRate};

/// The lease of a command's claim to be moving partitions ([`Etcd::claim_mover`]): a
/// mover that dies leaves its moves to the healer this long after.
const MOVER_LEASE: std::time::Duration = std::time::Duration::from_secs(5);

/// Most rounds of one command (each round moves, copies or purges what is left; a round
/// repeats only when the map changed under it, e.g. a failover).
const MAX_ROUNDS: usize = 8;

/// How long writes by an R = 1 map may still land after a map that makes them go through
/// the primary's lock is written: a process learns of that map within its map lease (cut
/// off from etcd, it stops serving by then), and a write it started by the old map lands
/// within two operation timeouts (the defaults of both; a process configured for longer,
/// or with no map lease, is not covered). Such a write is a plain upsert, visible at once
/// and copied by no one if its writer dies before syncing it, so the copy to a memnode
/// joining its partition starts only after this (ARCHITECTURE, "Catch-up").
const PLAIN_WRITES_SETTLE: std::time::Duration =
    racekv_client::map_follower::DEFAULT_MAP_LEASE.saturating_add(std::time::Duration::from_secs(10));

/// What a command reports as it goes: a phase's name, then keys handled in it.
pub trait Progress {
    /// A new phase begins.
    fn phase(&mut self, what: &str);
    /// `n` more keys handled.
    fn keys(&mut self, n: u64);
}

/// Writes the map `change` makes of the current one, by compare-and-swap, raising first the
/// epoch word of every memnode of a partition whose primary it changes
/// (`membership::fenced`).
/// Returns (the map before, the map written); None when `change` has nothing to do.
fn update_map(
    etcd: &Etcd,
    client: &Client,
    change: impl Fn(&ClusterMap) -> anyhow::Result<Option<ClusterMap>>,
) -> anyhow::Result<Option<(ClusterMap, ClusterMap)>> {
    loop {
        let (map, revision) = etcd.map()?.context("the cluster has no map yet (`racekv cluster init`)")?;
        let Some(next) = change(&map)? else { return Ok(None) };
        for node in membership::fenced(&map, &next) {
            client.raise_served_epoch(node, next.epoch).with_context(|| {
                format!("raising memnode {node:#x}'s map epoch before its partitions' primary changes")
            })?;
        }
        if etcd.put_map(&next, Some(revision))?.is_some() {
            tracing::info!(epoch = next.epoch, "cluster map written");
            return Ok(Some((map, next)));
        }
    }
}

/// What a removal or an addition did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Moved {
    /// Partitions moved.
    pub moved: usize,
    /// Keys copied to the memnodes that took them.
    pub synced: u64,
}

/// Plans moves from the current map and the live memnodes' node ids.
type Plan<'a> = dyn Fn(&ClusterMap, &BTreeSet<u64>) -> anyhow::Result<Vec<Move>> + 'a;

/// Runs the moves `plan` makes of the current map and live memnodes (start, copy, finish),
/// round after round while the map changes under them, until it plans none (or after
/// [`MAX_ROUNDS`]). Returns what moved and the memnodes whose copies are stale now (those
/// partitions moved from, and the takers of moves called off).
fn run_moves(
    etcd: &Etcd,
    client: &Client,
    plan: &Plan<'_>,
    rate: &mut KeyRate,
    progress: &mut dyn Progress,
) -> anyhow::Result<(Moved, BTreeSet<u64>)> {
    // Held until the moves are settled: while it stands, healers leave them be.
    let _claim = etcd.claim_mover(&format!("pid {} on {}", std::process::id(), host_name()), MOVER_LEASE)?;
    let mut done = Moved::default();
    let mut sources = BTreeSet::new();
    for _ in 0..MAX_ROUNDS {
        let (map, _) = etcd.map()?.context("the cluster has no map yet (`racekv cluster init`)")?;
        let live: BTreeSet<u64> = etcd.memnodes()?.iter().map(|m| m.node_id).collect();
        let moves = plan(&map, &live)?;
        if moves.is_empty() {
            break;
        }
        progress.phase(&format!("moving {} partitions", moves.len()));
        let joining = match update_map(etcd, client, |map| Ok(membership::start_moves(map, &moves)))? {
            Some((before, next)) => {
                let_plain_writes_land(&before, progress);
                next
            }
            None => map,
        };
        let (settled, stale) = settle_moves(etcd, client, joining, &moves, rate, progress)?;
        done.moved += settled.moved;
        done.synced += settled.synced;
        sources.extend(stale);
    }
    Ok((done, sources))
}

/// Copies and finishes the moves of `moves` that `map` (written) started: copied from each
/// partition's primary, finished where that is still the primary. A move whose primary
/// changed meanwhile (a failover, primaries spread) is copied again from the new one, at
/// most [`MAX_ROUNDS`] times, then called off, so that no taker is left joining for good.
/// Returns what moved and the memnodes whose copies are stale now.
fn settle_moves(
    etcd: &Etcd,
    client: &Client,
    mut map: ClusterMap,
    moves: &[Move],
    rate: &mut KeyRate,
    progress: &mut dyn Progress,
) -> anyhow::Result<(Moved, BTreeSet<u64>)> {
    let (mut done, mut stale) = (Moved::default(), BTreeSet::new());
    let mut pending = membership::started(&map, moves);
    for _ in 0..MAX_ROUNDS {
        if pending.is_empty() {
            return Ok((done, stale));
        }
        let (copied, synced) = copy_moves(client, &map, &pending, rate, progress)?;
        done.synced += synced;
        let finished = update_map(etcd, client, |map| {
            // Only moves whose partition's primary is the one copied from.
            let ready: Vec<Move> = copied
                .iter()
                .filter(|(m, from)| primary_of(map, m.partition) == Some(*from))
                .map(|(m, _)| *m)
                .collect();
            Ok(membership::finish_moves(map, &ready))
        })?;
        if let Some((before, after)) = finished {
            done.moved += membership::started(&before, &pending).len() - membership::started(&after, &pending).len();
            stale.extend(membership::dropped(&before, &after).into_keys());
        }
        map = etcd.map()?.context("the cluster map is gone")?.0;
        pending = membership::started(&map, &pending);
    }
    if let Some((_, after)) = update_map(etcd, client, |map| Ok(membership::cancel_moves(map, &pending)))? {
        tracing::warn!(
            moves = pending.len(),
            epoch = after.epoch,
            "called off moves whose partitions' primaries kept changing while they were copied"
        );
        stale.extend(pending.iter().map(|m| m.to));
    }
    Ok((done, stale))
}

/// Calls off the moves under way (`membership::moves_under_way`) when no command moving
/// partitions holds a claim: their mover died (or failed) midway, and they would stay
/// joining, every write of their partitions going to the takers too, until a command ran
/// again. Then removes the takers' copies of those partitions. Returns how many moves it
/// called off.
pub fn call_off_abandoned_moves(
    etcd: &Etcd,
    client: &Client,
    rate: &mut KeyRate,
    progress: &mut dyn Progress,
) -> anyhow::Result<usize> {
    let called_off = update_map(etcd, client, |map| {
        // The map first, then the claims: a mover claims before it starts moves, so moves
        // in this map with no claim standing now are a dead mover's.
        let moves = membership::moves_under_way(map);
        if moves.is_empty() || etcd.movers()? > 0 {
            return Ok(None);
        }
        Ok(membership::cancel_moves(map, &moves))
    })?;
    let Some((before, _)) = called_off else { return Ok(0) };
    let moves = membership::moves_under_way(&before);
    let takers: BTreeSet<u64> = moves.iter().map(|m| m.to).collect();
    for to in takers {
        purge(etcd, client, to, rate, progress)?;
    }
    Ok(moves.len())
}

/// This host's name, for people reading a mover's claim in etcd.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map_or_else(|_| "?".into(), |h| h.trim().to_string())
}

/// Drains memnode `node` (each of its partitions copied to the live memnode already joining
/// it or holding fewest, which then takes its place) and takes it out of the map. Clients
/// keep reading and writing throughout; the memnode may be stopped once this returns.
pub fn remove_memnode(
    etcd: &Etcd,
    client: &Client,
    node: u64,
    rate: &mut KeyRate,
    progress: &mut dyn Progress,
) -> anyhow::Result<Moved> {
    let holding = |map: &ClusterMap| map.partitions.iter().filter(|set| set.contains(&node)).count();
    let plan = |map: &ClusterMap, live: &BTreeSet<u64>| match holding(map) {
        0 => Ok(Vec::new()),
        _ => membership::drain(map, node, live).map_err(anyhow::Error::msg),
    };
    let (done, _) = run_moves(etcd, client, &plan, rate, progress)?;
    progress.phase(&format!("taking {node:#x} out of the map"));
    update_map(etcd, client, |map| {
        anyhow::ensure!(
            holding(map) == 0,
            "memnode {node:#x} still holds {} partitions after {MAX_ROUNDS} rounds (the map kept changing): run it again",
            holding(map)
        );
        membership::forget(map, node).map_err(anyhow::Error::msg)
    })?;
    Ok(done)
}

/// Adds registered memnode `node` to the map (every client connects to it as it installs
/// that map), moves partitions to it until the live memnodes hold about as many each,
/// removes the stale copies the memnodes they came from keep (and any the added one kept
/// from before), and spreads primaries. Clients keep reading and writing throughout.
pub fn add_memnode(
    etcd: &Etcd,
    client: &Client,
    node: u64,
    rate: &mut KeyRate,
    progress: &mut dyn Progress,
) -> anyhow::Result<Moved> {
    let info = etcd
        .memnodes()?
        .into_iter()
        .find(|m| m.node_id == node)
        .with_context(|| format!("memnode {node:#x} is not registered (start it with --etcd)"))?;
    progress.phase(&format!("adding {node:#x} to the map"));
    update_map(etcd, client, |map| membership::add(map, &info).map_err(anyhow::Error::msg))?;
    let plan = |map: &ClusterMap, live: &BTreeSet<u64>| Ok(membership::spread(map, live));
    let (done, mut sources) = run_moves(etcd, client, &plan, rate, progress)?;
    // The memnodes partitions left keep stale copies, and so may the one added (a memnode
    // removed earlier and added again keeps what it held).
    sources.insert(node);
    for from in sources {
        purge(etcd, client, from, rate, progress)?;
    }
    balance(etcd, client)?;
    Ok(done)
}

/// Copies each started move's partition to its taker, takers one after another. Returns
/// each move with the primary it was copied from, and the keys copied.
fn copy_moves(
    client: &Client,
    map: &ClusterMap,
    moves: &[Move],
    rate: &mut KeyRate,
    progress: &mut dyn Progress,
) -> anyhow::Result<(Vec<(Move, u64)>, u64)> {
    let takers: BTreeSet<u64> = moves.iter().map(|m| m.to).collect();
    let (mut copied, mut synced) = (Vec::new(), 0);
    for to in takers {
        let partitions: Vec<usize> = moves.iter().filter(|m| m.to == to).map(|m| m.partition).collect();
        let (counts, from) = copy_partitions(client, map, to, &partitions, rate, &mut |n| progress.keys(n))?;
        synced += counts.synced;
        for (p, primary) in from {
            let m = *moves.iter().find(|m| m.partition == p && m.to == to).expect("copied what was asked");
            copied.push((m, primary));
        }
    }
    Ok((copied, synced))
}

/// What a change of R did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Resized {
    /// The map's R before.
    pub from: u8,
    /// Copies made (R raised) or stale copies removed (R lowered).
    pub keys: u64,
}

/// Sets the replication factor to `replicas`: lowering it drops each partition's last
/// backups and removes their copies; raising it copies each partition onto live memnodes
/// that do not hold it until every set has R (or no memnode is left to take one: an error
/// saying how many are short; the healer finishes once memnodes are added).
pub fn set_replicas(
    etcd: &Etcd,
    client: &Client,
    replicas: u8,
    rate: &mut KeyRate,
    progress: &mut dyn Progress,
) -> anyhow::Result<Resized> {
    let written = update_map(etcd, client, |map| membership::set_replicas(map, replicas).map_err(anyhow::Error::msg))?;
    let (from, lowered) = match &written {
        Some((before, after)) => (before.replicas, after.replicas < before.replicas),
        None => (replicas, false),
    };
    let mut done = Resized { from, keys: 0 };
    if let Some((before, _)) = written.as_ref().filter(|_| !lowered) {
        let_plain_writes_land(before, progress);
    }
    if lowered {
        let (before, after) = written.as_ref().expect("lowered: a map was written");
        for node in membership::dropped(before, after).into_keys() {
            done.keys += purge(etcd, client, node, rate, progress)?;
        }
        return Ok(done);
    }
    for _ in 0..MAX_ROUNDS * 4 {
        let (map, _) = etcd.map()?.context("the cluster map is gone")?;
        let Some(node) = next_candidate(&map, &etcd.memnodes()?, true) else { break };
        progress.phase(&format!("copying partitions short of R = {replicas} onto {node:#x}"));
        done.keys += rejoin(etcd, client, node, rate, &mut |n| progress.keys(n))?.synced;
    }
    let (map, _) = etcd.map()?.context("the cluster map is gone")?;
    let short = map.partitions.iter().filter(|set| set.len() < usize::from(map.replicas)).count();
    anyhow::ensure!(
        short == 0,
        "{short} partitions have fewer than R = {} replicas: not enough live memnodes hold none of them \
         (the healer of `racekv cluster manage --heal` fills them as memnodes come)",
        map.replicas
    );
    Ok(done)
}

/// Waits [`PLAIN_WRITES_SETTLE`] when writers by `before`, the map a change replaced,
/// wrote with plain upserts (R = 1) that a copy starting now could miss.
fn let_plain_writes_land(before: &ClusterMap, progress: &mut dyn Progress) {
    if before.replicas == 1 {
        progress.phase(&format!(
            "letting writes by the R = 1 map land before copying ({} s)",
            PLAIN_WRITES_SETTLE.as_secs_f64()
        ));
        std::thread::sleep(PLAIN_WRITES_SETTLE);
    }
}

/// Gives up the partitions that no live memnode holds (a double failure at R = 2, any loss
/// at R = 1): live memnodes take them over empty (`membership::reassign_lost`), so their
/// keys are lost, and clients can write them again. Each taker first drops whatever copies
/// it kept of those partitions (a memnode failed over from one and not yet rejoined keeps
/// its old values), through `direct`, a client of that memnode alone: a client routing by
/// the map cannot start while memnodes it writes to are down. The down memnodes' words are
/// not raised (they cannot be reached; each fenced itself when its lease lapsed); one that
/// comes back rejoins as any failed-over memnode, its old copies replaced. Returns the map
/// written and the partitions given up (None: every partition has a live replica).
pub fn recover_lost(
    etcd: &Etcd,
    direct: &dyn Fn(&racekv_coord::MemnodeInfo) -> anyhow::Result<Client>,
    progress: &mut dyn Progress,
) -> anyhow::Result<Option<(ClusterMap, Vec<usize>)>> {
    for _ in 0..MAX_ROUNDS {
        let (map, revision) = etcd.map()?.context("the cluster has no map yet (`racekv cluster init`)")?;
        let live: BTreeSet<u64> = etcd.memnodes()?.iter().map(|m| m.node_id).collect();
        let Some((next, lost)) = membership::reassign_lost(&map, &live) else { return Ok(None) };
        let takers: BTreeSet<u64> = lost.iter().flat_map(|&p| next.partitions[p].iter().copied()).collect();
        for &node in &takers {
            let info = map.memnode(node).context("a live memnode the map lists")?;
            progress.phase(&format!("removing {node:#x}'s old copies of the lost partitions"));
            drop_partitions(&direct(info)?, &map, &lost, progress)?;
        }
        if etcd.put_map(&next, Some(revision))?.is_some() {
            tracing::warn!(epoch = next.epoch, partitions = ?lost, "lost partitions given to live memnodes, empty");
            return Ok(Some((next, lost)));
        }
    }
    anyhow::bail!("the cluster map kept changing; run it again")
}

/// Deletes the keys of `partitions` (by `map`) from the one memnode `client` reaches (no
/// one writes them there: no map routes them to it yet).
fn drop_partitions(
    client: &Client,
    map: &ClusterMap,
    partitions: &[usize],
    progress: &mut dyn Progress,
) -> anyhow::Result<()> {
    let mut cursor = 0;
    loop {
        let (next, page) = client.scan(cursor, 256)?;
        for key in page {
            if partitions.contains(&map.partition_of(racekv_client::ring::key_hash(&key))) {
                client.delete(&key)?;
                progress.keys(1);
            }
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// Removes memnode `node`'s copies of keys of partitions it is in no write set of (after a
/// change took partitions from it), by the newest map, again while the map changes under
/// it. A memnode not registered is skipped (a rejoin cleans what it joins). Returns the
/// copies removed.
pub fn purge(
    etcd: &Etcd,
    client: &Client,
    node: u64,
    rate: &mut KeyRate,
    progress: &mut dyn Progress,
) -> anyhow::Result<u64> {
    if !etcd.memnodes()?.iter().any(|m| m.node_id == node) {
        return Ok(0);
    }
    let mut removed = 0;
    for _ in 0..MAX_ROUNDS {
        let (map, _) = etcd.map()?.context("the cluster map is gone")?;
        if map.memnode(node).is_none() {
            return Ok(removed);
        }
        progress.phase(&format!("removing stale copies from {node:#x}"));
        let sets = map.write_sets();
        let stale = |key: &[u8]| !sets[map.partition_of(racekv_client::ring::key_hash(key))].contains(&node);
        let purged = client.purge(map.epoch, node, &stale, &mut |n| {
            rate.handled(n);
            progress.keys(n);
        })?;
        removed += purged.removed;
        if !purged.interrupted {
            return Ok(removed);
        }
    }
    anyhow::bail!("the map kept changing while stale copies were removed from {node:#x}: run it again")
}

/// Spreads primaries over each partition's replicas (`membership::balance_primaries`);
/// the map's epoch after, or None when they were spread.
pub fn balance(etcd: &Etcd, client: &Client) -> anyhow::Result<Option<u64>> {
    Ok(update_map(etcd, client, |map| Ok(membership::balance_primaries(map)))?.map(|(_, next)| next.epoch))
}

/// Turns the snapshot protocol for replicated writes on or off (`ClusterMap::snapshot_writes`):
/// a new map epoch, nothing moved. Returns the new epoch, or None when it was so already.
pub fn set_snapshot_writes(etcd: &Etcd, client: &Client, on: bool) -> anyhow::Result<Option<u64>> {
    let done = update_map(etcd, client, |map| {
        Ok((map.snapshot_writes != on).then(|| ClusterMap { epoch: map.epoch + 1, snapshot_writes: on, ..map.clone() }))
    })?;
    Ok(done.map(|(_, next)| next.epoch))
}

/// Lists a memnode that came back empty where a down, failed-over memnode was in that one's
/// stead (`membership::replacement`); the healer's rejoin then fills it. Returns (the
/// memnode replaced, the one replacing it), or None when no registered memnode is one.
pub fn replace_lost(etcd: &Etcd, client: &Client) -> anyhow::Result<Option<(u64, u64)>> {
    let registered = etcd.memnodes()?;
    let done = update_map(etcd, client, |map| {
        let Some((old, new)) = membership::replacement(map, &registered) else { return Ok(None) };
        membership::replace(map, old, &new).map(Some).map_err(anyhow::Error::msg)
    })?;
    Ok(done.map(|(before, after)| {
        let gone = before.memnodes.iter().find(|m| after.memnode(m.node_id).is_none());
        let came = after.memnodes.iter().find(|m| before.memnode(m.node_id).is_none());
        (gone.expect("one unlisted").node_id, came.expect("one listed").node_id)
    }))
}
