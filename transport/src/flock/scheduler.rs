//! The receiver's credit scheduler.
//!
//! Every lane (one connection of one sender) starts with what [`Scheduler::open`] grants, up
//! to C credits (one credit = one request). A sender asks for more after using half
//! ([`super::message::FLAG_RENEW`], or write-with-immediate on verbs); [`Scheduler::renew`]
//! answers with a grant or a refusal (0 credits), which deactivates the lane until a later
//! renewal is granted. A grant tops the lane's window back up to C: C minus the credits the
//! sender still holds as far as the receiver has seen, and at least the C/2 a renewal stands
//! for (the receiver's view lags when renewals travel beside the ring). Granting a fixed C
//! per renewal would grow the sender's unused credits by C/2 each time until the overload
//! caps below refused its lanes for no load at all. The decision:
//!
//! 1. **Overload first.** Credits are the receiver's queue: a lane's *exposure* is what it
//!    was granted minus what was answered. A grant must keep the receiver's total exposure
//!    within `max_outstanding`, and keep the lane's own backlog within `max_queue_delay` at
//!    the measured service time per request (an EWMA). A memnode with a slow handler thus
//!    grants less, then nothing, instead of queueing without bound; senders wait for credits
//!    and fail with a clear error after their timeout, and nothing they did not send can
//!    have executed.
//! 2. **Active lanes are capped** at `max_active` (FLOCK's MAX_AQP) over all senders, and
//!    shared out in proportion to each sender's weight, its reported coalescing degree times
//!    its request rate. Every sender keeps at least one active lane (a dormant sender is left
//!    one, so it never waits for a slot to come back). A renewal on a lane beyond its
//!    sender's share is refused (the sender moves its threads to its other lanes); a renewal
//!    on an inactive lane is granted when its sender is under its share and a slot is free.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use super::metrics::METRICS;

/// Scheduler limits (part of [`crate::ServerOptions`]).
#[derive(Debug, Clone)]
pub struct SchedulerOptions {
    /// Credits per grant (C).
    pub credits: u32,
    /// Most active lanes over all senders (MAX_AQP).
    pub max_active: usize,
    /// Most granted-but-unanswered requests over all lanes.
    pub max_outstanding: u64,
    /// Longest backlog a lane may be granted, at the measured service time per request.
    pub max_queue_delay: Duration,
}

impl Default for SchedulerOptions {
    fn default() -> Self {
        Self { credits: 32, max_active: 256, max_outstanding: 256 * 48, max_queue_delay: Duration::from_millis(100) }
    }
}

/// What a sender reports with a renewal.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SenderStats {
    /// Requests per message (EWMA).
    pub degree: f64,
    /// Requests per second.
    pub rate: f64,
}

#[derive(Debug, Default)]
struct LaneState {
    sender: u64,
    active: bool,
    granted: u64,
    answered: u64,
}

#[derive(Debug, Default)]
struct SenderState {
    lanes: usize,
    active: usize,
    weight: f64,
}

#[derive(Debug, Default)]
struct State {
    lanes: HashMap<u64, LaneState>,
    senders: HashMap<u64, SenderState>,
    active: usize,
    exposure: u64,
    next_lane: u64,
}

impl State {
    /// Debug builds: the totals are the sums over lanes and senders (a walk over all of
    /// them, so only where lanes open, renew and close, not per message).
    fn check(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        let exposure: u64 = self.lanes.values().map(|l| l.granted - l.answered).sum();
        assert_eq!(self.exposure, exposure, "exposure is not the lanes' granted minus answered");
        let active = self.lanes.values().filter(|l| l.active).count();
        assert_eq!(self.active, active, "active count is not the active lanes");
        assert_eq!(self.senders.values().map(|s| s.active).sum::<usize>(), active, "senders' active lanes");
        assert_eq!(self.senders.values().map(|s| s.lanes).sum::<usize>(), self.lanes.len(), "senders' lanes");
        assert!(self.senders.values().all(|s| s.active <= s.lanes && s.lanes > 0), "a sender's active lanes");
    }
}

/// The scheduler of one receiver (one region server).
#[derive(Debug)]
pub struct Scheduler {
    options: SchedulerOptions,
    state: Mutex<State>,
    /// Service time per request, EWMA, in nanoseconds.
    service_ns: AtomicU64,
    refusals: AtomicU64,
}

/// A lane's handle in the scheduler; [`Scheduler::close`] it when the lane ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LaneId(u64);

impl Scheduler {
    /// A scheduler with `options`, clamped to workable values.
    pub fn new(options: SchedulerOptions) -> Self {
        let options = SchedulerOptions {
            credits: options.credits.clamp(2, 1 << 16),
            max_active: options.max_active.max(1),
            ..options
        };
        Self {
            options,
            state: Mutex::new(State::default()),
            service_ns: AtomicU64::new(0),
            refusals: AtomicU64::new(0),
        }
    }

    /// Its options, as clamped.
    pub fn options(&self) -> &SchedulerOptions {
        &self.options
    }

    /// Registers a new lane of `sender`; returns it with its initial credits (0: inactive).
    pub fn open(&self, sender: u64) -> (LaneId, u32) {
        let mut state = self.state.lock();
        let id = state.next_lane;
        state.next_lane += 1;
        state.lanes.insert(id, LaneState { sender, ..LaneState::default() });
        state.senders.entry(sender).or_default().lanes += 1;
        METRICS.lanes.inc();
        let grant = self.decide(&mut state, id, None);
        state.check();
        (LaneId(id), grant)
    }

    /// Answers a renewal on `lane`: the credits granted (0 = refused, the lane is inactive).
    /// `unused`: credits granted on the lane that the receiver has not yet seen requests for.
    pub fn renew(&self, lane: LaneId, stats: SenderStats, unused: u64) -> u32 {
        let mut state = self.state.lock();
        let grant = self.decide(&mut state, lane.0, Some((stats, unused)));
        state.check();
        grant
    }

    /// Records `count` requests answered on `lane`, which took `busy` to serve.
    pub fn answered(&self, lane: LaneId, count: u64, busy: Duration) {
        if let Some(per) = (busy.as_nanos() as u64).checked_div(count) {
            let old = self.service_ns.load(Ordering::Relaxed);
            let new = if old == 0 { per } else { old - old / 8 + per / 8 };
            self.service_ns.store(new, Ordering::Relaxed);
        }
        let mut state = self.state.lock();
        let state = &mut *state;
        if let Some(l) = state.lanes.get_mut(&lane.0) {
            let done = count.min(l.granted - l.answered);
            l.answered += done;
            assert!(state.exposure >= done, "answering {done} requests of an exposure of {}", state.exposure);
            state.exposure -= done;
        }
    }

    /// What the scheduler has granted on `lane` and seen answered, in requests: the
    /// receiver's own count of its credits pairs with it (debug builds).
    pub(crate) fn lane_account(&self, lane: LaneId) -> Option<(u64, u64)> {
        self.state.lock().lanes.get(&lane.0).map(|l| (l.granted, l.answered))
    }

    /// Forgets a lane (its connection ended).
    pub fn close(&self, lane: LaneId) {
        let mut state = self.state.lock();
        let state = &mut *state;
        let Some(l) = state.lanes.remove(&lane.0) else { return };
        let open = l.granted - l.answered;
        assert!(state.exposure >= open, "closing a lane exposed to {open} requests of {}", state.exposure);
        state.exposure -= open;
        if l.active {
            state.active -= 1;
            METRICS.active.dec();
        }
        if let Some(s) = state.senders.get_mut(&l.sender) {
            s.lanes -= 1;
            s.active -= usize::from(l.active);
            if s.lanes == 0 {
                state.senders.remove(&l.sender);
            }
        }
        state.check();
        METRICS.lanes.dec();
    }

    /// Active lanes over all senders.
    pub fn active(&self) -> usize {
        self.state.lock().active
    }

    /// Renewals (and lane openings) refused so far.
    pub fn refusals(&self) -> u64 {
        self.refusals.load(Ordering::Relaxed)
    }

    /// Service time per request (EWMA).
    pub fn service_time(&self) -> Duration {
        Duration::from_nanos(self.service_ns.load(Ordering::Relaxed))
    }

    /// The share of active lanes `sender` is due: at least 1, at most its lane count.
    fn share(&self, state: &State, sender: u64) -> usize {
        let Some(me) = state.senders.get(&sender) else { return 1 };
        let total: f64 = state.senders.values().map(|s| s.weight.max(1e-9)).sum();
        let slots = self.options.max_active.saturating_sub(state.senders.len()) as f64;
        // Everyone's one lane first, then the rest in proportion to weight.
        let extra = (slots * me.weight.max(1e-9) / total).round() as usize;
        (1 + extra).min(me.lanes)
    }

    fn set_active(state: &mut State, lane: u64, sender: u64, active: bool) {
        let l = state.lanes.get_mut(&lane).expect("known lane");
        if l.active == active {
            return;
        }
        l.active = active;
        let s = state.senders.get_mut(&sender).expect("known sender");
        if active {
            state.active += 1;
            s.active += 1;
            METRICS.active.inc();
        } else {
            state.active -= 1;
            s.active -= 1;
            METRICS.active.dec();
        }
    }

    fn decide(&self, state: &mut State, lane: u64, renewal: Option<(SenderStats, u64)>) -> u32 {
        let Some(l) = state.lanes.get(&lane) else { return 0 };
        let (sender, was_active, exposure) = (l.sender, l.active, l.granted - l.answered);
        let credits = u64::from(self.options.credits);
        let unused = renewal.map_or(0, |(_, unused)| unused);
        if let (Some((stats, _)), Some(s)) = (renewal, state.senders.get_mut(&sender)) {
            let weight = stats.degree.max(1.0) * stats.rate.max(1.0);
            s.weight = if s.weight == 0.0 { weight } else { s.weight * 0.5 + weight * 0.5 };
        }
        let sender_active = state.senders.get(&sender).map_or(0, |s| s.active);
        let share = self.share(state, sender);
        let may_be_active = if was_active {
            // Keep the sender's last active lane; drop lanes beyond its share.
            sender_active <= share || sender_active == 1
        } else {
            (sender_active < share && state.active < self.options.max_active) || sender_active == 0
        };
        // Top the window up to C (see the module docs); then cap the grant by the receiver's
        // total and the lane's backlog (overload).
        let mut grant = credits.saturating_sub(unused).max(credits / 2);
        grant = grant.min(self.options.max_outstanding.saturating_sub(state.exposure));
        let service = self.service_ns.load(Ordering::Relaxed);
        if let Some(backlog) = (self.options.max_queue_delay.as_nanos() as u64).checked_div(service) {
            // At least one request per lane: when one request takes longer than the whole
            // delay (a large value), a floor of 0 would refuse every lane for good, since
            // only answered requests bring the service time back down.
            grant = grant.min(backlog.max(1).saturating_sub(exposure));
        }
        let grant = if may_be_active { grant } else { 0 };
        Self::set_active(state, lane, sender, grant > 0);
        // Credits granted never exceed the budget: a grant at most C, the receiver's total
        // exposure within `max_outstanding`; a lane's answers never outrun its grants.
        assert!(grant <= credits, "granted {grant} credits, more than the {credits} of a window");
        let l = state.lanes.get_mut(&lane).expect("known lane");
        l.granted += grant;
        assert!(l.answered <= l.granted, "lane {lane}: {} answered of {} granted", l.answered, l.granted);
        assert_eq!(l.active, grant > 0, "lane {lane} active without a grant, or granted while inactive");
        state.exposure += grant;
        assert!(
            state.exposure <= self.options.max_outstanding,
            "exposure {} past max_outstanding {}",
            state.exposure,
            self.options.max_outstanding
        );
        if grant > 0 {
            METRICS.credits_granted.inc_by(grant);
        } else {
            self.refusals.fetch_add(1, Ordering::Relaxed);
            METRICS.renewals_refused.inc();
        }
        grant as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(max_active: usize) -> Scheduler {
        Scheduler::new(SchedulerOptions { max_active, ..SchedulerOptions::default() })
    }

    #[test]
    fn grants_c_and_renews() {
        let s = sched(8);
        let (lane, credits) = s.open(1);
        assert_eq!(credits, 32);
        assert_eq!(s.active(), 1);
        s.answered(lane, 16, Duration::from_micros(16));
        // 16 used, 16 still held: the grant tops the window up to C.
        assert_eq!(s.renew(lane, SenderStats { degree: 4.0, rate: 1e5 }, 16), 16);
        // A sender that ran dry gets a whole window.
        s.answered(lane, 32, Duration::from_micros(32));
        assert_eq!(s.renew(lane, SenderStats { degree: 4.0, rate: 1e5 }, 0), 32);
        s.close(lane);
        assert_eq!(s.active(), 0);
    }

    /// Requests slower than the whole queue delay (large values) still get one credit at a
    /// time per lane, so the service time can come down again; never more while one waits.
    #[test]
    fn requests_slower_than_the_queue_delay_still_go_one_at_a_time() {
        let s = sched(8);
        let (lane, credits) = s.open(1);
        assert_eq!(credits, 32);
        s.answered(lane, 1, Duration::from_secs(2));
        assert!(s.service_time() > s.options().max_queue_delay);
        // 31 credits still held, 31 unanswered: nothing more.
        assert_eq!(s.renew(lane, SenderStats::default(), 31), 0);
        s.answered(lane, 31, Duration::from_secs(62));
        assert_eq!(s.renew(lane, SenderStats::default(), 0), 1, "one request at a time");
        assert_eq!(s.renew(lane, SenderStats::default(), 1), 0, "not a second while it waits");
        s.answered(lane, 1, Duration::from_millis(1));
        assert_eq!(s.renew(lane, SenderStats::default(), 0), 1);
    }

    #[test]
    fn caps_active_lanes_and_shares_by_weight() {
        let s = sched(4);
        // A busy sender with 4 lanes and a dormant one with 2.
        let busy: Vec<_> = (0..4).map(|_| s.open(1)).collect();
        let dormant: Vec<_> = (0..2).map(|_| s.open(2)).collect();
        // A newcomer gets one lane even at the cap; renewals bring the total back under it.
        assert_eq!(s.active(), 5);
        for _ in 0..3 {
            for &(lane, _) in &busy {
                s.answered(lane, 1000, Duration::from_micros(1));
                s.renew(lane, SenderStats { degree: 8.0, rate: 1e6 }, 16);
            }
            for &(lane, _) in &dormant {
                s.answered(lane, 1000, Duration::from_micros(1));
                s.renew(lane, SenderStats { degree: 1.0, rate: 10.0 }, 16);
            }
        }
        let state = s.state.lock();
        assert!(state.active <= 4, "{} active", state.active);
        assert_eq!(state.senders[&2].active, 1, "the dormant sender keeps exactly one lane");
        assert_eq!(state.senders[&1].active, 3, "the busy sender gets the rest");
    }

    #[test]
    fn slow_service_refuses_credits() {
        let s = Scheduler::new(SchedulerOptions { max_queue_delay: Duration::from_millis(100), ..Default::default() });
        let (lane, first) = s.open(9);
        assert_eq!(first, 32);
        // 20 ms per request: a backlog of 5 fits in 100 ms, and 32 are outstanding.
        s.answered(lane, 1, Duration::from_millis(20));
        assert_eq!(s.renew(lane, SenderStats::default(), 0), 0, "overloaded: refused");
        s.answered(lane, 29, Duration::from_millis(20 * 29));
        let grant = s.renew(lane, SenderStats::default(), 0);
        assert!((1..=5).contains(&grant), "partial grant {grant}");
    }

    #[test]
    fn total_exposure_is_bounded() {
        let s = Scheduler::new(SchedulerOptions { max_outstanding: 64, ..Default::default() });
        let grants: Vec<u32> = (0..4).map(|i| s.open(i).1).collect();
        assert_eq!(grants.iter().sum::<u32>(), 64, "{grants:?}");
    }

    /// A lone sender renewing after every half window, for a long time, at a service time
    /// its lanes keep up with: every renewal is granted, every lane stays active, and what
    /// the sender holds never grows past one window (it once grew by C/2 per renewal until
    /// the overload caps refused lanes of an idle receiver).
    #[test]
    fn steady_sender_keeps_its_lanes_and_a_bounded_window() {
        let s = sched(256);
        let lanes: Vec<_> = (0..4).map(|_| s.open(7)).collect();
        // Per lane: (granted, received) as the receiver counts them; the sender holds the rest.
        let mut seen: Vec<(u64, u64)> = lanes.iter().map(|&(_, c)| (u64::from(c), 0)).collect();
        for round in 0..20_000 {
            for (i, &(lane, _)) in lanes.iter().enumerate() {
                let (granted, received) = &mut seen[i];
                let used = (*granted - *received).min(16 + round % 3);
                *received += used;
                s.answered(lane, used, Duration::from_micros(2 * used));
                let grant = s.renew(lane, SenderStats { degree: 8.0, rate: 1e6 }, *granted - *received);
                assert!(grant > 0, "round {round} lane {i}: refused");
                *granted += u64::from(grant);
                assert!(*granted - *received <= 32, "round {round} lane {i}: holds {}", *granted - *received);
            }
        }
        assert_eq!(s.active(), 4);
        assert!(s.state.lock().exposure <= 4 * 32);
    }
}
