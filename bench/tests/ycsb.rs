//! `racekv bench ycsb` end to end at tiny sizes: every workload against every driver (valkey
//! when a valkey-server is found), each with operations done and no error or unexpected
//! reply. No timing thresholds: the machine is shared.

use clap::Parser;
use racekv_bench::ycsb::{self, Driver, YcsbArgs};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: YcsbArgs,
}

#[test]
fn every_workload_runs_against_every_driver_without_errors() {
    let plots = tempfile::tempdir().unwrap();
    let plot_dir = plots.path().display().to_string();
    let cli = Cli::parse_from([
        "ycsb",
        "--records",
        "2000",
        "--ops",
        "2000",
        "--scan-ops",
        "300",
        "--pipeline",
        "1,4",
        "--distribution",
        "zipfian,uniform",
        "--connections",
        "2",
        "--plot-dir",
        &plot_dir,
        // 120 tiny runs: no waiting for idle servers between them (CI's time).
        "--max-idle-wait-ms",
        "0",
    ]);
    let report = ycsb::run(&cli.args).unwrap();
    let valkey_found = racekv_bench::valkey::find_valkey(None).is_ok();
    assert_eq!(report.drivers.contains(&Driver::Valkey), valkey_found, "{:?}", report.valkey_server);
    if !valkey_found {
        eprintln!("no valkey-server: {:?}", report.valkey_server.missing);
    }
    let natives = report.drivers.iter().filter(|d| d.is_native()).count();
    assert_eq!(natives, 2, "native (lent connections) and native-ring run by default");
    assert_eq!(
        report.loads.len(),
        report.drivers.len() - natives,
        "one load per store (the native drivers share racekv's)"
    );
    assert!(report.loads.iter().all(|l| l.records == 2000 && l.errors == 0));

    let workloads = ["A", "B", "C", "F", "D", "E"];
    let json = serde_json::to_value(&report).unwrap();
    for pipeline in [1, 4] {
        for distribution in ["zipfian", "uniform"] {
            for workload in workloads {
                for driver in &report.drivers {
                    let name = serde_json::to_value(driver).unwrap();
                    let runs: Vec<_> = json["results"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .filter(|r| {
                            r["pipeline"] == pipeline
                                && r["distribution"] == distribution
                                && r["workload"] == workload
                                && r["driver"] == name
                        })
                        .collect();
                    let what = format!("{workload} {name} P{pipeline} {distribution}");
                    assert_eq!(runs.len(), 1, "{what}");
                    let r = runs[0];
                    let expected = if workload == "E" { 300 } else { 2000 };
                    assert_eq!(r["ops"], expected, "{what}");
                    assert!(r["ops_per_sec"].as_f64().unwrap() > 0.0, "{what}");
                    assert_eq!(r["errors"], 0, "{what}: {}", r["first_error"]);
                    assert_eq!(r["unexpected_replies"], 0, "{what}");
                    assert!(!r["latency"].as_array().unwrap().is_empty(), "{what}");
                    if workload == "E" {
                        let keys = r["keys_per_scan"].as_f64().unwrap();
                        assert!(keys > 1.0 && keys <= 100.0, "{what}: {keys} keys per scan");
                    }
                }
            }
        }
    }
    // Reads of loaded keys find them (inserts in flight aside, which D and E may choose).
    for r in json["results"].as_array().unwrap() {
        if ["A", "B", "C", "F"].contains(&r["workload"].as_str().unwrap()) {
            assert_eq!(r["not_found"], 0, "{r}");
        }
    }
    assert_eq!(report.summary.len(), 2 * 2 * workloads.len());
    // Plots: one throughput chart and one CDF grid per configuration, where fonts exist.
    assert!(report.plots.is_empty() || report.plots.len() == 2 * 2 * 2, "{:?}", report.plots);
    for plot in &report.plots {
        assert!(std::fs::metadata(plot).unwrap().len() > 1000, "{plot}");
    }
}
