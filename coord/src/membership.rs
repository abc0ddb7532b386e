//! Live membership (issue 17, item 4): the map changes that move partitions between
//! memnodes, change R, spread primaries and let a memnode leave. Each is a pure function
//! from one map to the next (one epoch later); whoever writes it does so by
//! compare-and-swap, and copies keys between the steps (`src/membership.rs`).
//!
//! A move of partition `p` from memnode `from` to memnode `to` has two maps: in the first
//! `to` joins `p` (written to like a backup, never read: [`start_moves`]); once it is
//! caught up, the second puts `to` in `from`'s place in the replica set, primary if `from`
//! was ([`finish_moves`]). Where a primary changes, the memnodes involved must serve the
//! second map (their epoch words raised) before it is written: see [`fenced`].

use std::collections::{BTreeMap, BTreeSet};

use crate::map::{MAX_MEMNODES, MAX_REPLICAS};
use crate::{ClusterMap, MemnodeInfo};

/// Partition `partition` moving from memnode `from` to memnode `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Move {
    /// The partition.
    pub partition: usize,
    /// The memnode leaving its replica set.
    pub from: u64,
    /// The memnode taking `from`'s place.
    pub to: u64,
}

/// Partitions each memnode holds (as primary or backup).
fn held(map: &ClusterMap) -> BTreeMap<u64, usize> {
    let mut held: BTreeMap<u64, usize> = map.memnodes.iter().map(|m| (m.node_id, 0)).collect();
    for id in map.partitions.iter().flatten() {
        *held.entry(*id).or_default() += 1;
    }
    held
}

/// The moves that take every partition off memnode `node`, each to the memnode of `live`
/// (listed in the map, not `node`) already joining it, else the one holding the fewest
/// partitions, counting the moves planned before it, that neither holds nor joins it.
/// Refused, saying why, when `node` is not listed or some partition has no memnode to go
/// to.
pub fn drain(map: &ClusterMap, node: u64, live: &BTreeSet<u64>) -> Result<Vec<Move>, String> {
    if map.memnode(node).is_none() {
        return Err(format!("memnode {node:#x} is not in the cluster map"));
    }
    let mut load = held(map);
    load.retain(|id, _| *id != node && live.contains(id));
    let mut moves = Vec::new();
    for (p, set) in map.partitions.iter().enumerate() {
        if !set.contains(&node) {
            continue;
        }
        // A live memnode joining it already (a move an earlier run left half done) takes it;
        // otherwise the live one holding fewest that neither holds nor joins it.
        let joining = map.joining_of(p).iter().copied().find(|id| load.contains_key(id));
        let busy = |id: &u64| set.contains(id) || map.joining_of(p).contains(id);
        let fewest = || load.iter().filter(|(id, _)| !busy(id)).min_by_key(|&(id, n)| (*n, *id)).map(|(id, _)| *id);
        let to = joining.or_else(fewest);
        let Some(to) = to else {
            return Err(format!(
                "partition {p} has no live memnode to move to (its replicas {set:x?} are every other one): \
                 add a memnode or lower R first (`racekv cluster set-replicas`)"
            ));
        };
        *load.get_mut(&to).expect("chosen from the load") += 1;
        moves.push(Move { partition: p, from: node, to });
    }
    Ok(moves)
}

/// The map with memnode `info` listed (holding nothing yet: [`spread`] plans the moves that
/// give it partitions), one epoch later; None when it is listed already. Refused when it is
/// listed at other endpoints, or the map has [`MAX_MEMNODES`] memnodes.
pub fn add(map: &ClusterMap, info: &MemnodeInfo) -> Result<Option<ClusterMap>, String> {
    if let Some(listed) = map.memnode(info.node_id) {
        if listed.endpoints != info.endpoints {
            return Err(format!(
                "memnode {:#x} is listed at {:?}, and registered at {:?}: start it at the listed endpoints",
                info.node_id, listed.endpoints, info.endpoints
            ));
        }
        return Ok(None);
    }
    if map.memnodes.len() >= MAX_MEMNODES {
        return Err(format!("the map lists {MAX_MEMNODES} memnodes already"));
    }
    let mut next = map.clone();
    let at = next.memnodes.partition_point(|m| m.node_id < info.node_id);
    next.memnodes.insert(at, info.clone());
    next.epoch += 1;
    next.check().map_err(|e| e.to_string())?;
    Ok(Some(next))
}

/// The moves that even out how many partitions the memnodes of `live` (listed) hold: from
/// the one holding most to the one holding fewest, while they differ by two or more, each
/// move of a partition the first holds and the second neither holds nor joins (one move per
/// partition). After a memnode is added, this gives it its share.
pub fn spread(map: &ClusterMap, live: &BTreeSet<u64>) -> Vec<Move> {
    let mut load = held(map);
    load.retain(|id, _| live.contains(id));
    let mut moves: Vec<Move> = Vec::new();
    for _ in 0..map.partitions.len() * usize::from(MAX_REPLICAS) {
        let (Some((&most, &high)), Some((&least, &low))) =
            (load.iter().max_by_key(|&(id, n)| (*n, *id)), load.iter().min_by_key(|&(id, n)| (*n, *id)))
        else {
            break;
        };
        if high < low + 2 {
            break;
        }
        let free = |p: usize| moves.iter().all(|m| m.partition != p);
        let pick = (0..map.partitions.len()).find(|&p| {
            let set = &map.partitions[p];
            free(p) && set.contains(&most) && !set.contains(&least) && !map.joining_of(p).contains(&least)
        });
        let Some(partition) = pick else { break };
        moves.push(Move { partition, from: most, to: least });
        *load.get_mut(&most).expect("counted") -= 1;
        *load.get_mut(&least).expect("counted") += 1;
    }
    moves
}

/// The map with each move's `to` joining its partition, one epoch later; None when no move
/// can start (its `from` left the set, its `to` holds or joins it already, or its joining
/// list is full).
pub fn start_moves(map: &ClusterMap, moves: &[Move]) -> Option<ClusterMap> {
    let mut next = map.clone();
    if next.joining.is_empty() {
        next.joining = vec![Vec::new(); next.partitions.len()];
    }
    let mut changed = false;
    for m in moves {
        let (Some(set), Some(joining)) = (next.partitions.get(m.partition), next.joining.get_mut(m.partition)) else {
            continue;
        };
        let room = joining.len() < usize::from(next.replicas);
        if room && set.contains(&m.from) && !set.contains(&m.to) && !joining.contains(&m.to) {
            joining.push(m.to);
            changed = true;
        }
    }
    if !changed {
        return None;
    }
    next.epoch += 1;
    debug_assert!(next.check().is_ok(), "a joiner per move within R keeps the map valid");
    Some(next)
}

/// The moves of `moves` that `map` has started and not finished: `from` in the set, `to`
/// joining.
pub fn started(map: &ClusterMap, moves: &[Move]) -> Vec<Move> {
    moves
        .iter()
        .filter(|m| {
            map.partitions.get(m.partition).is_some_and(|set| set.contains(&m.from))
                && map.joining_of(m.partition).contains(&m.to)
        })
        .copied()
        .collect()
}

/// The moves `map` has under way: each memnode joining a partition whose replica set is
/// full (a rejoin joins only sets short of R, `rejoin.rs`). Which member it would replace
/// the map does not say: `from` is the set's primary, enough to call the move off
/// ([`cancel_moves`]), not to finish it.
pub fn moves_under_way(map: &ClusterMap) -> Vec<Move> {
    let full = |p: usize| map.partitions[p].len() >= usize::from(map.replicas);
    (0..map.partitions.len())
        .filter(|&p| full(p))
        .flat_map(|p| map.joining_of(p).iter().map(move |&to| Move { partition: p, from: map.partitions[p][0], to }))
        .collect()
}

/// The map with each started move of `moves` done: `to` in `from`'s place in the replica
/// set (primary if `from` was), no longer joining; one epoch later. None when none is
/// started.
pub fn finish_moves(map: &ClusterMap, moves: &[Move]) -> Option<ClusterMap> {
    end_moves(map, moves, |set, m| {
        let at = set.iter().position(|&id| id == m.from).expect("a started move's from is in the set");
        set[at] = m.to;
    })
}

/// The map with each started move of `moves` called off: `to` no longer joining its
/// partition (its copies of the partition's keys are stale now: purge them), the replica
/// set unchanged; one epoch later. None when none is started. A move whose partition's
/// primary kept changing while it was copied ends this way rather than joining for good.
pub fn cancel_moves(map: &ClusterMap, moves: &[Move]) -> Option<ClusterMap> {
    end_moves(map, moves, |_, _| {})
}

/// The map with each started move of `moves` ended: its replica set edited by `edit`, `to`
/// no longer joining; one epoch later. None when none is started.
fn end_moves(map: &ClusterMap, moves: &[Move], mut edit: impl FnMut(&mut Vec<u64>, &Move)) -> Option<ClusterMap> {
    let ended = started(map, moves);
    if ended.is_empty() {
        return None;
    }
    let mut next = map.clone();
    for m in ended {
        edit(&mut next.partitions[m.partition], &m);
        next.joining[m.partition].retain(|&id| id != m.to);
    }
    next.normalize_joining();
    next.epoch += 1;
    debug_assert!(next.check().is_ok(), "ending started moves keeps the map valid");
    Some(next)
}

/// The map without memnode `node` listed, one epoch later (it stops joining anything);
/// None when it is not listed. Refused while it holds a partition or is the only memnode.
pub fn forget(map: &ClusterMap, node: u64) -> Result<Option<ClusterMap>, String> {
    if map.memnode(node).is_none() {
        return Ok(None);
    }
    let holding = map.partitions.iter().filter(|set| set.contains(&node)).count();
    if holding > 0 {
        return Err(format!("memnode {node:#x} still holds {holding} partitions: move them first"));
    }
    if map.memnodes.len() == 1 {
        return Err(format!("memnode {node:#x} is the cluster's only memnode"));
    }
    let mut next = map.clone();
    next.memnodes.retain(|m| m.node_id != node);
    next.joining.iter_mut().for_each(|joining| joining.retain(|&id| id != node));
    next.normalize_joining();
    next.epoch += 1;
    debug_assert!(next.check().is_ok(), "a memnode holding nothing leaves a valid map");
    Ok(Some(next))
}

/// A memnode that lost its data and came back empty: a registered memnode `new` the map
/// does not list, at an endpoint of a listed memnode `old` that is not registered (its lease
/// is gone: it is down) and holds no partition (failed over: its data is on its sets'
/// other replicas). Returns (`old`, `new`); None when no registered memnode is one.
///
/// An endpoint is served by one process at a time, so `new` took `old`'s place (a disk
/// replaced, a pod whose volume was lost): see [`replace`]. A down `old` that still holds
/// partitions (the only replica at R = 1) is never replaced here: its data would be lost.
pub fn replacement(map: &ClusterMap, registered: &[MemnodeInfo]) -> Option<(u64, MemnodeInfo)> {
    let is_registered = |id: u64| registered.iter().any(|m| m.node_id == id);
    let holds = |id: u64| map.partitions.iter().any(|set| set.contains(&id));
    registered.iter().filter(|new| map.memnode(new.node_id).is_none()).find_map(|new| {
        let old = map.memnodes.iter().find(|old| {
            old.endpoints.iter().any(|e| new.endpoints.contains(e))
                && !is_registered(old.node_id)
                && !holds(old.node_id)
        })?;
        Some((old.node_id, new.clone()))
    })
}

/// The map with memnode `old` (holding nothing) unlisted and `new` listed in its stead,
/// holding nothing yet (the healer's rejoin fills it), one epoch later. Refused when `old`
/// holds a partition or `new` is listed already.
pub fn replace(map: &ClusterMap, old: u64, new: &MemnodeInfo) -> Result<ClusterMap, String> {
    if map.memnode(new.node_id).is_some() {
        return Err(format!("memnode {:#x} is listed already", new.node_id));
    }
    let forgotten = forget(map, old)?.ok_or_else(|| format!("memnode {old:#x} is not in the cluster map"))?;
    let mut next = add(&forgotten, new)?.expect("not listed: checked above");
    next.epoch = map.epoch + 1; // one change, one epoch
    Ok(next)
}

/// The map with replication factor `replicas`, one epoch later; None when it is R already.
/// Lowering R drops each set's last backups and joiners beyond it (their copies become
/// stale: purge them); raising it leaves the sets short until memnodes join them (the
/// healer, or `racekv cluster set-replicas`, copies).
pub fn set_replicas(map: &ClusterMap, replicas: u8) -> Result<Option<ClusterMap>, String> {
    if !(1..=MAX_REPLICAS).contains(&replicas) {
        return Err(format!("replication factor {replicas} (1 to {MAX_REPLICAS})"));
    }
    if replicas == map.replicas {
        return Ok(None);
    }
    let mut next = map.clone();
    next.replicas = replicas;
    let r = usize::from(replicas);
    next.partitions.iter_mut().for_each(|set| set.truncate(r));
    next.joining.iter_mut().for_each(|joining| joining.truncate(r));
    next.normalize_joining();
    next.epoch += 1;
    debug_assert!(next.check().is_ok(), "sets cut to R keep the map valid");
    Ok(Some(next))
}

/// The map with primaries spread over each set's replicas so that no memnode is primary of
/// two or more partitions more than another replica of one of them; one epoch later. None
/// when they are spread already. (After a failover the survivor is primary of everything
/// it kept; a rejoined memnode comes back as a backup.)
pub fn balance_primaries(map: &ClusterMap) -> Option<ClusterMap> {
    let mut next = map.clone();
    let mut primaries: BTreeMap<u64, usize> = BTreeMap::new();
    for set in &next.partitions {
        *primaries.entry(set[0]).or_default() += 1;
    }
    let mut changed = false;
    // Each swap lowers the sum of squared primary counts, so this ends; bounded anyway.
    for _ in 0..next.partitions.len() * usize::from(MAX_REPLICAS) {
        let swap = next.partitions.iter().enumerate().find_map(|(p, set)| {
            let busiest = primaries[&set[0]];
            let idlest = (1..set.len()).min_by_key(|&i| primaries.get(&set[i]).copied().unwrap_or(0))?;
            (primaries.get(&set[idlest]).copied().unwrap_or(0) + 1 < busiest).then_some((p, idlest))
        });
        let Some((p, i)) = swap else { break };
        let set = &mut next.partitions[p];
        *primaries.get_mut(&set[0]).expect("counted") -= 1;
        *primaries.entry(set[i]).or_default() += 1;
        set.swap(0, i);
        changed = true;
    }
    if !changed {
        return None;
    }
    next.epoch += 1;
    debug_assert!(next.check().is_ok(), "reordering a set keeps the map valid");
    Some(next)
}

/// The memnodes whose epoch word must be raised to `next`'s epoch before `next` is written:
/// every memnode of the write set, in either map, of a partition whose primary changes.
/// Then a reader routing by `map` that reads the old primary after that finds the word
/// newer and reads again by `next`, and a commit routing by `map` that locks a replica
/// after that sees the newer word before it decides and aborts (`racekv_client`'s
/// `txn.rs`); its locks placed before come before any lock by `next`.
pub fn fenced(map: &ClusterMap, next: &ClusterMap) -> Vec<u64> {
    let (before, after) = (map.write_sets(), next.write_sets());
    let mut ids: BTreeSet<u64> = BTreeSet::new();
    for (old, new) in before.iter().zip(&after) {
        if old[0] != new[0] {
            ids.extend(old.iter().chain(new));
        }
    }
    ids.into_iter().collect()
}

/// The map after giving up the partitions none of whose replicas is among `live` (a double
/// failure at R = 2): each gets a new replica set of up to R live memnodes, those holding
/// fewest partitions (counting those given before it; ties by node id), the one of them
/// primary of fewest its primary, no joiners; one epoch on. Their keys are lost: the new sets start empty.
/// Returns the new map and the partitions given up, or None when every partition has a
/// live replica (or no memnode is live).
pub fn reassign_lost(map: &ClusterMap, live: &BTreeSet<u64>) -> Option<(ClusterMap, Vec<usize>)> {
    let lost: Vec<usize> =
        (0..map.partitions.len()).filter(|&p| !map.partitions[p].iter().any(|id| live.contains(id))).collect();
    let mut held: BTreeMap<u64, usize> = held(map).into_iter().filter(|(id, _)| live.contains(id)).collect();
    if lost.is_empty() || held.is_empty() {
        return None;
    }
    let mut next = map.clone();
    if next.joining.is_empty() {
        next.joining = vec![Vec::new(); next.partitions.len()];
    }
    let mut primaries: BTreeMap<u64, usize> = BTreeMap::new();
    for set in &map.partitions {
        *primaries.entry(set[0]).or_default() += 1;
    }
    for &p in &lost {
        let mut by_load: Vec<(usize, u64)> = held.iter().map(|(&id, &n)| (n, id)).collect();
        by_load.sort_unstable();
        let mut set: Vec<u64> = by_load.iter().take(usize::from(map.replicas)).map(|&(_, id)| id).collect();
        set.sort_by_key(|id| (primaries.get(id).copied().unwrap_or(0), *id));
        for id in &set {
            *held.get_mut(id).expect("a live memnode") += 1;
        }
        *primaries.entry(set[0]).or_default() += 1;
        next.partitions[p] = set;
        next.joining[p].clear();
    }
    next.normalize_joining();
    next.epoch += 1;
    debug_assert!(next.check().is_ok(), "lost partitions on live memnodes make a valid map");
    Some((next, lost))
}

/// Per memnode, the partitions it is in the write set of in `map` but not in `next`: its
/// copies of their keys are stale once `next` is served (purge them).
pub fn dropped(map: &ClusterMap, next: &ClusterMap) -> BTreeMap<u64, Vec<usize>> {
    let (before, after) = (map.write_sets(), next.write_sets());
    let mut dropped: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (p, (old, new)) in before.iter().zip(&after).enumerate() {
        for id in old.iter().filter(|id| !new.contains(id)) {
            dropped.entry(*id).or_default().push(p);
        }
    }
    dropped
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map::sample as map;
    use proptest::prelude::*;

    fn primaries(map: &ClusterMap) -> BTreeMap<u64, usize> {
        let mut n = BTreeMap::new();
        for set in &map.partitions {
            *n.entry(set[0]).or_insert(0) += 1;
        }
        n
    }

    proptest! {
        /// Partitions with no live replica get R (or all) live memnodes, spread; every
        /// other partition keeps its set; the map stays valid, one epoch on.
        #[test]
        fn lost_partitions_go_to_live_memnodes_and_no_other_changes(
            n in 2usize..8,
            replicas in 1u8..=5,
            down_mask in any::<u8>(),
        ) {
            let ids: Vec<u64> = (1..=n as u64).collect();
            let before = map(&ids, replicas);
            let live: BTreeSet<u64> = ids.iter().copied().filter(|id| down_mask & (1 << (id % 8)) == 0).collect();
            let lost_before = crate::failover::unavailable(&before, &live);
            let Some((after, lost)) = reassign_lost(&before, &live) else {
                prop_assert!(lost_before == 0 || live.is_empty());
                return Ok(());
            };
            prop_assert!(after.check().is_ok());
            prop_assert_eq!(after.epoch, before.epoch + 1);
            prop_assert_eq!(lost.len(), lost_before);
            prop_assert_eq!(crate::failover::unavailable(&after, &live), 0);
            for p in 0..before.partitions.len() {
                if lost.contains(&p) {
                    let set = &after.partitions[p];
                    prop_assert_eq!(set.len(), usize::from(replicas).min(live.len()));
                    prop_assert!(set.iter().all(|id| live.contains(id)));
                } else {
                    prop_assert_eq!(&after.partitions[p], &before.partitions[p]);
                }
            }
        }
    }

    proptest! {
        /// Draining a memnode and forgetting it: every step is a valid map one epoch on,
        /// no partition ever has fewer replicas than before, the drained memnode ends in
        /// no set and off the list, and each partition it was primary of gets the memnode
        /// that took its place as primary.
        #[test]
        fn a_drained_memnode_leaves_every_set_whole(n in 2usize..8, replicas in 1u8..=5, pick in any::<u8>()) {
            let ids: Vec<u64> = (1..=n as u64).collect();
            let before = map(&ids, replicas);
            let node = ids[usize::from(pick) % n];
            let live: BTreeSet<u64> = ids.iter().copied().collect();
            let moves = match drain(&before, node, &live) {
                Ok(moves) => moves,
                Err(e) => {
                    // Only when some set already holds every other memnode.
                    prop_assert!(usize::from(replicas) >= n, "{}", e);
                    return Ok(());
                }
            };
            let joining = start_moves(&before, &moves).expect("each move starts");
            prop_assert!(joining.check().is_ok());
            prop_assert_eq!(&joining.partitions, &before.partitions, "sets unchanged while joining");
            prop_assert_eq!(started(&joining, &moves).len(), moves.len());
            let moved = finish_moves(&joining, &moves).expect("each move finishes");
            prop_assert!(moved.check().is_ok());
            prop_assert!(moved.joining.is_empty());
            for m in &moves {
                let (old, new) = (&before.partitions[m.partition], &moved.partitions[m.partition]);
                prop_assert_eq!(old.len(), new.len());
                prop_assert!(!new.contains(&node));
                prop_assert_eq!(old[0] == node, new[0] == m.to, "the taker is primary where the leaver was");
            }
            prop_assert_eq!(fenced(&before, &moved).contains(&node), before.partitions.iter().any(|s| s[0] == node));
            prop_assert_eq!(dropped(&joining, &moved).get(&node).map(Vec::len), Some(moves.len()));
            let gone = forget(&moved, node).unwrap().unwrap();
            prop_assert!(gone.check().is_ok() && gone.memnode(node).is_none());
            prop_assert_eq!(gone.epoch, before.epoch + 3);
        }

        /// Lowering R cuts every set to R, keeping the primary; raising it changes no set.
        #[test]
        fn changing_r_keeps_primaries(n in 1usize..8, from in 1u8..=5, to in 1u8..=5) {
            let ids: Vec<u64> = (1..=n as u64).collect();
            let before = map(&ids, from);
            let Some(after) = set_replicas(&before, to).unwrap() else {
                prop_assert_eq!(from, to);
                return Ok(());
            };
            prop_assert!(after.check().is_ok());
            for (old, new) in before.partitions.iter().zip(&after.partitions) {
                prop_assert_eq!(new.as_slice(), &old[..old.len().min(usize::from(to))]);
            }
            prop_assert!(fenced(&before, &after).is_empty());
            let dropped_copies: usize = dropped(&before, &after).values().map(Vec::len).sum();
            let lost: usize = before.partitions.iter().zip(&after.partitions).map(|(o, n)| o.len() - n.len()).sum();
            prop_assert_eq!(dropped_copies, lost);
        }

        /// After balancing, no partition's primary is primary of two or more partitions
        /// more than another of its replicas; the sets hold the same memnodes.
        #[test]
        fn balanced_primaries_are_spread(n in 2usize..7, replicas in 2u8..=5, down in any::<u8>()) {
            let ids: Vec<u64> = (1..=n as u64).collect();
            let whole = map(&ids, replicas);
            // A failover then a rejoin: the returning memnode is a backup everywhere.
            let node = ids[usize::from(down) % n];
            let Some(skewed) = crate::failover::without(&whole, &BTreeSet::from([node])) else { return Ok(()) };
            let left = crate::rejoin::joined_by(&crate::rejoin::start_joining(&skewed, node).unwrap(), node);
            let back = crate::rejoin::finish_joining(&crate::rejoin::start_joining(&skewed, node).unwrap(), node, &left).unwrap();
            let balanced = balance_primaries(&back).unwrap_or_else(|| back.clone());
            prop_assert!(balanced.check().is_ok());
            let counts = primaries(&balanced);
            for (old, new) in back.partitions.iter().zip(&balanced.partitions) {
                prop_assert_eq!(old.iter().collect::<BTreeSet<_>>(), new.iter().collect::<BTreeSet<_>>());
                for id in &new[1..] {
                    prop_assert!(counts[&new[0]] <= counts.get(id).copied().unwrap_or(0) + 1);
                }
            }
            prop_assert!(counts.get(&node).copied().unwrap_or(0) > 0, "the rejoined memnode is primary again");
            prop_assert!(balance_primaries(&balanced).is_none(), "balancing twice changes nothing");
        }
    }

    proptest! {
        /// A memnode added to a map gets its share: after the spread's moves every live
        /// memnode holds within one partition of every other, no partition loses a replica,
        /// and the primaries stay spread after balancing.
        #[test]
        fn an_added_memnode_gets_its_share(n in 1usize..7, replicas in 1u8..=5) {
            let ids: Vec<u64> = (1..=n as u64).collect();
            let before = map(&ids, replicas);
            let new = MemnodeInfo { node_id: 100, endpoints: vec!["tcp:127.0.0.1:7100".into()], region_bytes: 1 << 20 };
            let added = add(&before, &new).unwrap().unwrap();
            prop_assert!(added.check().is_ok() && added.memnode(100).is_some());
            prop_assert!(add(&added, &new).unwrap().is_none(), "adding twice changes nothing");
            let live: BTreeSet<u64> = added.memnodes.iter().map(|m| m.node_id).collect();
            let moves = spread(&added, &live);
            let moved = match start_moves(&added, &moves) {
                Some(joining) => finish_moves(&joining, &moves).unwrap(),
                None => added.clone(),
            };
            prop_assert!(moved.check().is_ok());
            let load = held(&moved);
            let (lo, hi) = (load.values().min().unwrap(), load.values().max().unwrap());
            prop_assert!(hi - lo <= 1, "partitions held from {} to {}", lo, hi);
            for (old, new) in added.partitions.iter().zip(&moved.partitions) {
                prop_assert_eq!(old.len(), new.len());
            }
            prop_assert!(spread(&moved, &live).is_empty(), "spread twice changes nothing");
        }

        /// Moves called off leave the replica sets as they were and nobody joining; a
        /// move called off or finished cannot be called off again.
        #[test]
        fn cancelled_moves_leave_the_sets_and_no_joiner(n in 1usize..7, replicas in 1u8..=5) {
            let ids: Vec<u64> = (1..=n as u64).collect();
            let new = MemnodeInfo { node_id: 100, endpoints: vec!["tcp:127.0.0.1:7100".into()], region_bytes: 1 << 20 };
            let added = add(&map(&ids, replicas), &new).unwrap().unwrap();
            let live: BTreeSet<u64> = added.memnodes.iter().map(|m| m.node_id).collect();
            let moves = spread(&added, &live);
            let Some(joining) = start_moves(&added, &moves) else { return Ok(()) };
            let cancelled = cancel_moves(&joining, &moves).unwrap();
            prop_assert!(cancelled.check().is_ok());
            prop_assert_eq!(cancelled.epoch, joining.epoch + 1);
            prop_assert_eq!(&cancelled.partitions, &added.partitions);
            prop_assert!(cancelled.joining.is_empty());
            prop_assert!(cancel_moves(&cancelled, &moves).is_none());
            prop_assert!(cancel_moves(&finish_moves(&joining, &moves).unwrap(), &moves).is_none());
        }
    }

    #[test]
    fn a_memnode_back_empty_at_a_down_memnodes_address_replaces_it_once_failed_over() {
        let whole = map(&[1, 2, 3], 2);
        let fresh = MemnodeInfo { node_id: 9, ..whole.memnodes[2].clone() };
        let live = |ids: &[u64]| -> Vec<MemnodeInfo> {
            let mut out: Vec<MemnodeInfo> =
                whole.memnodes.iter().filter(|m| ids.contains(&m.node_id)).cloned().collect();
            out.push(fresh.clone());
            out
        };
        // 3 still registered (its lease not yet expired), or still holding partitions: no.
        assert_eq!(replacement(&whole, &live(&[1, 2, 3])), None);
        assert_eq!(replacement(&whole, &live(&[1, 2])), None, "3 holds partitions: failover first");
        let failed_over = crate::failover::without(&whole, &BTreeSet::from([3])).unwrap();
        let (old, new) = replacement(&failed_over, &live(&[1, 2])).unwrap();
        assert_eq!((old, new.node_id), (3, 9));
        let next = replace(&failed_over, old, &new).unwrap();
        assert_eq!(next.epoch, failed_over.epoch + 1);
        assert!(next.check().is_ok());
        assert_eq!(next.partitions, failed_over.partitions, "the new memnode holds nothing yet");
        assert!(next.memnode(3).is_none() && next.memnode(9).is_some());
        assert_eq!(replacement(&next, &live(&[1, 2])), None, "listed now");
        // A registered memnode elsewhere replaces nobody; R = 1's only replica is never replaced.
        let elsewhere = MemnodeInfo { endpoints: vec!["tcp:10.0.0.9:1".into()], ..fresh.clone() };
        assert_eq!(replacement(&failed_over, &[whole.memnodes[0].clone(), elsewhere]), None);
        let single = map(&[1, 2, 3], 1);
        assert_eq!(replacement(&single, &live(&[1, 2])), None);
        assert!(replace(&whole, 3, &fresh).unwrap_err().contains("still holds"));
        assert!(replace(&failed_over, 3, &whole.memnodes[0]).unwrap_err().contains("listed already"));
    }

    #[test]
    fn a_drain_with_nowhere_to_go_and_bad_factors_are_refused() {
        let full = map(&[1, 2], 2);
        let e = drain(&full, 1, &BTreeSet::from([1, 2])).unwrap_err();
        assert!(e.contains("no live memnode to move to"), "{e}");
        assert!(drain(&full, 9, &BTreeSet::from([1, 2])).unwrap_err().contains("not in the cluster map"));
        assert!(forget(&full, 1).unwrap_err().contains("still holds"));
        assert!(set_replicas(&full, 0).is_err() && set_replicas(&full, 6).is_err());
        let elsewhere = MemnodeInfo { endpoints: vec!["tcp:10.0.0.1:1".into()], ..full.memnodes[0].clone() };
        assert!(add(&full, &elsewhere).unwrap_err().contains("start it at the listed endpoints"));
        assert!(set_replicas(&full, 2).unwrap().is_none());
        // A down memnode takes nothing.
        let three = map(&[1, 2, 3], 1);
        let moves = drain(&three, 1, &BTreeSet::from([1, 2])).unwrap();
        assert!(moves.iter().all(|m| m.to == 2));
        // A drain run again after one that started its moves and stopped keeps their takers
        // (a second joiner would not fit at R = 1).
        let all = BTreeSet::from([1, 2, 3]);
        let first = drain(&three, 1, &all).unwrap();
        let half_done = start_moves(&three, &first).unwrap();
        assert_eq!(drain(&half_done, 1, &all).unwrap(), first);
        assert!(start_moves(&half_done, &first).is_none());
        assert_eq!(started(&half_done, &first).len(), first.len());
    }
}
