//! The MCS-style queue that elects a leader and lets it coalesce everyone queued behind it.
//!
//! Each caller enqueues a [`Node`] that lives on its own stack with one atomic swap of the
//! queue's tail (as in an MCS lock). A caller whose predecessor is null is the leader; the
//! others link themselves behind their predecessor and wait on their own node (spinning
//! briefly, then parking), so waiting costs no shared cache line. The leader walks the chain
//! from its own node, takes up to a message's worth of requests (everyone who queued while
//! the previous leader was sending), sends them as one message, marks each taken node
//! served, and hands leadership to the first node it did not take. Taken followers are not
//! woken: they wait on for their response, and whoever delivers it wakes them, so a request
//! costs its thread one wake-up, not two.
//!
//! Safety argument for the raw pointers (the module's only `unsafe`): a node is reachable
//! from the queue (tail or a predecessor's `next`) only while its owner is blocked in
//! [`Queue::join`] waiting for its state to leave `WAITING`. The leader reads a node's
//! payload and `next` strictly before publishing that node's new state (release), and never
//! touches it afterwards; the owner returns only after observing the new state (acquire).

use std::cell::Cell;
use std::marker::PhantomData;
use std::ptr;
use std::sync::atomic::{AtomicPtr, AtomicU8, Ordering};
use std::thread::Thread;
use std::time::Duration;

const WAITING: u8 = 0;
const LEADER: u8 = 1;
const SERVED: u8 = 2;

/// Spins before parking (a leader usually finishes within a microsecond or two).
const SPINS: u32 = 64;
/// How long an answered follower sleeps between looks at its node (the leader is about to
/// publish it and does not wake it).
const ANSWERED_SLICE: Duration = Duration::from_micros(50);
/// Backstop for a missed unpark (never expected).
const PARK_SLICE: Duration = Duration::from_millis(20);

/// A queued request; `T` is what the leader needs to send it.
pub(crate) struct Node<T> {
    next: AtomicPtr<Node<T>>,
    state: AtomicU8,
    thread: Thread,
    item: T,
    /// Not Sync/Send-shared by accident: only the queue protocol passes it across threads.
    _pin: PhantomData<Cell<()>>,
}

impl<T> Node<T> {
    pub fn new(item: T) -> Self {
        Self {
            next: AtomicPtr::new(ptr::null_mut()),
            state: AtomicU8::new(WAITING),
            thread: std::thread::current(),
            item,
            _pin: PhantomData,
        }
    }
}

/// The tail of the queue.
pub(crate) struct Queue<T> {
    tail: AtomicPtr<Node<T>>,
}

// SAFETY: the queue holds only pointers to nodes whose items are `Send` and that are handed
// between threads under the protocol above.
unsafe impl<T: Send> Send for Queue<T> {}
// SAFETY: as above; all shared state is atomic.
unsafe impl<T: Send> Sync for Queue<T> {}

/// What [`Queue::join`] ended with.
pub(crate) enum Joined<'a, T> {
    /// This caller leads: it must send the batch and then call [`Leader::finish`].
    Leader(Leader<'a, T>),
    /// Another leader took (and sent, or failed) this caller's request.
    Served,
}

/// The leader's hold on the queue and on the nodes it took.
pub(crate) struct Leader<'a, T> {
    queue: &'a Queue<T>,
    taken: Vec<*const Node<T>>,
    /// The first taken node is the leader's own (not waiting) rather than a follower's.
    own_first: bool,
}

impl<T: Send> Default for Queue<T> {
    fn default() -> Self {
        Self { tail: AtomicPtr::new(ptr::null_mut()) }
    }
}

impl<T: Send> Queue<T> {
    /// Enqueues `node` and waits until this caller leads or its request was taken.
    /// `answered(item)` tells whether the request already has its answer (delivered by a
    /// reader before the leader got round to publishing the node): then the owner only
    /// yields until the publication, which is imminent, instead of parking.
    pub fn join<'a>(&'a self, node: &'a Node<T>, answered: impl Fn(&T) -> bool) -> Joined<'a, T> {
        let me = node as *const Node<T> as *mut Node<T>;
        let prev = self.tail.swap(me, Ordering::AcqRel);
        if !prev.is_null() {
            // SAFETY: `prev` is still queued (its owner waits until a leader moves it on,
            // which happens only after reading its `next`, which we are about to set).
            unsafe { (*prev).next.store(me, Ordering::Release) };
            let mut spins = 0;
            loop {
                match node.state.load(Ordering::Acquire) {
                    WAITING => {}
                    LEADER => break,
                    _ => return Joined::Served,
                }
                if spins < SPINS {
                    spins += 1;
                    std::hint::spin_loop();
                } else if answered(&node.item) {
                    // The leader publishes within microseconds; sleep briefly rather than
                    // keep a runnable thread yielding on a busy core.
                    std::thread::park_timeout(ANSWERED_SLICE);
                } else {
                    std::thread::park_timeout(PARK_SLICE);
                }
            }
        }
        Joined::Leader(Leader { queue: self, taken: vec![me], own_first: true })
    }
}

impl<'a, T: Send> Leader<'a, T> {
    /// Takes followers queued behind the last taken node while `accept(item)` says yes (it
    /// sees each candidate once, in queue order; the leader's own item is always taken).
    pub fn collect(&mut self, mut accept: impl FnMut(&T) -> bool) {
        loop {
            let last = *self.taken.last().expect("the leader's own node");
            // SAFETY: taken nodes stay valid until `finish` publishes their state.
            let next = unsafe { (*last).next.load(Ordering::Acquire) };
            if next.is_null() {
                // Nobody linked behind `last` yet. If `last` is not the tail, someone swapped
                // in and is about to link; the batch is complete without them.
                return;
            }
            // SAFETY: `next` is queued and waiting; its item is read-only until we publish.
            if !accept(unsafe { &(*next).item }) {
                return;
            }
            self.taken.push(next);
        }
    }

    /// The taken items, leader's first.
    pub fn items(&self) -> impl Iterator<Item = &T> + '_ {
        // SAFETY: as in `collect`.
        self.taken.iter().map(|&n| unsafe { &(*n).item })
    }

    pub fn len(&self) -> usize {
        self.taken.len()
    }

    /// After a batch went out: if nobody queued behind it, releases the queue and returns
    /// false (nothing more to do). Otherwise publishes the batch's followers as served and
    /// takes the first queued node as the start of a new batch, which this (already
    /// running) thread sends too: leadership stays with a running thread instead of waiting
    /// for a parked successor to be scheduled.
    pub fn advance(&mut self) -> bool {
        // Let threads that were just woken (by responses) run and queue up behind us first:
        // with more threads than cores they are runnable but not running, and the next
        // batch is only as large as the queue.
        std::thread::yield_now();
        let Some(successor) = self.successor() else {
            self.publish(false);
            self.taken.clear();
            return false;
        };
        self.publish(false);
        self.taken.clear();
        self.taken.push(successor);
        self.own_first = false;
        true
    }

    /// The node queued right behind the last taken one, or `None` after releasing the queue
    /// (the tail was the last taken node).
    fn successor(&self) -> Option<*mut Node<T>> {
        let last = *self.taken.last()? as *mut Node<T>;
        // SAFETY: `last` is valid until published.
        let successor = unsafe { (*last).next.load(Ordering::Acquire) };
        if !successor.is_null() {
            return Some(successor);
        }
        if self.queue.tail.compare_exchange(last, ptr::null_mut(), Ordering::AcqRel, Ordering::Acquire).is_ok() {
            return None;
        }
        // Someone swapped in behind `last` and is linking: wait for the link. That thread
        // may have been preempted between its swap and its store (more threads than cores),
        // so yield the CPU after a short spin rather than burn our time slice.
        let mut spins = 0u32;
        loop {
            // SAFETY: as above.
            let successor = unsafe { (*last).next.load(Ordering::Acquire) };
            if !successor.is_null() {
                return Some(successor);
            }
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Marks the taken followers served (their owners may leave once they see it).
    fn publish(&self, wake: bool) {
        let followers = if self.own_first { &self.taken[1..] } else { &self.taken[..] };
        for &node in followers {
            // SAFETY: waiting and valid until this store; we touch nothing after it except
            // the thread handle we cloned before.
            let thread = wake.then(|| unsafe { (*node).thread.clone() });
            // SAFETY: still waiting and valid: the owner may free the node only once it
            // sees this store, and nothing here reads the node after it.
            unsafe { (*node).state.store(SERVED, Ordering::Release) };
            if let Some(t) = thread {
                t.unpark();
            }
        }
    }

    /// Publishes every taken follower as served and passes leadership on. `wake` says
    /// whether served followers must be woken now (they must when their request failed to
    /// go out; a sent request's owner is woken by whoever delivers its response).
    pub fn finish(self, wake: bool) {
        if self.taken.is_empty() {
            return;
        }
        // Find the successor before anyone taken may leave (their nodes hold the chain).
        let successor = self.successor();
        self.publish(wake);
        if let Some(successor) = successor {
            // SAFETY: the successor waits for exactly this store.
            let thread = unsafe { (*successor).thread.clone() };
            // SAFETY: as above: the successor stays queued until it sees this store, and
            // nothing here reads its node after it.
            unsafe { (*successor).state.store(LEADER, Ordering::Release) };
            thread.unpark();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Mutex;

    #[test]
    fn every_item_is_taken_exactly_once_and_batches_form() {
        let queue = Queue::<(usize, usize)>::default();
        let seen = Mutex::new(vec![0u32; 8 * 2000]);
        let batches = AtomicUsize::new(0);
        let items = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for t in 0..8 {
                let (queue, seen, batches, items) = (&queue, &seen, &batches, &items);
                s.spawn(move || {
                    for i in 0..2000 {
                        let node = Node::new((t, i));
                        if let Joined::Leader(mut leader) = queue.join(&node, |_| false) {
                            let mut n = 0;
                            leader.collect(|_| {
                                n += 1;
                                n < 16
                            });
                            {
                                let mut seen = seen.lock().unwrap();
                                for &(t, i) in leader.items() {
                                    seen[t * 2000 + i] += 1;
                                }
                            }
                            batches.fetch_add(1, Ordering::Relaxed);
                            items.fetch_add(leader.len(), Ordering::Relaxed);
                            leader.finish(true);
                        }
                    }
                });
            }
        });
        assert!(seen.lock().unwrap().iter().all(|&n| n == 1), "an item was lost or taken twice");
        assert_eq!(items.load(Ordering::Relaxed), 8 * 2000);
        assert!(batches.load(Ordering::Relaxed) <= 8 * 2000);
    }
}
