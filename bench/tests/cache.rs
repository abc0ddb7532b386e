//! `racekv bench cache` end to end at a small size: every policy asked runs on
//! redis-server, racekv runs those it implements (and says why not the others), the caches
//! evict and hit, and nothing fails. No timing thresholds: the machine is shared.

use clap::Parser;
use racekv_bench::cache::{self, CacheArgs, Server};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: CacheArgs,
}

#[test]
fn every_policy_runs_and_the_caches_hit_and_evict_without_errors() {
    let plots = tempfile::tempdir().unwrap();
    let plot_dir = plots.path().display().to_string();
    // 40 MB of data, a 4 MB limit: well above redis-server's own ~1 MB, which its limit counts.
    let cli = Cli::parse_from([
        "cache",
        "--keys",
        "20000",
        "--value-size",
        "2000",
        "--policies",
        "allkeys-random,volatile-ttl,allkeys-lru",
        "--warmup-ops",
        "4000",
        "--ops",
        "4000",
        "--get-ops",
        "2000",
        "--threads",
        "1",
        "--connections",
        "2",
        "--rounds",
        "1",
        "--get-runs",
        "2",
        "--plot-dir",
        &plot_dir,
    ]);
    let report = cache::run(&cli.args).unwrap();
    assert_eq!(report.maxmemory_bytes, report.dataset_bytes / 10);
    for run in &report.runs {
        let what = format!("{} {}", run.policy, run.server.name());
        assert_eq!(run.ops, 4000, "{what}");
        assert_eq!((run.errors, run.unexpected_replies), (0, 0), "{what}: {:?}", run.first_error);
        assert!(run.hit_ratio > 0.0 && run.hit_ratio < 1.0, "{what}: hit ratio {}", run.hit_ratio);
        assert!(run.evicted_keys.is_some_and(|n| n > 0), "{what}: evicted {:?}", run.evicted_keys);
    }
    for p in &report.policies {
        assert!(p.redis_hit_ratio.is_some(), "redis-server runs every policy: {}", p.policy);
        assert_ne!(p.racekv_hit_ratio.is_some(), p.racekv_skipped.is_some(), "{p:?}");
    }
    for policy in ["allkeys-random", "volatile-ttl"] {
        let ran = report.runs.iter().filter(|r| r.policy == policy && r.server == Server::Racekv).count();
        assert_eq!(ran, 1, "racekv implements {policy}");
    }
    let gets = &report.get_throughput;
    assert_eq!((gets.cache_mode_ops_per_sec.len(), gets.no_limit_ops_per_sec.len()), (1, 1));
    assert!(gets.ratio > 0.0 && gets.errors == 0, "{gets:?}");
    assert_eq!(gets.hit_ratio, 1.0, "every key is there for the GET comparison");
    assert!(report.plots.len() <= 1, "{:?}", report.plots);
    for plot in &report.plots {
        assert!(std::fs::metadata(plot).unwrap().len() > 1000, "{plot}");
    }
}
