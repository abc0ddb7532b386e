//! The daemon's [`Lender`]: lends attached clients connections to its memnodes (KRCORE's
//! borrowed connections, [`racekv_client::attach::lending`]) when nothing the daemon does
//! for them would be skipped: the client's user may run every command on every key (a raw
//! connection bypasses every ACL check), no `maxmemory` is set (the daemon's eviction and
//! access tracking would not see the client's operations), and the daemon routes by a
//! fixed ring over shm memnodes only (what the client routes by; a cluster map's changes
//! would not reach it). Each lending dials every memnode anew with the daemon's token.

use std::sync::Arc;

use racekv_client::attach::lending::{LentMemnode, MAX_LENT_MEMNODES};
use racekv_redis::acl::Acl;
use racekv_transport::lend::LentShm;
use racekv_transport::Endpoint;

use crate::attach::{Lender, Refused};
use crate::cluster::Cluster;
use crate::eviction::Eviction;

/// RPC lanes per lent connection: a client's RPCs (heap chunks, splits) are rare.
const LENT_LANES: usize = 1;

/// Lends connections to the memnodes of a [`Cluster`].
pub struct PoolLender {
    cluster: Arc<Cluster>,
    eviction: Arc<Eviction>,
    /// The attach socket's users (None: no user checks).
    acl: Option<Arc<Acl>>,
}

impl std::fmt::Debug for PoolLender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolLender").field("memnodes", &self.cluster.memnodes().len()).finish()
    }
}

impl PoolLender {
    /// A lender over `cluster`'s memnodes, as `eviction` and `acl` allow.
    pub fn new(cluster: Arc<Cluster>, eviction: Arc<Eviction>, acl: Option<Arc<Acl>>) -> Self {
        Self { cluster, eviction, acl }
    }

    /// Why a client attached as `user` may not borrow connections now, if it may not.
    fn refusal(&self, user: Option<&str>) -> Option<String> {
        if let Some(acl) = &self.acl {
            let name = user.unwrap_or(racekv_redis::acl::DEFAULT_USER);
            if !acl.user(name).is_some_and(|u| u.unrestricted()) {
                return Some(format!("user {name} may not run every command on every key"));
            }
        }
        if self.eviction.limits().limit().is_set() {
            return Some("maxmemory is set: writes must go through the daemon's eviction".into());
        }
        if let Some(epoch) = self.cluster.map_epoch() {
            return Some(format!("this computenode routes by a cluster map (epoch {epoch}), not a fixed ring"));
        }
        let memnodes = self.cluster.memnodes();
        if memnodes.len() > MAX_LENT_MEMNODES {
            return Some(format!("{} memnodes (at most {MAX_LENT_MEMNODES} are lent)", memnodes.len()));
        }
        if let Some(m) = memnodes.iter().find(|m| !matches!(m.pool.endpoint(), Endpoint::Shm(_))) {
            return Some(format!("memnode {} is not reached over shm on this host", m.label));
        }
        None
    }
}

impl Lender for PoolLender {
    fn lend(&self, user: Option<&str>) -> Result<Vec<LentMemnode>, Refused> {
        if let Some(reason) = self.refusal(user) {
            return Err(Refused::Policy(reason));
        }
        let memnodes = self.cluster.memnodes();
        let count = memnodes.len() as u16;
        let mut lent = Vec::with_capacity(memnodes.len());
        for (index, m) in memnodes.iter().enumerate() {
            let Endpoint::Shm(path) = m.pool.endpoint() else {
                return Err(Refused::Policy(format!("memnode {} is not reached over shm", m.label)));
            };
            let conn = LentShm::dial(path, self.cluster.connect_options(), LENT_LANES)
                .map_err(|e| Refused::Failed(format!("dialing {}: {e}", m.label)))?;
            lent.push(LentMemnode { index: index as u16, count, node_id: m.node_id, layout: m.layout, conn });
        }
        Ok(lent)
    }

    fn still_allowed(&self, user: Option<&str>) -> bool {
        self.refusal(user).is_none()
    }
}
