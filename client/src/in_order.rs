//! Pipelined GETs across memnodes: values as consecutive [`Session::get`]s would return
//! them, each key read after every key before it (`TableClient::get_many_in_order`).
//!
//! Keys of one memnode that follow each other travel together, two round trips a run. When
//! the keys alternate between memnodes (a Redis pipeline of random keys), that is two round
//! trips for nearly every key; instead each memnode's keys are read in one go, memnode
//! after memnode, and then every memnode but the last reads its slots again
//! (`racekv_hashing::Witness`): unchanged within the grace period, each of those values
//! held from its read until after the last memnode's reads, so every key can be placed,
//! in pipeline order, among the last memnode's reads, which keep their own order. Three
//! round trips a memnode, less one, whatever the interleaving. An absent key, a key on the
//! single-key path or a changed slot on any but the last memnode sends the whole run the
//! first way.

use crate::error::ClientError;
use crate::session::{group_routes, Redo, Session, Shards};

impl<S: Shards> Session<S> {
    /// Values of `keys` as consecutive [`Session::get`]s would return them (module doc).
    pub fn get_in_order(&mut self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, ClientError> {
        self.under_map(keys.iter().copied(), Redo::Yes, |s| {
            let routes: Vec<usize> = keys.iter().map(|k| s.route(k)).collect();
            let runs = 1 + routes.windows(2).filter(|pair| pair[0] != pair[1]).count();
            // Two memnodes' 5 round trips beat no fewer than 3 runs' 6.
            if runs >= 3 {
                let groups = group_routes(routes.iter().copied());
                if 3 * groups.len() - 1 < 2 * runs {
                    if let Some(values) = s.get_witnessed(keys, &groups)? {
                        return Ok(values);
                    }
                }
            }
            s.get_runs_in_order(keys, &routes)
        })
    }

    /// [`Session::get_in_order`]'s values where each memnode's keys take one read: all keys
    /// on one memnode, or several memnodes' reads whose witnesses hold. None where the keys
    /// would need the run-at-a-time way (an absent key or one on the single-key path off the
    /// last memnode, a changed slot, a read that took past the grace period) or a memnode's
    /// transport reads them key by key (verbs), without reading them then: the caller splits
    /// the keys into shorter runs. For runs gathered from several callers, none of whom
    /// should pay for a whole gathered run read a run at a time.
    pub fn get_in_order_grouped(&mut self, keys: &[&[u8]]) -> Result<Option<Vec<Option<Vec<u8>>>>, ClientError> {
        self.under_map(keys.iter().copied(), Redo::Yes, |s| {
            let groups = group_routes(keys.iter().map(|k| s.route(k)));
            for (shard, _) in &groups {
                if !s.shards_mut().client(*shard)?.reads_in_order_together() {
                    return Ok(None);
                }
            }
            match groups.as_slice() {
                [] => Ok(Some(Vec::new())),
                [(shard, _)] => s.on(*shard, |c| c.get_many_in_order(keys)).map(Some),
                _ => s.get_witnessed(keys, &groups),
            }
        })
    }

    /// Each run of consecutive keys of one memnode in one `get_many_in_order`.
    fn get_runs_in_order(&mut self, keys: &[&[u8]], routes: &[usize]) -> Result<Vec<Option<Vec<u8>>>, ClientError> {
        let mut out = Vec::with_capacity(keys.len());
        let mut start = 0;
        while start < keys.len() {
            let shard = routes[start];
            let end = (start + 1..keys.len()).find(|&i| routes[i] != shard).unwrap_or(keys.len());
            out.extend(self.on(shard, |c| c.get_many_in_order(&keys[start..end]))?);
            start = end;
        }
        Ok(out)
    }

    /// Each memnode's keys (`groups`: memnode, key indices) in one read, then every memnode
    /// but the last checks its values still hold; None when a value has no witness or a
    /// witness fails.
    fn get_witnessed(
        &mut self,
        keys: &[&[u8]],
        groups: &[(usize, Vec<usize>)],
    ) -> Result<Option<Vec<Option<Vec<u8>>>>, ClientError> {
        let mut out = vec![None; keys.len()];
        let mut witnesses = Vec::with_capacity(groups.len());
        for (n, (shard, indices)) in groups.iter().enumerate() {
            let subset: Vec<&[u8]> = indices.iter().map(|&i| keys[i]).collect();
            let (values, witness) = self.on(*shard, |c| c.get_many_witnessed(&subset))?;
            assert_eq!(
                values.len(),
                indices.len(),
                "a memnode returned {} values for {} keys",
                values.len(),
                indices.len()
            );
            for (&i, value) in indices.iter().zip(values) {
                out[i] = value;
            }
            let last = n + 1 == groups.len();
            match witness {
                _ if last => {}
                Some(witness) => witnesses.push((*shard, witness)),
                None => return Ok(None),
            }
        }
        for (shard, witness) in &witnesses {
            if !self.on(*shard, |c| c.witness_holds(witness))? {
                return Ok(None);
            }
        }
        Ok(Some(out))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use racekv_hashing::testing::{TestMemnode, Via};
    use racekv_transport::TransportKind;

    use crate::session::{Session, Shards};
    use crate::{Client, Path};

    fn cluster(n: usize) -> (Vec<TestMemnode>, Client) {
        let memnodes: Vec<_> =
            (0..n).map(|_| TestMemnode::start(Via::Transport(TransportKind::Tcp), 32 << 20, 8)).collect();
        let client = Client::builder()
            .memnodes(memnodes.iter().map(|m| m.endpoint().unwrap().to_string()))
            .token(TestMemnode::TOKEN)
            .timeout(Duration::from_secs(10))
            .connect()
            .unwrap();
        (memnodes, client)
    }

    fn round_trips<S: Shards>(s: &mut Session<S>) -> u64 {
        (0..s.shards().count()).map(|i| s.shards_mut().client(i).unwrap().stats().round_trips).sum()
    }

    /// `get_in_order` on the embedded session, with the table round trips it took.
    fn get_in_order(client: &Client, keys: &[&[u8]]) -> (Vec<Option<Vec<u8>>>, u64) {
        let Path::Embedded(c) = client.path() else { panic!("an embedded client") };
        c.with(|s| {
            let before = round_trips(s);
            let values = s.get_in_order(keys).unwrap();
            (values, round_trips(s) - before)
        })
    }

    /// A key absent from the cluster that routes where `key` does.
    fn absent_beside(client: &Client, key: &[u8]) -> Vec<u8> {
        let Path::Embedded(c) = client.path() else { panic!("an embedded client") };
        c.with(|s| (0..).map(|i| format!("absent-{i}").into_bytes()).find(|k| s.route(k) == s.route(key)).unwrap())
    }

    #[test]
    fn interleaved_keys_are_read_once_per_memnode_and_checked() {
        let (_memnodes, client) = cluster(3);
        let names: Vec<Vec<u8>> = (0..48).map(|i| format!("k{i}").into_bytes()).collect();
        for n in &names {
            client.put(n, n).unwrap();
        }
        let keys: Vec<&[u8]> = names.iter().map(|n| &n[..]).collect();
        get_in_order(&client, &keys); // connects every memnode's table client
        let (values, round_trips) = get_in_order(&client, &keys);
        assert_eq!(values, names.iter().map(|n| Some(n.clone())).collect::<Vec<_>>());
        // Three memnodes: a read (2) each and a check (1) for the first two.
        assert_eq!(round_trips, 8, "48 keys alternating between 3 memnodes");
        // An absent key: the runs, one by one, and the same answers.
        // (On the first memnode read: the last one's absent keys need no check.)
        let absent = absent_beside(&client, keys[0]);
        let mut with_absent = keys.clone();
        with_absent.insert(7, &absent);
        let (values, round_trips) = get_in_order(&client, &with_absent);
        assert_eq!(values[7], None);
        assert_eq!(values.iter().flatten().count(), 48);
        assert!(round_trips > 8, "the absent key sends the run the first way: {round_trips} round trips");
        assert_eq!(get_in_order(&client, &[]).0, Vec::<Option<Vec<u8>>>::new());
    }

    /// The pipeline order through writes: a writer sets keys 0..N to version v in that
    /// order, again and again; readers look the keys (spread over three memnodes) up in
    /// reverse order, so once a read sees version v of key i, every later read (keys below
    /// i, written before it) must see v or newer.
    #[test]
    fn reads_across_memnodes_keep_their_order() {
        const KEYS: usize = 36;
        const READS: usize = 400;
        let (_memnodes, client) = cluster(3);
        let names: Vec<Vec<u8>> = (0..KEYS).map(|i| format!("ordered-{i}").into_bytes()).collect();
        let reversed: Vec<&[u8]> = names.iter().rev().map(|n| &n[..]).collect();
        for n in &names {
            client.put(n, &0u64.to_le_bytes()).unwrap();
        }
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            let writer = s.spawn(|| {
                let mut version = 1u64;
                while !done.load(Ordering::Relaxed) {
                    for n in &names {
                        client.put(n, &version.to_le_bytes()).unwrap();
                    }
                    version += 1;
                }
                version
            });
            let readers: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        for _ in 0..READS {
                            let versions: Vec<u64> = get_in_order(&client, &reversed)
                                .0
                                .iter()
                                .map(|v| u64::from_le_bytes(v.as_deref().unwrap().try_into().unwrap()))
                                .collect();
                            assert!(
                                versions.windows(2).all(|w| w[0] <= w[1]),
                                "a later read saw an older write than an earlier read: {versions:?}"
                            );
                        }
                    })
                })
                .collect();
            let results: Vec<_> = readers.into_iter().map(|r| r.join()).collect();
            done.store(true, Ordering::Relaxed);
            let versions = writer.join().unwrap();
            results.into_iter().for_each(|r| r.unwrap());
            assert!(versions > 2, "the writer wrote during the reads");
        });
    }
}
