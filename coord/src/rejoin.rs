//! The map changes that restore R (issue 17: rejoin and re-replication). A memnode that is
//! listed and registered joins every partition short of R that it does not hold
//! ([`start_joining`]: written to like a backup, never read from or promoted); once it has
//! caught up on a partition (`racekv_client`'s `catchup.rs`) it becomes that partition's
//! last replica ([`finish_joining`]). Each change is one epoch, written by compare-and-swap.

use crate::ClusterMap;

/// The map with `node` joining every partition that has fewer than R replicas and joiners
/// and does not name it, one epoch later; None when there is none (or `node` is not listed).
pub fn start_joining(map: &ClusterMap, node: u64) -> Option<ClusterMap> {
    map.memnode(node)?;
    let mut next = map.clone();
    if next.joining.is_empty() {
        next.joining = vec![Vec::new(); next.partitions.len()];
    }
    let mut changed = false;
    for (set, joining) in next.partitions.iter().zip(&mut next.joining) {
        let room = set.len() + joining.len() < usize::from(map.replicas);
        if room && !set.contains(&node) && !joining.contains(&node) {
            joining.push(node);
            changed = true;
        }
    }
    if !changed {
        return None;
    }
    next.epoch += 1;
    debug_assert!(next.check().is_ok(), "joining only where there is room keeps the map valid");
    Some(next)
}

/// The partitions `node` is joining in `map` to fill: those whose replica set is short of
/// R (a joiner of a full set is a move's, `membership.rs`, which its mover finishes).
pub fn joined_by(map: &ClusterMap, node: u64) -> Vec<usize> {
    let short = |p: usize| map.partitions[p].len() < usize::from(map.replicas);
    (0..map.partitions.len()).filter(|&p| short(p) && map.joining_of(p).contains(&node)).collect()
}

/// The map with `node` moved from joining to the last replica of each of `partitions` it
/// still joins to fill, one epoch later; None when it joins none of them any more (failover
/// took it out meanwhile).
pub fn finish_joining(map: &ClusterMap, node: u64, partitions: &[usize]) -> Option<ClusterMap> {
    let mut next = map.clone();
    let mut changed = false;
    let fill = joined_by(map, node);
    for &p in partitions.iter().filter(|p| fill.contains(p)) {
        let Some(joining) = next.joining.get_mut(p) else { continue };
        if let Some(i) = joining.iter().position(|&id| id == node) {
            joining.remove(i);
            next.partitions[p].push(node);
            changed = true;
        }
    }
    if !changed {
        return None;
    }
    next.normalize_joining();
    next.epoch += 1;
    debug_assert!(next.check().is_ok(), "a joiner becoming a replica keeps the map valid");
    Some(next)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::failover::without;
    use crate::map::sample as map;
    use proptest::prelude::*;

    proptest! {
        /// A memnode failed over and back: it joins exactly the partitions it left (those
        /// now short of R), never as primary, and finishing makes every one of them whole
        /// again; failing it over while it joins takes it out of the joining lists.
        #[test]
        fn a_failed_over_memnode_rejoins_what_it_left(n in 2usize..7, replicas in 2u8..=5, pick in any::<u8>()) {
            let ids: Vec<u64> = (1..=n as u64).collect();
            let whole = map(&ids, replicas);
            let node = ids[usize::from(pick) % n];
            let Some(degraded) = without(&whole, &BTreeSet::from([node])) else { return Ok(()) };
            let joining = start_joining(&degraded, node).expect("it left some partitions");
            prop_assert!(joining.check().is_ok());
            prop_assert_eq!(joining.epoch, degraded.epoch + 1);
            prop_assert_eq!(&joining.partitions, &degraded.partitions, "replica sets unchanged while joining");
            let left: Vec<usize> = (0..whole.partitions.len()).filter(|&p| whole.partitions[p].contains(&node)).collect();
            prop_assert_eq!(joined_by(&joining, node), left.clone());
            prop_assert!(start_joining(&joining, node).is_none(), "joining twice changes nothing");
            for (p, set) in joining.write_sets().iter().enumerate() {
                prop_assert_eq!(set[0], degraded.partitions[p][0], "the primary leads every write set");
            }
            let done = finish_joining(&joining, node, &left).unwrap();
            prop_assert!(done.check().is_ok());
            prop_assert!(done.joining.is_empty());
            prop_assert!(done.partitions.iter().all(|set| set.len() == whole.partitions[0].len()));
            for p in &left {
                prop_assert_eq!(done.partitions[*p].last(), Some(&node));
            }
            let failed_again = without(&joining, &BTreeSet::from([node])).unwrap();
            prop_assert!(joined_by(&failed_again, node).is_empty());
            prop_assert!(finish_joining(&failed_again, node, &left).is_none());
        }
    }

    #[test]
    fn nothing_to_join_in_a_whole_map_or_for_an_unlisted_memnode() {
        let whole = map(&[1, 2, 3], 2);
        assert!(start_joining(&whole, 1).is_none());
        assert!(start_joining(&whole, 9).is_none());
        assert!(finish_joining(&whole, 1, &[0, 1]).is_none());
    }
}
