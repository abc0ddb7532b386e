//! `racekv bench txn` end to end at a tiny size: every kind runs, the round trips are
//! counted, the contended transfers keep the total (the run checks it) and commit. No
//! timing thresholds: the machine is shared.

use clap::Parser;
use racekv_bench::txn::{self, TxnArgs};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: TxnArgs,
}

#[test]
fn every_kind_runs_and_the_contended_transfers_keep_the_total() {
    let plots = tempfile::tempdir().unwrap();
    let plot = plots.path().join("txn.png").display().to_string();
    let cli = Cli::parse_from(["txn", "--ops", "300", "--seconds", "0.5", "--threads", "3", "--plot", &plot]);
    let report = txn::run(&cli.args).unwrap();
    assert_eq!(report.uncontended.len(), 4);
    for kind in &report.uncontended {
        assert!(kind.ops_per_sec > 0.0 && kind.round_trips_per_op >= 1.0, "{kind:?}");
    }
    // Two SETs of existing keys: at least two round trips each.
    assert!(report.uncontended[1].round_trips_per_op >= 4.0, "{:?}", report.uncontended[1]);
    assert!(report.contended_commits_per_sec > 0.0, "{report:?}");
    assert!((0.0..1.0).contains(&report.contended_abort_rate), "{report:?}");
}
