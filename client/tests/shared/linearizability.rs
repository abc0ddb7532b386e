//! A porcupine-style linearizability checker (Wing & Gong's search with Lowe's memoization,
//! as the porcupine library does it): given a history of operations, each with the time it
//! was invoked and the time it returned, is there an order of them that respects real time
//! (one that returned before another was invoked comes first) in which a sequential model
//! gives every operation the result it observed?
//!
//! Tests record histories from real clients (transactions over several memnodes, plain
//! reads beside them) and check them here; a failure prints the operations that could not
//! be placed.

use std::collections::{BTreeSet, HashSet};
use std::hash::Hash;
use std::time::Instant;

/// A sequential specification.
pub trait Model {
    /// The state the operations act on.
    type State: Clone + Eq + Hash;
    /// An operation with what it observed.
    type Op: std::fmt::Debug;
    /// The state before any operation.
    fn init(&self) -> Self::State;
    /// The state after `op`, if `op`'s observations are what it would see in `state`.
    fn step(&self, state: &Self::State, op: &Self::Op) -> Option<Self::State>;
}

/// One operation of a history.
#[derive(Debug)]
pub struct Event<Op> {
    /// When it was invoked.
    pub call: Instant,
    /// When it returned.
    pub ret: Instant,
    /// What it did and observed.
    pub op: Op,
}

/// Most search steps a check may take before it gives up (a bound, not a verdict).
const MAX_STEPS: u64 = 50_000_000;

/// The verdict on a history.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// An order exists.
    Linearizable,
    /// None does; the operations linearized on the longest prefix the search found, and
    /// the ones it could not place after them.
    Violation {
        /// How many operations the deepest search placed.
        placed: usize,
    },
    /// The search hit [`MAX_STEPS`].
    Unknown,
}

/// Checks `history` against `model`.
pub fn check<M: Model>(model: &M, history: &[Event<M::Op>]) -> Verdict {
    let n = history.len();
    // Operations in the order of their invocation.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| history[i].call);
    let mut position = vec![0usize; n];
    for (k, &i) in order.iter().enumerate() {
        position[i] = k;
    }
    let mut done = vec![false; n];
    // The operations not placed, by return time: the first one's return is the horizon.
    let mut returns: BTreeSet<(Instant, usize)> = (0..n).map(|i| (history[i].ret, i)).collect();
    // No operation before this position of `order` is left to place.
    let mut low = 0usize;
    let mut seen: HashSet<(Vec<u64>, M::State)> = HashSet::new();
    let mut steps = 0u64;
    let mut deepest = 0usize;
    let state = model.init();
    // Depth-first, one frame per placed operation: (state before it, op placed, next candidate).
    let mut stack: Vec<(M::State, usize, usize)> = Vec::new();
    let mut current = state;
    let mut next_candidate = 0usize;
    loop {
        steps += 1;
        if steps > MAX_STEPS {
            return Verdict::Unknown;
        }
        if stack.len() == n {
            return Verdict::Linearizable;
        }
        // The earliest return among operations not placed: only operations invoked before
        // it may come next (any other would follow an operation that ended before it began).
        let horizon = returns.first().expect("some left").0;
        let mut placed = false;
        let mut k = next_candidate.max(low);
        while k < n {
            let i = order[k];
            k += 1;
            if done[i] {
                continue;
            }
            if history[i].call > horizon {
                break;
            }
            let Some(after) = model.step(&current, &history[i].op) else { continue };
            done[i] = true;
            let key = (bits(&done), after.clone());
            if !seen.insert(key) {
                done[i] = false;
                continue;
            }
            returns.remove(&(history[i].ret, i));
            while low < n && done[order[low]] {
                low += 1;
            }
            stack.push((current.clone(), i, k));
            current = after;
            next_candidate = 0;
            placed = true;
            deepest = deepest.max(stack.len());
            break;
        }
        if placed {
            continue;
        }
        // Nothing fits here: undo the last placement and try its next candidate.
        let Some((before, i, k)) = stack.pop() else {
            return Verdict::Violation { placed: deepest };
        };
        done[i] = false;
        returns.insert((history[i].ret, i));
        low = low.min(position[i]);
        current = before;
        next_candidate = k;
    }
}

fn bits(done: &[bool]) -> Vec<u64> {
    let mut out = vec![0u64; done.len().div_ceil(64)];
    for (i, &d) in done.iter().enumerate() {
        if d {
            out[i / 64] |= 1 << (i % 64);
        }
    }
    out
}

/// Bank accounts: transfers and reads of some accounts, each observing balances.
pub struct Bank {
    /// Accounts.
    pub accounts: usize,
    /// Every account's starting balance.
    pub initial: i64,
}

/// An operation on [`Bank`].
#[derive(Debug, Clone)]
pub enum BankOp {
    /// Read `from` and `to` (seeing these balances), then moved `amount` between them.
    Transfer {
        /// The account debited.
        from: usize,
        /// The account credited.
        to: usize,
        /// Balances seen, `from` then `to`.
        seen: (i64, i64),
        /// The amount moved.
        amount: i64,
    },
    /// Read these accounts and saw these balances (one snapshot, or a single plain read).
    Read(Vec<(usize, i64)>),
}

impl Model for Bank {
    type State = Vec<i64>;
    type Op = BankOp;

    fn init(&self) -> Vec<i64> {
        vec![self.initial; self.accounts]
    }

    fn step(&self, state: &Vec<i64>, op: &BankOp) -> Option<Vec<i64>> {
        match op {
            BankOp::Transfer { from, to, seen, amount } => {
                if (state[*from], state[*to]) != *seen {
                    return None;
                }
                let mut next = state.clone();
                next[*from] -= amount;
                next[*to] += amount;
                Some(next)
            }
            BankOp::Read(seen) => seen.iter().all(|&(a, v)| state[a] == v).then(|| state.clone()),
        }
    }
}

#[test]
fn the_checker_accepts_a_valid_history_and_finds_a_violation() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + std::time::Duration::from_millis(ms);
    let bank = Bank { accounts: 2, initial: 10 };
    let transfer = |seen, amount| BankOp::Transfer { from: 0, to: 1, seen, amount };
    // Two overlapping transfers and a read that sees the second one only after the first.
    let valid = vec![
        Event { call: at(0), ret: at(10), op: transfer((7, 13), 2) },
        Event { call: at(1), ret: at(5), op: transfer((10, 10), 3) },
        Event { call: at(11), ret: at(12), op: BankOp::Read(vec![(0, 5), (1, 15)]) },
    ];
    assert_eq!(check(&bank, &valid), Verdict::Linearizable);
    // A read that saw half of a transfer fits no order.
    let torn = vec![
        Event { call: at(0), ret: at(10), op: transfer((10, 10), 3) },
        Event { call: at(2), ret: at(3), op: BankOp::Read(vec![(0, 7), (1, 10)]) },
    ];
    assert!(matches!(check(&bank, &torn), Verdict::Violation { .. }));
    // A stale read after the transfer returned breaks real-time order.
    let stale = vec![
        Event { call: at(0), ret: at(1), op: transfer((10, 10), 3) },
        Event { call: at(2), ret: at(3), op: BankOp::Read(vec![(0, 10)]) },
    ];
    assert!(matches!(check(&bank, &stale), Verdict::Violation { .. }));
}
