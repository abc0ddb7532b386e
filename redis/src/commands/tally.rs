//! A connection's command figures, gathered while it runs a pipeline and added to the
//! shared ones once: the per-command histogram and counters, `INFO`'s command total,
//! commandstats and keyspace hits are atomics every event loop writes, and adding to them
//! command by command bounced their cache lines between the loops' cores on every command.
//! The client publishes its tally before any command other than GET and SET runs (so what
//! reads them, `INFO` first, counts every command before it) and when a pipeline ends (so a
//! client that has its replies sees its commands counted).

use prometheus::local::LocalHistogram;

use crate::info::{CommandCounts, Outcome, ServerStats};
use crate::metrics::CommandMetrics;

/// What one connection ran since it last published (see the module doc).
#[derive(Default)]
pub(super) struct Tally {
    /// One entry per command (metrics index) this connection ran, kept between publishes: a
    /// local histogram costs an allocation to make.
    timed: Vec<Timed>,
    /// Per catalog id, for `INFO commandstats`; emptied by each publish.
    stats: Vec<(u16, CommandCounts)>,
    commands: u64,
    hits: u64,
    misses: u64,
}

struct Timed {
    metrics_index: usize,
    seconds: LocalHistogram,
    ok: u64,
    error: u64,
}

/// Most distinct catalog ids gathered before a publish (a pipeline of many different
/// commands publishes early rather than searching a long list).
const MAX_STATS: usize = 8;

impl Tally {
    /// One executed command (`metrics[metrics_index]`): its time and whether it failed.
    pub fn record(&mut self, metrics: &[CommandMetrics], metrics_index: usize, seconds: f64, error: bool) {
        let timed = match self.timed.iter().position(|t| t.metrics_index == metrics_index) {
            Some(i) => &mut self.timed[i],
            None => {
                let seconds = metrics[metrics_index].seconds.local();
                self.timed.push(Timed { metrics_index, seconds, ok: 0, error: 0 });
                self.timed.last_mut().expect("just pushed")
            }
        };
        timed.seconds.observe(seconds);
        if error {
            timed.error += 1;
        } else {
            timed.ok += 1;
        }
        self.commands += 1;
    }

    /// One command of catalog id `id` for `INFO commandstats`. Returns whether the tally is
    /// full and should be published.
    pub fn command_stat(&mut self, id: u16, micros: u64, outcome: Outcome) -> bool {
        let i = self.stats.iter().position(|&(stat_id, _)| stat_id == id).unwrap_or_else(|| {
            self.stats.push((id, CommandCounts::default()));
            self.stats.len() - 1
        });
        self.stats[i].1.add(outcome, micros);
        self.stats.len() >= MAX_STATS
    }

    /// One key looked up by a reading command (`INFO`'s keyspace hits and misses).
    pub fn lookup(&mut self, hit: bool) {
        if hit {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
    }

    /// Adds everything gathered to the shared figures and starts again.
    pub fn publish(&mut self, stats: &ServerStats, metrics: &[CommandMetrics]) {
        if self.commands == 0 && self.stats.is_empty() && self.hits == 0 && self.misses == 0 {
            return;
        }
        for timed in &mut self.timed {
            timed.seconds.flush();
            let counters = &metrics[timed.metrics_index];
            if timed.ok > 0 {
                counters.ok.inc_by(timed.ok);
            }
            if timed.error > 0 {
                counters.error.inc_by(timed.error);
            }
            (timed.ok, timed.error) = (0, 0);
        }
        stats.commands_done(self.commands);
        for (id, counts) in self.stats.drain(..) {
            stats.command_stats(id, &counts);
        }
        stats.keyspace_lookups(self.hits, self.misses);
        (self.commands, self.hits, self.misses) = (0, 0, 0);
    }
}
